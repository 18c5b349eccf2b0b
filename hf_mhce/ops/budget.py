"""Memory budgets, the gradient schedule and Triton's interpreter switch from the environment, read on
every call (a test or a job may change them); no triton import."""

from __future__ import annotations

import math
import os


class SettingError(ValueError):
    """An ``HF_MHCE_*`` environment variable holds a value the ops cannot use (the message names it)."""


def megabytes_env(name: str, default_mb: float) -> int:
    """The budget in environment variable ``name`` (megabytes, default ``default_mb``) as bytes.

    A SettingError (a ValueError) names the variable unless the value is a positive, finite number: ``inf`` would
    pass a bare ``> 0`` check and fail later in ``int()`` with an OverflowError naming nothing.
    """
    raw = os.environ.get(name, "")
    try:
        mb = float(raw) if raw else float(default_mb)
    except ValueError:
        raise SettingError(f"{name} must be a number of megabytes, got {raw!r}") from None
    if not (mb > 0 and math.isfinite(mb * 2**20)):  # also rejects nan, and 1e308 (inf once in bytes)
        raise SettingError(f"{name} must be a positive, finite number of megabytes, got {raw!r}")
    return int(mb * 2**20)


DEFAULT_WORKSPACE_MB = 512.0


def workspace_bytes() -> int:
    """Bound of the Triton slabs, float32 accumulators and temporaries (the backward's, and the forward's
    when it computes the gradients or the candidate slab statistics), from ``HF_MHCE_WORKSPACE_MB``."""
    return megabytes_env("HF_MHCE_WORKSPACE_MB", DEFAULT_WORKSPACE_MB)


def grad_in_forward() -> bool:
    """``HF_MHCE_GRAD_IN_FORWARD``: "1" (default) lets the Triton backend compute the gradients of a mean
    or summed loss in the forward when they fit the workspace (6NDV instead of 8NDV); "0" keeps the
    forward to statistics and recomputes the logits in the backward."""
    raw = os.environ.get("HF_MHCE_GRAD_IN_FORWARD", "") or "1"
    if raw not in ("0", "1"):
        raise SettingError(f"HF_MHCE_GRAD_IN_FORWARD must be 0 or 1, got {raw!r}")
    return raw == "1"


def interpreting() -> bool:
    """True when TRITON_INTERPRET=1 is set now (read on every call: tile sizes, dot order)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
