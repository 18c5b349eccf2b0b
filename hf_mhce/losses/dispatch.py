"""Choice between the Triton kernels and the chunked torch sweeps.

``backend`` argument, else environment variable ``HF_MHCE_BACKEND``; values:
- "auto" (default): Triton for CUDA tensors of dtype fp32/bf16/fp16 when triton imports, else torch;
- "triton": force the kernels (CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1`` set
  before the first kernel import -- how the CPU test-suite runs them);
- "torch": force the chunked torch path (any device, float64 included).
"""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import torch

from ..ops import torch_sweep
from ..ops.budget import SettingError, grad_in_forward, interpreting, workspace_bytes

BACKENDS = ("auto", "triton", "torch")
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_ops() -> SimpleNamespace:
    from ..ops import triton_backward, triton_forward, triton_forward_grad

    return SimpleNamespace(name="triton", forward_stats=triton_forward.forward_stats,
                           backward=triton_backward.backward,
                           forward_with_grads=triton_forward_grad.forward_with_grads)


_TORCH_OPS = SimpleNamespace(name="torch", forward_stats=torch_sweep.forward_stats, backward=torch_sweep.backward)


def _environment_backend() -> str:
    name = os.environ.get("HF_MHCE_BACKEND") or "auto"  # set empty: the default
    if name.lower() not in BACKENDS:
        raise SettingError(f"HF_MHCE_BACKEND must be one of {BACKENDS}, got {name!r}")
    return name


def check_environment() -> None:
    """Read every ``HF_MHCE_*`` setting now (backend, chunk and workspace budgets, gradient schedule): a
    SettingError names the first unusable one before a job starts, instead of at its first loss."""
    if _environment_backend().lower() == "triton":
        _check_triton_usable()
    torch_sweep.chunk_bytes()
    workspace_bytes()
    grad_in_forward()


def _check_triton_usable() -> None:
    """HF_MHCE_BACKEND=triton where no loss could run: without triton, or with neither a CUDA GPU nor
    Triton's interpreter (each loss would then raise in the middle of the job)."""
    if not triton_available():
        raise SettingError("HF_MHCE_BACKEND=triton but triton is not installed; use HF_MHCE_BACKEND=torch or auto")
    if not torch.cuda.is_available() and not interpreting():  # no kernel import here: it fixes interpretation
        raise SettingError("HF_MHCE_BACKEND=triton needs a CUDA GPU and none is available; for CPU tensors set "
                           "TRITON_INTERPRET=1 too (Triton's interpreter, slow), or use HF_MHCE_BACKEND=torch or auto")


def resolve(backend: str | None, device: torch.device, dtype: torch.dtype) -> SimpleNamespace:
    """The ops namespace (forward_stats, backward) to use for tensors on ``device`` of ``dtype``."""
    grad_in_forward()  # read on every call: a bad value is named whichever schedule this call takes
    name = backend if backend is not None else _environment_backend()
    if not isinstance(name, str) or name.lower() not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (argument or HF_MHCE_BACKEND), got {name!r}")
    name = name.lower()
    if name == "auto":
        use = device.type == "cuda" and dtype in _TRITON_DTYPES and triton_available() and _triton_capable(device)
        return _triton_ops() if use else _TORCH_OPS
    if name == "torch":
        return _TORCH_OPS
    if not triton_available():
        raise ValueError("backend='triton' was requested but triton is not installed")
    if dtype not in _TRITON_DTYPES:
        raise ValueError(f"the Triton kernels support float32, bfloat16 and float16, got {dtype}; use backend='torch'")
    if device.type == "cuda" and not _triton_capable(device):
        raise ValueError(f"backend='triton' needs a GPU of compute capability 7.0 (Volta) or newer, {device} has "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}; use backend='torch' or 'auto'")
    from ..ops import triton_tile

    now, then = triton_tile.interpreting(), triton_tile.KERNELS_INTERPRETED
    if device.type != "cuda" and not (now and then):
        why = {(True, False): " (it was set after hf_mhce.ops.triton_* were imported: they are compiled for a GPU)",
               (False, True): " (it was set when they were imported but is not set now)"}.get((now, then), "")
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got {device.type}); for CPU tensors set "
            f"TRITON_INTERPRET=1 before hf_mhce's kernels are first imported{why}"
        )
    return _triton_ops()


def _triton_capable(device: torch.device) -> bool:
    """Volta or newer, as Triton's and inductor's own support: the bias gradient's float32 atomics (since
    replaced by column sums) did not compile for a P100, and no older GPU has run the kernels since."""
    return torch.cuda.get_device_capability(device) >= (7, 0)
