"""One process of the DeepSpeed ZeRO-3 test (torch.distributed.run, 2 CPU processes, gloo through
DeepSpeed's CPU accelerator), or the single-process reference without a WORLD_SIZE.

For every case one step of a tiny Llama on a fixed global batch, each process taking its half of the
rows: the loss (averaged over processes) and every parameter's full gradient (gathered by
``deepspeed.utils.safe_get_full_grad``, already averaged over processes) are written by rank 0.
ZeRO-3 partitions every parameter: outside its module's call lm_head.weight is an empty
placeholder, which is what the fused loss must never compute on.

Cases: zero3_ce, zero3_mhce (H=2), zero3_lora_mhce (PEFT LoRA on q_proj, v_proj, lm_head), zero3_tokens_mhce
(PEFT trainable_token_indices on a tied embedding: its deltas sit in a ParameterDict inside the head).

Usage: zero3_worker.py OUT_JSON [SINGLE_JSON]  (launched with SINGLE_JSON: rank 0 first writes the
single-process reference there, see launch_helpers.single_reference)
"""

from __future__ import annotations

import os
import sys

import torch

torch.set_num_threads(1)

from launch_helpers import finish, single_reference  # noqa: E402
from sharding_worker import ROWS, build, global_batch, loss_options, single_step  # noqa: E402

CASES = ["zero3_ce", "zero3_mhce", "zero3_lora_mhce", "zero3_tokens_mhce"]
DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
             "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "zero_allow_untested_optimizer": True}


def step(case: str, distributed: bool) -> dict:
    import hf_mhce

    ids, labels = global_batch()
    model = hf_mhce.apply_patch(build(case), **loss_options(case))
    if not distributed:
        return single_step(model, ids, labels)
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    rank, world = dist.get_rank(), dist.get_world_size()
    config = dict(DS_CONFIG, train_micro_batch_size_per_gpu=ROWS // world)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config)
    # the head's own weight (LoRA's base_layer, trainable tokens' token_adapter.base_layer): outside its call, partitioned
    placeholder = next(tuple(p.shape) for n, p in engine.module.get_output_embeddings().named_parameters()
                       if n in ("weight", "base_layer.weight", "token_adapter.base_layer.weight"))
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    loss = engine(input_ids=ids[rows], labels=labels[rows]).loss
    engine.backward(loss)
    grads = {}
    for name, p in engine.module.named_parameters():
        g = safe_get_full_grad(p)  # collective: every rank calls it
        if g is not None:
            grads[name] = g.flatten().tolist()
    value = loss.detach().clone()
    dist.all_reduce(value)
    return {"loss": value.item() / world, "grads": grads, "placeholder_shape": placeholder}


def main(out: str) -> None:
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        single_reference(lambda: {case: step(case, False) for case in CASES}, sys.argv[1:])
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    finish({case: step(case, distributed) for case in CASES}, out, distributed)


if __name__ == "__main__":
    main(sys.argv[1])
