"""Argument checks and normalisation for the public losses: every bad input gets an error that
names the problem before any kernel runs."""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

import torch

REDUCTIONS = ("mean", "sum", "none")


@dataclass
class LossInputs:
    """Inputs flattened to 2-D / 1-D, with ignored tokens encoded as label -1 for the ops."""

    hidden: torch.Tensor  # [N, D], contiguous
    weight: torch.Tensor  # [V, D], contiguous
    bias: torch.Tensor | None  # [V]
    labels: torch.Tensor  # [N] int64, -1 where ignored
    valid: torch.Tensor  # [N] bool
    label_shape: torch.Size


def as_count(value, name: str) -> int:
    """A positive integer given as any integer type (int, numpy or 0-d torch integers), never a bool."""
    # operator.index takes a bool (tensor) as 1 and a one-element tensor as its value
    refused = isinstance(value, bool) or (isinstance(value, torch.Tensor) and (value.dtype == torch.bool or value.dim()))
    try:
        count = None if refused else operator.index(value)
    except TypeError:
        count = None
    if count is None or count < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return count


def check_heads(num_heads, hidden_size: int) -> int:
    """``num_heads`` as an int, checked against the hidden size."""
    num_heads = as_count(num_heads, "num_heads")
    if hidden_size % num_heads:
        raise ValueError(
            f"num_heads={num_heads} does not divide the hidden size {hidden_size}: "
            f"MHCE splits the hidden state into num_heads equal contiguous slices"
        )
    return num_heads


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # float64: the torch backend


def check_dense_values(**tensors) -> None:
    """Before anything reads a device or reshapes: torch.autocast knows no meta device, the ops need values,
    and sparse layouts have no strides to read (their errors would come from deep inside torch)."""
    for name, t in tensors.items():
        for part in (t if isinstance(t, (tuple, list)) else (t,)):
            if not isinstance(part, torch.Tensor):
                continue
            if part.is_meta:
                raise ValueError(f"{name} is on the meta device (a shape without values): the loss needs "
                                 "materialised tensors (e.g. load the weights that init_empty_weights left empty)")
            if part.layout != torch.strided:
                raise ValueError(f"{name} has layout {part.layout}: the fused losses take dense tensors (.to_dense())")


def check_matrices(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be a float32, bfloat16, float16 or float64 tensor, got dtype {t.dtype}"
                            + (" (cast an 8-bit head to bfloat16 for the loss)" if t.is_floating_point() else ""))
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, D], got shape {tuple(weight.shape)}")
    if 0 in weight.shape:
        raise ValueError(f"weight [V, D] must have a vocabulary and a hidden size, got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden's last dimension must equal weight's second: hidden shape {tuple(hidden.shape)}, "
            f"weight shape {tuple(weight.shape)} (weight is [V, D])"
        )
    if hidden.dtype != weight.dtype:
        autocast = torch.is_autocast_enabled(hidden.device.type)
        hint = ("torch.autocast cast the other and leaves float64 alone: cast that one" if autocast
                else "cast one, or run under torch.autocast")
        raise TypeError(
            f"hidden and weight must have the same dtype, got hidden {hidden.dtype} and weight "
            f"{weight.dtype}{' under torch.autocast' if autocast else ''} ({hint})"
        )
    if hidden.device != weight.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise TypeError("bias must be a floating point tensor")
        if bias.dtype != weight.dtype:  # as F.linear
            raise TypeError(f"bias has dtype {bias.dtype} but weight has {weight.dtype}; they must match "
                            "(cast one, or run under torch.autocast)")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},) = [V], got {tuple(bias.shape)}")
        if bias.device != weight.device:
            raise ValueError(f"bias is on {bias.device} but weight is on {weight.device}")


