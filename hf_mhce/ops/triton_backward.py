"""Triton backward sweep: recompute each logits tile, form the gradient of the mixture loss and
accumulate dX = dY W and dW = dY^T X with float32 atomics.

Grid: (token blocks, vocabulary blocks, heads).  dY for a tile is
alpha * softmax - beta * onehot(target) - gamma (see ``mixture.grad_coefficients``), times the
softcap derivative.  dX accumulates in a float32 [N, D] buffer.  dW accumulates in float32 too:
directly in dW for float32 weights; for 16-bit weights in a float32 workspace of at most
``HF_MHCE_WORKSPACE_MB`` (default 512 MB) that covers a range of vocabulary rows per launch and is
then rounded once into dW -- never a 16-bit accumulation across tiles.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_tile import block_sizes, dot, dot_settings, logits_tile

DEFAULT_WORKSPACE_MB = 512.0


def workspace_bytes() -> int:
    raw = os.environ.get("HF_MHCE_WORKSPACE_MB", "")
    try:
        mb = float(raw) if raw else DEFAULT_WORKSPACE_MB
    except ValueError:
        raise ValueError(f"HF_MHCE_WORKSPACE_MB must be a number of megabytes, got {raw!r}") from None
    if not mb > 0:
        raise ValueError(f"HF_MHCE_WORKSPACE_MB must be positive, got {raw!r}")
    return int(mb * 2**20)


@triton.jit
def _backward_kernel(
    X, W, B, Labels, Lse, Alpha, Beta, Gamma, DX, DW, DB,
    N, v_start, v_end, Dh, stride_x, stride_w, stride_dx, stride_dw, softcap,
    NUM_HEADS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    head = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = v_start + tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = rows < N
    col_mask = cols < v_end
    labels = tl.load(Labels + rows, mask=row_mask, other=-1)
    row_valid = labels >= 0  # the caller encodes ignored tokens as -1
    # Tiles of ignored tokens only (padding) contribute nothing: skip their matmuls.
    if tl.sum(row_valid.to(tl.int32), axis=0) > 0:
        col0 = head * Dh
        y = logits_tile(X, W, B, rows, cols, row_mask, col_mask, col0, Dh, stride_x, stride_w, softcap,
                        HAS_BIAS, HAS_SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_K, DOT_UPCAST, PRECISION)
        stat = rows * NUM_HEADS + head
        lse = tl.load(Lse + stat, mask=row_valid, other=0.0)
        alpha = tl.load(Alpha + stat, mask=row_valid, other=0.0)
        beta = tl.load(Beta + stat, mask=row_valid, other=0.0)
        gamma = tl.load(Gamma + rows, mask=row_valid, other=0.0)
        dy = alpha[:, None] * tl.exp(y - lse[:, None]) - gamma[:, None]
        dy -= tl.where(cols[None, :] == labels[:, None], beta[:, None], 0.0)
        if HAS_SOFTCAP:
            dy *= 1.0 - (y / softcap) * (y / softcap)
        # Ignored rows may hold NaN logits (0 * NaN); their gradient is exactly zero.
        dy = tl.where(row_valid[:, None] & col_mask[None, :], dy, 0.0)
        if NEED_DB:
            tl.atomic_add(DB + cols, tl.sum(dy, axis=0), mask=col_mask)
        dy_in = dy.to(X.dtype.element_ty)  # same rounding as autograd's dlogits in 16-bit models
        for k0 in range(0, Dh, BLOCK_K):
            ks = col0 + k0 + tl.arange(0, BLOCK_K)
            k_mask = (k0 + tl.arange(0, BLOCK_K)) < Dh
            if NEED_DX:
                w = tl.load(W + cols[:, None] * stride_w + ks[None, :],
                            mask=col_mask[:, None] & k_mask[None, :], other=0.0)
                dx = dot(dy_in, w, tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32), DOT_UPCAST, PRECISION)
                tl.atomic_add(DX + rows[:, None] * stride_dx + ks[None, :], dx,
                              mask=row_mask[:, None] & k_mask[None, :])
            if NEED_DW:
                x = tl.load(X + rows[:, None] * stride_x + ks[None, :],
                            mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                dw = dot(tl.trans(dy_in), x, tl.zeros([BLOCK_V, BLOCK_K], dtype=tl.float32),
                         DOT_UPCAST, PRECISION)
                tl.atomic_add(DW + (cols - v_start)[:, None] * stride_dw + ks[None, :], dw,
                              mask=col_mask[:, None] & k_mask[None, :])


def backward(x, w, bias, labels, lse, alpha, beta, gamma, num_heads, softcap, needs):
    """Triton counterpart of ``torch_sweep.backward`` (labels: -1 marks ignored tokens)."""
    n, d = x.shape
    v = w.shape[0]
    dh = d // num_heads
    need_dx, need_dw, need_db = needs
    dev = x.device
    dx = torch.zeros(n, d, dtype=torch.float32, device=dev) if need_dx else None
    db = torch.zeros(v, dtype=torch.float32, device=dev) if need_db else None
    cfg = block_sizes(x.dtype, dh)
    if need_dw and w.dtype != torch.float32:
        dw = torch.empty_like(w)
        rows_per_launch = max(cfg["BLOCK_V"], workspace_bytes() // (d * 4) // cfg["BLOCK_V"] * cfg["BLOCK_V"])
        workspace = torch.empty(min(v, rows_per_launch), d, dtype=torch.float32, device=dev)
    else:
        dw = torch.zeros_like(w) if need_dw else None
        rows_per_launch, workspace = v, dw
    dummy = lse
    for v0 in range(0, v, rows_per_launch):
        v1 = min(v, v0 + rows_per_launch)
        if need_dw and workspace is not dw:
            workspace.zero_()
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(v1 - v0, cfg["BLOCK_V"]), num_heads)
        _backward_kernel[grid](
            x, w, bias if bias is not None else dummy, labels, lse, alpha, beta, gamma,
            dx if need_dx else dummy, workspace if need_dw else dummy, db if need_db else dummy,
            n, v0, v1, dh, x.stride(0), w.stride(0), d, d,
            float(softcap) if softcap is not None else 1.0,
            NUM_HEADS=num_heads, HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
            NEED_DX=need_dx, NEED_DW=need_dw, NEED_DB=need_db, **cfg, **dot_settings(x.dtype),
        )
        if need_dw and workspace is not dw:
            dw[v0:v1] = workspace[: v1 - v0]
    dx = dx.to(x.dtype) if need_dx else None
    db = db.to(bias.dtype) if need_db else None
    return dx, dw, db
