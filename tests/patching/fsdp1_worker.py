"""One process of the FSDP1 test (torch.distributed.run, 2 CPU processes, gloo), or the single-process
reference when started without a WORLD_SIZE.

``FullyShardedDataParallel`` (FSDP1, accelerate's fsdp_version 1) wrapping every decoder layer and
every nn.Linear, lm_head included (as a size-based policy does with a large head): outside its
wrapper's forward the head's weight is a shard of a flat parameter.  One training step of a tiny
Llama on a fixed global batch as in sharding_worker.py: the loss (averaged over processes) and every
parameter's full gradient (``summon_full_params(with_grads=True)``) are written by rank 0.

Usage: fsdp1_worker.py OUT_JSON [SINGLE_JSON]
"""

from __future__ import annotations

import os
import sys

import torch

torch.set_num_threads(1)

from launch_helpers import finish, single_reference  # noqa: E402
from sharding_worker import ROWS, build, global_batch, loss_options, single_step  # noqa: E402

CASES = ["fsdp1_head_ce", "fsdp1_head_mhce", "fsdp1_head_lora_mhce"]


def step(case: str, distributed: bool) -> dict:
    import hf_mhce

    ids, labels = global_batch()
    model = build(case)
    if case != "unpatched":
        model = hf_mhce.apply_patch(model, **loss_options(case))
    if not distributed:
        return single_step(model, ids, labels)
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    rank, world = dist.get_rank(), dist.get_world_size()
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer, torch.nn.Linear}),
                                       use_orig_params=True, device_id=torch.device("cpu"))
    head = wrapped.module.get_output_embeddings() if hasattr(wrapped.module, "get_output_embeddings") else None
    assert head is None or isinstance(head, FullyShardedDataParallel) or "lora" in case, type(head)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    loss = wrapped(input_ids=ids[rows], labels=labels[rows]).loss
    loss.backward()
    with FullyShardedDataParallel.summon_full_params(wrapped, with_grads=True):
        grads = {n.replace("_fsdp_wrapped_module.", ""): p.grad.flatten().tolist()
                 for n, p in wrapped.named_parameters() if p.grad is not None}
    value = loss.detach().clone()
    dist.all_reduce(value)
    return {"loss": value.item() / world, "grads": grads}


def main(out: str) -> None:
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        import torch.distributed as dist

        single_reference(lambda: {case: step(case, False) for case in CASES}, sys.argv[1:])
        dist.init_process_group("gloo")
    finish({case: step(case, distributed) for case in CASES}, out, distributed)


if __name__ == "__main__":
    main(sys.argv[1])
