"""One process of the sharded mixed-adapter batch test (torch.distributed.run, 2 CPU processes, gloo),
or the single-process reference when started without a WORLD_SIZE.

PEFT's mixed-adapter inference, ``model(..., adapter_names=[...])``, with LoRA on lm_head, on a fixed
global batch whose halves hold different sets of adapters: rank 0's rows are all "default", rank 1's
"default" and "__base__".  The head is sharded, so each call of it gathers its weight (a collective):
ZeRO-3 (base layer and LoRA matrices partitioned), or FSDP2 with the LoRA head its own unit.  Rank 0
writes the loss (averaged over processes) and the logits of the whole batch (the mixture's log-probs
for MHCE), gathered from the processes; the reference is the same patched model in one process (and
for CE the unpatched one: case "unpatched_lora").  Each process's collectives time out after
``TIMEOUT`` seconds, so a rank that calls the head more often than its peer fails instead of hanging.

Usage: mixed_batch_worker.py OUT_JSON [SINGLE_JSON]
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch

torch.set_num_threads(1)

from launch_helpers import finish, single_reference  # noqa: E402
from sharding_worker import ROWS, build, global_batch, loss_options, shard  # noqa: E402
from zero3_worker import DS_CONFIG  # noqa: E402

NAMES = ["default", "default", "default", "__base__"]  # rank 0: one adapter; rank 1: it and the base model
CASES = ["zero3_lora_mixed_ce", "zero3_lora_mixed_mhce", "fsdp_head_lora_mixed_ce", "fsdp_head_lora_mixed_mhce"]
TIMEOUT = 30


def evaluate(case: str, distributed: bool) -> dict:
    import hf_mhce

    ids, labels = global_batch()
    names = NAMES
    model = build(case)
    if not case.startswith("unpatched"):
        model = hf_mhce.apply_patch(model, **loss_options(case))
    if distributed:
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        if case.startswith("zero3"):
            import deepspeed

            config = dict(DS_CONFIG, train_micro_batch_size_per_gpu=ROWS // world)
            engine, *_ = deepspeed.initialize(model=model, config=config,
                                              model_parameters=[p for p in model.parameters() if p.requires_grad])
            model = engine.module
        else:
            from torch.distributed.device_mesh import init_device_mesh

            model = shard(model, case, init_device_mesh("cpu", (world,)))
        rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
        ids, labels, names = ids[rows], labels[rows], names[rows]
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=ids, labels=labels, adapter_names=names).loss
        logits = model(input_ids=ids, adapter_names=names).logits
    if distributed:
        dist.all_reduce(loss)
        loss /= world
        parts = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(parts, logits)
        logits = torch.cat(parts)
    return {"loss": loss.item(), "logits": logits.flatten().tolist()}


def main(out: str) -> None:
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        single_reference(lambda: {case: evaluate(case, False) for case in ["unpatched_lora", *CASES]}, sys.argv[1:])
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=TIMEOUT))
    finish({case: evaluate(case, distributed) for case in CASES}, out, distributed)


if __name__ == "__main__":
    main(sys.argv[1])
