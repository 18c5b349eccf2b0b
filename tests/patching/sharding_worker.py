"""One process of the FSDP2 test (run by torch.distributed.run with 2 CPU processes, gloo), or the
single-process reference when started without a WORLD_SIZE.

For every case, one training step of a tiny Llama on a fixed global batch (each process takes its
half of the rows): the loss (averaged over processes) and every parameter's full gradient (gathered
from the FSDP2 shards) are written by rank 0 to OUT_JSON.  The reference is the same patched model,
unsharded, on the whole batch in one process (and, for CE, the unpatched model: case "unpatched");
equal token counts per process make the averaged gradients equal.

Cases (name: wrapping, loss):
  fsdp_root_*      layers are units, the head is in the root unit (accelerate's default policy)
  fsdp_head_*      the head is its own unit: its weight is a sharded DTensor outside its call
  fsdp_lora_*      PEFT LoRA on q_proj, v_proj and lm_head, every LoRA matrix its own unit
  unguarded        fsdp_head with hf_mhce's gathering switched off: must raise ShardedHeadError

Usage: sharding_worker.py OUT_JSON [SINGLE_JSON]  (launched with SINGLE_JSON: rank 0 first writes the
single-process reference there, see launch_helpers.single_reference)
"""

from __future__ import annotations

import os
import sys

import torch

torch.set_num_threads(1)

from patching_models import make_model  # noqa: E402

ROWS, SEQ, VOCAB = 4, 10, 97


def global_batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    return ids, ids.clone()


def build(case: str):
    from peft import LoraConfig, get_peft_model

    if "tokens" in case:  # PEFT's trainable tokens on a tied embedding: its rows enter the tied head too
        model = make_model("llama", seed=0, tied=True)
        return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[1, 5, 7, 50],
                                                init_lora_weights=False))
    model = make_model("llama", seed=0)
    if "lora" in case:
        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"],
                                                 init_lora_weights=False))
    return model


def loss_options(case: str) -> dict:
    if case.endswith("_mhce"):
        return {"loss": "mhce", "num_heads": 2}
    return {"loss": "ce"}


def shard(model, case: str, mesh):
    from torch.distributed.fsdp import fully_shard

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "lora" in case:  # innermost units first
        for name, module in model.named_modules():
            if name.endswith(("lora_A.default", "lora_B.default")):
                fully_shard(module, mesh=mesh)
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh)
    if case.startswith(("fsdp_head", "unguarded")):
        fully_shard(base.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def single_step(model, ids, labels) -> dict:
    """The one-process reference of the other workers: loss and every gradient of one step on the whole batch."""
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return {"loss": loss.item(),
            "grads": {n: p.grad.flatten().tolist() for n, p in model.named_parameters() if p.grad is not None}}


def step(case: str, distributed: bool) -> dict:
    import hf_mhce
    from hf_mhce.patching import sharding

    ids, labels = global_batch()
    model = build(case)
    if case != "unpatched":
        model = hf_mhce.apply_patch(model, **loss_options(case))
    if distributed:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        rank, world = dist.get_rank(), dist.get_world_size()
        model = shard(model, case, init_device_mesh("cpu", (world,)))
        rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
        ids, labels = ids[rows], labels[rows]
    if case == "unguarded":
        sharding.owns_sharded_params = lambda module: False  # what a peer does: read the weight directly
        try:
            model(input_ids=ids, labels=labels).loss.backward()
        except sharding.ShardedHeadError as err:
            return {"error": str(err)}
        return {"error": None}
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    value = loss.detach().clone()
    if distributed:
        import torch.distributed as dist

        dist.all_reduce(value)
        value /= dist.get_world_size()
    return {"loss": value.item(),
            "grads": {n: full(p.grad).flatten().tolist() for n, p in model.named_parameters() if p.grad is not None}}


CASES = ["fsdp_root_ce", "fsdp_root_mhce", "fsdp_head_ce", "fsdp_head_mhce", "fsdp_lora_ce", "fsdp_lora_mhce",
         "unguarded"]


def cases(distributed: bool) -> list[str]:
    return CASES if distributed else ["unpatched", *CASES[:-1]]


def main(out: str) -> None:
    from launch_helpers import finish, single_reference

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        import torch.distributed as dist

        single_reference(lambda: {case: step(case, False) for case in cases(False)}, sys.argv[1:])
        dist.init_process_group("gloo")
    results = {}
    for case in cases(distributed):
        results[case] = step(case, distributed)
    finish(results, out, distributed)


if __name__ == "__main__":
    main(sys.argv[1])
