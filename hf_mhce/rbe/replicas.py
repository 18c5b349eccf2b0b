"""A one-time check that data-parallel replicas stay identical after the first optimizer step.

Metrics gathered across processes assume every process holds the same model.  With transformers
5.23 / accelerate 1.15, ``trainer.evaluate()`` before ``trainer.train()`` in a multi-process run
marks the model as prepared and ``train()`` then skips the DDP wrapping: each process trains on its
own shard, silently.  A checksum of the parameters, compared across processes once, turns that (and
any other loss of gradient synchronisation) into an error.
"""

from __future__ import annotations

import torch
from torch import nn

from .placement import collective_device


_PIECE = 1 << 22  # elements per float64 piece: 32 MB


class ReplicasDivergedError(RuntimeError):
    """Data-parallel processes hold different parameters after an optimizer step."""


def parameter_checksum(model: nn.Module) -> torch.Tensor:
    """float64 sum of |p| + p over the trainable, unsharded parameters (a scalar on p's device)."""
    total = None
    for p in model.parameters():
        if not p.requires_grad or p.numel() == 0 or type(p).__name__ == "DTensor" or hasattr(p, "ds_id"):
            continue  # sharded parameters differ across processes by design
        for piece in p.detach().reshape(-1).split(_PIECE):  # float64 copies of bounded size, not of a whole head
            piece = piece.double()
            value = piece.abs().sum() + piece.sum()
            total = value if total is None else total + value.to(total.device)
    return total if total is not None else torch.zeros((), dtype=torch.float64)


def check_replicas_in_sync(model: nn.Module, rtol: float = 1e-9) -> None:
    """Raise ReplicasDivergedError if the processes' parameter checksums differ (collective call)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return  # FSDP1 keeps a different shard on every process
    local = parameter_checksum(model)
    device = collective_device()
    gathered = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local.to(device))
    values = torch.stack(gathered)
    spread = float((values.max() - values.min()) / values.abs().max().clamp_min(1e-300))
    if spread > rtol:
        raise ReplicasDivergedError(
            f"after the first optimizer step the {len(gathered)} processes hold different parameters "
            f"(checksums {[float(v) for v in values]}): gradients are not synchronised. With transformers' "
            "Trainer the usual cause is calling trainer.evaluate() before trainer.train() in a multi-process "
            "run (the model is then never wrapped in DDP); use TrainingArguments(eval_on_start=True) instead"
        )
