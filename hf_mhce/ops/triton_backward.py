"""Triton backward sweep: recompute each logits tile, form the gradient of the mixture loss and
accumulate dX = dY W and dW = dY^T X with float32 atomics.

Grid: (token blocks x vocabulary blocks, heads) over a range of tokens and a range of vocabulary
rows, in grouped order: GROUP_N token blocks sweep the vocabulary blocks together, so that the
programs running at once add into a few dX and dW rows (L2) rather than into all of dX.  dY for a
tile is alpha * softmax - beta * onehot(target) - gamma (see ``mixture.grad_coefficients``), times
the softcap derivative.  With a low-rank term (LoRA on the head) dU = dY B and dB = dY^T U are
accumulated the same way, each only where needed.

Both gradients accumulate in float32, never in 16-bit across tiles.  For float32 inputs dX and dW
are themselves the accumulators (one launch).  For 16-bit inputs the float32 scratch is bounded by
``HF_MHCE_WORKSPACE_MB`` (default 512): if a float32 dX fits beside a slice of dW rows, one fused
pass runs over vocabulary ranges, each range's dW rounded once; otherwise the backward splits
into a dW pass over vocabulary ranges and a dX pass over token ranges (one extra recompute of the
logits, in exchange for bounded memory), either pass skipped when its gradient is not needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .budget import megabytes_env
from .triton_tile import dot, dot_settings, launch_config, logits_tile, low_rank_args

DEFAULT_WORKSPACE_MB = 512.0


def workspace_bytes() -> int:
    """Bound of the float32 scratch of 16-bit backward passes, from ``HF_MHCE_WORKSPACE_MB``."""
    return megabytes_env("HF_MHCE_WORKSPACE_MB", DEFAULT_WORKSPACE_MB)


@triton.jit
def _backward_kernel(
    X, W, B, U, LB, Labels, Lse, Alpha, Beta, Gamma, DX, DW, DB, DU, DLB,
    n_start, n_end, v_start, v_end, Dh, R, stride_x, stride_w, stride_u, stride_lb, stride_dx, stride_dw,
    softcap,
    NUM_HEADS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_LOW_RANK: tl.constexpr,
    NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
    NEED_DU: tl.constexpr, NEED_DLB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    DOT_IN_ORDER: tl.constexpr, PRECISION: tl.constexpr,
):
    head = tl.program_id(1).to(tl.int64)
    # int64 throughout: a wide GROUP_N times many vocabulary blocks passes 2^31
    n_blocks = tl.cdiv(n_end - n_start, BLOCK_N).to(tl.int64)
    v_blocks = tl.cdiv(v_end - v_start, BLOCK_V).to(tl.int64)
    pid = tl.program_id(0).to(tl.int64)
    per_group = GROUP_N * v_blocks
    first_n = (pid // per_group) * GROUP_N
    group_n = tl.minimum(n_blocks - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_n
    pid_v = (pid % per_group) // group_n
    rows = n_start + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = v_start + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = rows < n_end
    col_mask = cols < v_end
    labels = tl.load(Labels + rows, mask=row_mask, other=-1)
    row_valid = labels >= 0  # the caller encodes ignored tokens as -1
    # Tiles of ignored tokens only (padding) contribute nothing: skip their matmuls.
    if tl.sum(row_valid.to(tl.int32), axis=0) > 0:
        col0 = head * Dh
        y = logits_tile(X, W, B, U, LB, rows, cols, row_mask, col_mask, col0, Dh, head * R, R,
                        stride_x, stride_w, stride_u, stride_lb, softcap,
                        HAS_BIAS, HAS_SOFTCAP, HAS_LOW_RANK, BLOCK_N, BLOCK_V, BLOCK_K, DOT_IN_ORDER, PRECISION)
        stat = rows * NUM_HEADS + head
        lse = tl.load(Lse + stat, mask=row_valid, other=0.0)
        alpha = tl.load(Alpha + stat, mask=row_valid, other=0.0)
        beta = tl.load(Beta + stat, mask=row_valid, other=0.0)
        gamma = tl.load(Gamma + rows, mask=row_valid, other=0.0)
        dy = alpha[:, None] * tl.exp(y - lse[:, None]) - gamma[:, None]
        dy -= tl.where(cols[None, :] == labels[:, None], beta[:, None], 0.0)
        if HAS_SOFTCAP:
            dy *= 1.0 - (y / softcap) * (y / softcap)
        # Ignored rows (padding) contribute nothing, even with NaN logits or a NaN/inf hidden row: dy is
        # zeroed here and their x / U rows in the dW / dLB dots (0 * NaN would be NaN).
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
                dx = dot(dy_in, w, tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32), DOT_IN_ORDER, PRECISION)
                tl.atomic_add(DX + (rows - n_start)[:, None] * stride_dx + ks[None, :], dx,
                              mask=row_mask[:, None] & k_mask[None, :])
            if NEED_DW:
                x = tl.load(X + rows[:, None] * stride_x + ks[None, :],
                            mask=row_valid[:, None] & k_mask[None, :], other=0.0)
                dw = dot(tl.trans(dy_in), x, tl.zeros([BLOCK_V, BLOCK_K], dtype=tl.float32),
                         DOT_IN_ORDER, PRECISION)
                tl.atomic_add(DW + (cols - v_start)[:, None] * stride_dw + ks[None, :], dw,
                              mask=col_mask[:, None] & k_mask[None, :])
        # Low-rank term: dU = dY LB into U's layout, dLB = dY^T U summed over heads (shared LB);
        # both accumulators cover all tokens / all of V (they are small: R columns).
        for r0 in range(0, R, BLOCK_K):
            rs = r0 + tl.arange(0, BLOCK_K)
            r_mask = rs < R
            if NEED_DU:
                b = tl.load(LB + cols[:, None] * stride_lb + rs[None, :],
                            mask=col_mask[:, None] & r_mask[None, :], other=0.0)
                du = dot(dy_in, b, tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32), DOT_IN_ORDER, PRECISION)
                tl.atomic_add(DU + rows[:, None] * stride_u + (head * R + rs)[None, :], du,
                              mask=row_mask[:, None] & r_mask[None, :])
            if NEED_DLB:
                u = tl.load(U + rows[:, None] * stride_u + (head * R + rs)[None, :],
                            mask=row_valid[:, None] & r_mask[None, :], other=0.0)
                dlb = dot(tl.trans(dy_in), u, tl.zeros([BLOCK_V, BLOCK_K], dtype=tl.float32), DOT_IN_ORDER, PRECISION)
                tl.atomic_add(DLB + cols[:, None] * stride_lb + rs[None, :], dlb,
                              mask=col_mask[:, None] & r_mask[None, :])


def backward(x, w, bias, labels, lse, alpha, beta, gamma, num_heads, softcap, needs, low_rank=None):
    """Triton counterpart of ``torch_sweep.backward`` (labels: -1 marks ignored tokens).

    The low-rank gradients (needs[3:], U and B of ``low_rank``) accumulate in float32 buffers over
    all tokens / all of V, outside the workspace bound: they have R columns, not D.
    """
    n, d = x.shape
    v = w.shape[0]
    need_dx, need_dw, need_db = needs[:3]
    need_du, need_dlb = needs[3:] if low_rank is not None else (False, False)
    dev = x.device
    cfg = launch_config("backward", x.dtype, d // num_heads)
    f32 = {"dtype": torch.float32, "device": dev}
    db = torch.zeros(v, **f32) if need_db else None
    du = torch.zeros(low_rank[0].shape, **f32) if need_du else None
    dlb = torch.zeros(low_rank[1].shape, **f32) if need_dlb else None
    launch = _Launcher(x, w, bias, labels, lse, alpha, beta, gamma, num_heads, softcap, cfg, low_rank, db, du, dlb)
    side = (need_db, need_du, need_dlb)

    if x.dtype == torch.float32:  # outputs are float32 already: they are the accumulators
        dx = torch.zeros_like(x) if need_dx else None
        dw = torch.zeros_like(w) if need_dw else None
        launch((0, n), (0, v), dx, dw, *side)
        return _outputs(dx, dw, db, du, dlb, bias, low_rank)

    budget = workspace_bytes()
    row_bytes = d * 4
    dx = torch.empty_like(x) if need_dx else None
    dw = torch.empty_like(w) if need_dw else None
    if need_dx and need_dw and n * row_bytes + cfg["BLOCK_V"] * row_bytes <= budget:
        # fused: float32 dX for all tokens beside dW by vocabulary range, one pass
        dx32 = torch.zeros(n, d, **f32)
        for v0, v1, ws in _ranges(v, (budget - n * row_bytes) // row_bytes, cfg["BLOCK_V"], d, dev, True):
            launch((0, n), (v0, v1), dx32, ws, *side)
            dw[v0:v1] = ws[: v1 - v0]
        dx.copy_(dx32)
        return _outputs(dx, dw, db, du, dlb, bias, low_rank)
    # Bounded memory: a dW pass over vocabulary ranges and/or a dX pass over token ranges (one range when
    # dX fits), each scratch within the budget.  dB, dU, dLB cover all tokens and all of V, so they go
    # with whichever pass runs first, whatever else is needed (a dU left to a skipped pass would be 0).
    if need_dw:
        for v0, v1, ws in _ranges(v, budget // row_bytes, cfg["BLOCK_V"], d, dev, True):
            launch((0, n), (v0, v1), None, ws, *side)
            dw[v0:v1] = ws[: v1 - v0]
        ws = None  # freed before the dX pass allocates its own: one scratch within the budget at a time
        side = (False, False, False)
    if need_dx:
        for n0, n1, ws in _ranges(n, budget // row_bytes, cfg["BLOCK_N"], d, dev, True):
            launch((n0, n1), (0, v), ws, None, *side)
            dx[n0:n1] = ws[: n1 - n0]
    elif any(side):  # only dB / dU / dLB: no scratch at all
        launch((0, n), (0, v), None, None, *side)
    return _outputs(dx, dw, db, du, dlb, bias, low_rank)


def _outputs(dx, dw, db, du, dlb, bias, low_rank):
    db = db.to(bias.dtype) if db is not None else None
    if low_rank is None:
        return dx, dw, db
    return (dx, dw, db, du.to(low_rank[0].dtype) if du is not None else None,
            dlb.to(low_rank[1].dtype) if dlb is not None else None)


def _ranges(total, rows_fit, multiple, d, device, need_workspace):
    """(start, end, zeroed float32 workspace [rows, d]) covering [0, total) in ranges that fit."""
    rows = max(multiple, rows_fit // multiple * multiple)
    ws = torch.empty(min(total, rows), d, dtype=torch.float32, device=device) if need_workspace else None
    for start in range(0, total, rows):
        if ws is not None:
            ws.zero_()
        yield start, min(total, start + rows), ws


class _Launcher:
    """Launches the kernel over a token range x a vocabulary range into the given accumulators
    (dX, dW relative to the ranges; dB, dU, dLB over all tokens / all of V)."""

    def __init__(self, x, w, bias, labels, lse, alpha, beta, gamma, num_heads, softcap, cfg, low_rank, db, du, dlb):
        u, lb, self.rank, self.stride_u, self.stride_lb = low_rank_args(low_rank, lse)
        self.args = (x, w, bias if bias is not None else lse, u, lb, labels, lse, alpha, beta, gamma)
        self.x, self.w, self.cfg, self.side = x, w, cfg, (db, du, dlb)
        self.num_heads, self.softcap, self.has_bias = num_heads, softcap, bias is not None
        self.has_low_rank = low_rank is not None

    def __call__(self, token_range, vocab_range, dx_acc, dw_acc, with_db, with_du, with_dlb):
        (n0, n1), (v0, v1) = token_range, vocab_range
        cfg, d = self.cfg, self.x.shape[1]
        dummy = self.args[6]
        db, du, dlb = (acc if use else dummy for acc, use in zip(self.side, (with_db, with_du, with_dlb)))
        grid = (triton.cdiv(n1 - n0, cfg["BLOCK_N"]) * triton.cdiv(v1 - v0, cfg["BLOCK_V"]), self.num_heads)
        _backward_kernel[grid](
            *self.args,
            dx_acc if dx_acc is not None else dummy, dw_acc if dw_acc is not None else dummy, db, du, dlb,
            n0, n1, v0, v1, d // self.num_heads, self.rank, self.x.stride(0), self.w.stride(0),
            self.stride_u, self.stride_lb, d, d,
            float(self.softcap) if self.softcap is not None else 1.0,
            NUM_HEADS=self.num_heads, HAS_BIAS=self.has_bias, HAS_SOFTCAP=self.softcap is not None,
            HAS_LOW_RANK=self.has_low_rank, NEED_DX=dx_acc is not None, NEED_DW=dw_acc is not None,
            NEED_DB=with_db, NEED_DU=with_du, NEED_DLB=with_dlb, **cfg, **dot_settings(self.x.dtype),
        )