def check_low_rank(low_rank, hidden: torch.Tensor, weight: torch.Tensor, num_heads: int) -> None:
    """``low_rank`` = (U [..., H, R], B [V, R]) with hidden's leading shape, dtype and device."""
    if low_rank is None:
        return
    if not isinstance(low_rank, (tuple, list)) or len(low_rank) != 2:
        raise TypeError(f"low_rank must be a pair (U, B) of tensors, got {type(low_rank).__name__}")
    u, b = low_rank
    for name, t in (("low_rank U", u), ("low_rank B", b)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating point torch.Tensor")
        if t.dtype != hidden.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but hidden has {hidden.dtype}; they must match")
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    if b.dim() != 2 or b.shape[0] != weight.shape[0] or b.shape[1] < 1:
        raise ValueError(f"low_rank B must be [V, R] = [{weight.shape[0]}, R >= 1], got shape {tuple(b.shape)}")
    want = tuple(hidden.shape[:-1]) + (num_heads, b.shape[1])
    if tuple(u.shape) != want:
        raise ValueError(
            f"low_rank U must be [..., num_heads, R] = {want} (hidden's leading shape, then one R-vector "
            f"per head), got {tuple(u.shape)}"
        )


def as_number(value, name: str) -> float:
    """A real number of any type (int, float, numpy), never a bool, as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return float(value)


def as_index(value, name: str) -> int:
    """An integer of any type (int, numpy), never a bool, as an int (label values: ignore_index)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not _fits_int64(value):
        raise ValueError(f"{name} must fit in int64, as labels do, got {value}")
    return int(value)


def _fits_int64(value: numbers.Integral) -> bool:
    return -2**63 <= int(value) < 2**63


def check_options(reduction: str, label_smoothing: float, z_loss: float, softcap, num_items_in_batch,
                  ignore_index: int = -100) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= as_number(label_smoothing, "label_smoothing") <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    z = as_number(z_loss, "z_loss")
    if not (z >= 0.0 and math.isfinite(z)):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss}")
    if softcap is not None:
        c = as_number(softcap, "softcap")
        if not (c > 0.0 and math.isfinite(c)):
            raise ValueError(f"softcap must be a finite positive number (or None), got {softcap}")
    as_index(ignore_index, "ignore_index")
    if num_items_in_batch is not None:
        check_item_count(num_items_in_batch)
        if reduction == "none":
            raise ValueError("num_items_in_batch divides a summed loss; it cannot be combined with reduction='none'")


def check_item_count(count) -> None:
    """The type of ``num_items_in_batch``: a number, or a one-element tensor (what the Trainer passes).
    Its sign is checked where it is used (one device sync with its zero test)."""
    if isinstance(count, torch.Tensor):
        if count.numel() != 1 or count.dtype == torch.bool or count.is_complex():
            raise TypeError(f"num_items_in_batch must be a number or a one-element real tensor, got a {count.dtype} "
                            f"tensor of shape {tuple(count.shape)}")
    elif isinstance(count, bool) or not isinstance(count, numbers.Real):
        raise TypeError(f"num_items_in_batch must be a number or a one-element tensor, got {count!r}")
    elif isinstance(count, numbers.Integral) and not _fits_int64(count):
        raise ValueError(f"num_items_in_batch must be a finite count >= 0 that fits in int64, got {count}")


def int64_labels(labels: torch.Tensor) -> torch.Tensor:
    """Integer ``labels`` of any dtype as int64 (others as given, for the checks to name).  A uint64 label
    >= 2**63 is refused: the cast wraps it (2**64 - 100 would become -100, an ignored token)."""
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        return labels
    flat = labels.to(torch.int64)
    if labels.dtype == torch.uint64 and bool((flat < 0).any()):
        value = int(flat[flat < 0][0]) + 2**64
        raise ValueError(f"label {value} is outside the vocabulary (a uint64 label >= 2**63)")
    return flat


def prepare(hidden, weight, bias, labels, ignore_index: int) -> LossInputs:
    """Validate labels against hidden and the vocabulary; flatten everything for the ops."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor (class indices), got dtype {labels.dtype}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal hidden's leading shape {tuple(hidden.shape[:-1])} "
            f"(hidden shape {tuple(hidden.shape)}); labels are aligned with hidden, not shifted"
        )
    vocab = weight.shape[0]
    flat = int64_labels(labels.reshape(-1).to(device=hidden.device))
    valid = flat != ignore_index
    bad = valid & ((flat < 0) | (flat >= vocab))
    if bool(bad.any()):
        value = int(flat[bad.nonzero()[0, 0]])
        raise ValueError(
            f"label {value} is outside the vocabulary [0, {vocab}) and is not ignore_index ({ignore_index})"
        )
    return LossInputs(
        hidden=hidden.reshape(-1, hidden.shape[-1]).contiguous(),
        weight=weight.contiguous(),
        bias=bias.contiguous() if bias is not None else None,
        labels=torch.where(valid, flat, -1),
        valid=valid,
        label_shape=labels.shape,
    )
