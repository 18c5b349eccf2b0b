"""Reading the LM head's parameters under sharding wrappers (FSDP2, DeepSpeed ZeRO-3) and
accelerate's offloading (a ``device_map`` that puts the head on "cpu" or "disk").

The fused loss reads ``lm_head.weight`` as a tensor instead of calling ``lm_head``.  Wrappers that
shard parameters gather them in hooks around a module's *call*, so a head module that owns its own
sharded parameters would be read in its sharded state: a DTensor slice (FSDP2 unit), an empty
placeholder (ZeRO-3) or a meta tensor (accelerate offload).  Peers crash there, or worse, train on garbage.

``call_through`` runs the loss inside the ``__call__`` of every such module of the head (the head
itself, and under PEFT its base layer and LoRA matrices), innermost call doing the work.  Each
wrapper then does exactly what it does for a normal forward: gathers the parameters before, registers
its backward hooks on the output (our loss), gathers again for the backward, and reduces the
gradients.  Under FSDP2's default wrapping the head belongs to the root unit, whose parameters are
already gathered for the whole model forward; nothing is redirected then.

``check_gathered`` is the last line of defence: a DTensor or an empty weight that reaches the fused
op is an error that says why, never a silent wrong number.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch without FSDP2
    FSDPModule = ()
try:
    from torch.distributed.fsdp import FullyShardedDataParallel
except ImportError:  # pragma: no cover
    FullyShardedDataParallel = ()
try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()


def full_shape(weight) -> tuple[int, ...]:
    """The shape of ``weight`` with its data: ZeRO-3's empty placeholder keeps it in ``ds_shape`` (a DTensor
    shard or a meta tensor keep it in ``shape``)."""
    full = getattr(weight, "ds_shape", None)
    return tuple(int(n) for n in full) if full is not None else tuple(weight.shape)


class ShardedHeadError(RuntimeError):
    """An LM-head parameter reached the fused loss sharded or empty."""


def owns_sharded_params(module: nn.Module) -> bool:
    """True for a module whose own parameters a wrapper gathers only around its call."""
    if (FSDPModule and isinstance(module, FSDPModule)) or isinstance(module, FullyShardedDataParallel):
        return True  # FSDP2 unit, or FSDP1's wrapper (its flat parameter)
    own = list(module.parameters(recurse=False))
    if hasattr(module, "_hf_hook") and any(p.is_meta for p in own):
        return True  # offloaded by accelerate (device_map "cpu"/"disk"): its hook loads them around the call
    return any(hasattr(p, "ds_id") for p in own)  # ZeRO-3 partitioned


def call_through(head: nn.Module, fn: Callable, *tensors: torch.Tensor):
    """``fn(*tensors)``, run inside the call of every module of ``head`` that owns sharded parameters.

    ``fn`` must read the parameters itself (they are gathered only inside) and use the tensors it is
    given (wrappers may replace them, e.g. to hook their backward or cast them).
    """
    for module in head.modules():
        # a ParameterDict / ParameterList (PEFT's trainable-token deltas) cannot be called: ZeRO-3 gathers
        # a container's parameters as they are read, and so does the fused loss reading them
        if owns_sharded_params(module) and not isinstance(module, (nn.ParameterDict, nn.ParameterList)):
            fn = _inside(module, fn)
    return fn(*tensors)


def unwrapped(module: nn.Module) -> nn.Module:
    """The module an FSDP1 wrapper (``FullyShardedDataParallel``: lm_head in its own unit) holds, else ``module``."""
    return module._fsdp_wrapped_module if isinstance(module, FullyShardedDataParallel) else module


def _inside(module: nn.Module, inner: Callable) -> Callable:
    # accelerate's hooks call module._old_forward from their own forward: replace that one then;
    # FSDP1's wrapper gathers in its own forward, then calls the module it wraps: replace that one's.
    target = unwrapped(module)
    attr = "_old_forward" if hasattr(target, "_hf_hook") else "forward"

    def run(*tensors):
        missing = object()
        saved = target.__dict__.get(attr, missing)

        def through(*args, adapter_names=None):  # PEFT's mixed-batch pre-hook adds it: forward.py routes the rows
            return inner(*args)

        through.hf_mhce_replaced = None if saved is missing else saved  # what head.py's check must see
        target.__dict__[attr] = through
        try:
            return module(*tensors)
        finally:
            if saved is missing:
                del target.__dict__[attr]
            else:
                target.__dict__[attr] = saved

    return run


def check_gathered(name: str, tensor: torch.Tensor | None, shape: tuple[int, ...] | None = None) -> None:
    """Raise ShardedHeadError if ``tensor`` is a DTensor or empty (or, given ``shape``, of another shape)."""
    if tensor is None:
        return
    if DTensor and isinstance(tensor, DTensor):
        raise ShardedHeadError(
            f"the LM head's {name} is a sharded DTensor {tuple(tensor.shape)} with placements {tensor.placements} "
            "outside the module that owns it; hf_mhce gathers FSDP2 units itself, so this is another kind of "
            "sharding (e.g. tensor parallelism), which the fused loss does not support on the head"
        )
    if tensor.is_meta:
        raise ShardedHeadError(
            f"the LM head's {name} is on the meta device outside the module's call (offloaded, or not loaded): "
            "hf_mhce loads heads offloaded by accelerate's hooks itself, so this is another kind of offloading, "
            "which the fused loss does not support on the head"
        )
    if tensor.numel() == 0 or (shape is not None and tuple(tensor.shape) != tuple(shape)):
        raise ShardedHeadError(
            f"the LM head's {name} has shape {tuple(tensor.shape)}"
            + (f", expected {tuple(shape)}" if shape is not None else "")
            + ": it looks partitioned (DeepSpeed ZeRO-3 keeps an empty placeholder outside the module's "
            "forward) and was not gathered; this is a bug in hf_mhce's handling of your wrapper, please report it"
        )
