"""Triton forward sweep: per token and head, the online logsumexp over the vocabulary, optionally
the sum of the logits and, for one head, the target's rank in the same pass (several heads:
``triton_ranks``).  The target logits come first, from their own small launch (``_target_kernel``):
one tile per token block, with the sweep's code and tiles, so that they round like the sweep's logits,
without the sweep kernel carrying that tile's registers.

Grid: (token blocks, vocabulary splits, heads).  Each program streams one split of the vocabulary
for BLOCK_N tokens of one head, the statistics in registers.  Splits exist for occupancy: 4096
tokens are only 64 token blocks, half an H100's 132 SMs; each split writes its partial maximum and
rest of the sum (kept apart: see mixture.py and ``add_tile``), logit sum and rank count, combined afterwards in float32
(``combine_splits`` / sums over splits, O(S * N * H)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .torch_sweep import SweepStats
from .triton_ranks import mixture_ranks
from .triton_tile import (add_tile, at_labels, dot_settings, launch_config, log_sum_from_rest_, logits_tile,
                          low_rank_args, target_logits_tile, vocab_grid)


@triton.jit
def _target_kernel(
    X, W, B, U, LB, Labels, Target,
    N, Dh, R, stride_x, stride_w, stride_u, stride_lb, softcap,
    NUM_HEADS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_LOW_RANK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_IN_ORDER: tl.constexpr, PRECISION: tl.constexpr,
):
    head = tl.program_id(1).to(tl.int64)
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    t = target_logits_tile(X, W, B, U, LB, Labels, N, row0, rows, row_mask, head * Dh, Dh, head * R, R,
                           stride_x, stride_w, stride_u, stride_lb, softcap, HAS_BIAS, HAS_SOFTCAP, HAS_LOW_RANK,
                           BLOCK_N, BLOCK_V, BLOCK_K, DOT_IN_ORDER, PRECISION)
    tl.store(Target + rows * NUM_HEADS + head, t, mask=row_mask)


@triton.jit
def _forward_kernel(
    X, W, B, U, LB, Labels, Top, Rest, Target, LogitSum, Ranks,
    N, V, V_PER_SPLIT, Dh, R, stride_x, stride_w, stride_u, stride_lb, softcap,
    NUM_HEADS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_LOW_RANK: tl.constexpr,
    NEED_SUM: tl.constexpr, NEED_RANKS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_IN_ORDER: tl.constexpr, PRECISION: tl.constexpr,
):
    split = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    col0 = head * Dh
    if NEED_RANKS:  # one head: rank against the target logit _target_kernel wrote
        labels = tl.load(Labels + rows, mask=row_mask, other=-1)
        t_acc = tl.load(Target + rows * NUM_HEADS + head, mask=row_mask, other=0.0)

    m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    rest = tl.full([BLOCK_N], -1.0, dtype=tl.float32)  # sum exp(y - m) - 1 (an empty sum: -1); see add_tile
    y_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    rank = tl.zeros([BLOCK_N], dtype=tl.int32)  # a split's count is below V < 2^31
    v_begin = split * V_PER_SPLIT
    v_end = tl.minimum(v_begin + V_PER_SPLIT, V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_mask = cols < v_end
        y = logits_tile(X, W, B, U, LB, rows, cols, row_mask, col_mask, col0, Dh, head * R, R,
                        stride_x, stride_w, stride_u, stride_lb, softcap,
                        HAS_BIAS, HAS_SOFTCAP, HAS_LOW_RANK, BLOCK_N, BLOCK_V, BLOCK_K, DOT_IN_ORDER, PRECISION)
        y = tl.where(col_mask[None, :], y, float("-inf"))
        m, rest = add_tile(y, m, rest)
        if NEED_SUM:
            y_sum += tl.sum(tl.where(col_mask[None, :], y, 0.0), axis=1)
        if NEED_RANKS:  # one head only: entries j != t above the target logit (masked cols are -inf)
            rank += tl.sum(((y > t_acc[:, None]) & ~at_labels(labels, v0, BLOCK_V)).to(tl.int32), axis=1)

    out = rows * NUM_HEADS + head
    partial = split * N * NUM_HEADS + out  # [splits, N, H] partials
    tl.store(Top + partial, m, mask=row_mask)  # apart, not as m + log(1 + rest): see mixture.py
    tl.store(Rest + partial, rest, mask=row_mask)
    if NEED_SUM:
        tl.store(LogitSum + partial, y_sum, mask=row_mask)
    if NEED_RANKS:
        tl.store(Ranks + split * N + rows, rank, mask=row_mask)


def forward_stats(x, w, bias, labels, num_heads, softcap, need_logit_sum, need_ranks=False, low_rank=None):
    """Triton counterpart of ``torch_sweep.forward_stats`` (same SweepStats, float32).

    ``labels`` [N] int64 with -1 for ignored tokens; x [N, D], w [V, D] and the optional
    ``low_rank`` pair (U [N, H, R], B [V, R]) contiguous.
    """
    n, d = x.shape
    v = w.shape[0]
    dh = d // num_heads
    cfg = launch_config("forward", x.dtype, x.device)
    requested = cfg.pop("SPLITS")  # host side: the grid, not a kernel argument
    n_blocks, splits, per_split = vocab_grid(n, v, cfg["BLOCK_N"], cfg["BLOCK_V"], x.device, requested, num_heads)
    f32 = {"dtype": torch.float32, "device": x.device}
    top = torch.empty(splits, n, num_heads, **f32)
    rest = torch.empty(splits, n, num_heads, **f32)
    target = torch.empty(n, num_heads, **f32)
    logit_sum = torch.empty(splits, n, num_heads, **f32) if need_logit_sum else top  # dummy when unused
    same_pass_ranks = need_ranks and num_heads == 1
    ranks = torch.empty(splits, n, dtype=torch.int64, device=x.device) if same_pass_ranks else labels
    u, lb, rank, stride_u, stride_lb = low_rank_args(low_rank, x)
    flags = dict(NUM_HEADS=num_heads, HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
                 HAS_LOW_RANK=low_rank is not None, **cfg, **dot_settings(x.dtype))
    _target_kernel[(n_blocks, num_heads)](
        x, w, bias if bias is not None else x, u, lb, labels, target,
        n, dh, rank, x.stride(0), w.stride(0), stride_u, stride_lb,
        float(softcap) if softcap is not None else 1.0, **flags,
    )
    _forward_kernel[(n_blocks, splits, num_heads)](
        x, w, bias if bias is not None else x, u, lb, labels, top, rest, target, logit_sum, ranks,
        n, v, per_split, dh, rank, x.stride(0), w.stride(0), stride_u, stride_lb,
        float(softcap) if softcap is not None else 1.0, NEED_SUM=need_logit_sum, NEED_RANKS=same_pass_ranks, **flags,
    )
    top, log_sum = combine_splits(top, rest)
    logit_sum = (logit_sum[0] if splits == 1 else logit_sum.sum(0)) if need_logit_sum else None
    if same_pass_ranks:
        ranks = ranks[0] if splits == 1 else ranks.sum(0)
    elif need_ranks:
        ranks = mixture_ranks(x, w, bias, labels, top + log_sum, target, num_heads, softcap, low_rank)
    return SweepStats(top, log_sum, target, logit_sum, ranks if need_ranks else None)


def combine_splits(top, rest):
    """(max, log sum exp(y - max)) [N, H] over the whole vocabulary from its splits' maxima and rests
    [S, N, H] (rest = sum exp(y - max) - 1 of a split, -1 where all its entries are -inf).

    The sum keeps its 1 out, as the kernel does: the split holding the maximum gives its rest, every
    other split its whole sum rescaled, exp(top_s - max) (1 + rest_s); log1p of the total
    (``log_sum_from_rest_``: NaN where the maximum is +inf)."""
    if top.shape[0] == 1:
        return top[0], log_sum_from_rest_(top[0], rest[0])  # in place: the kernel's buffer, used once
    whole, first = top.max(dim=0, keepdim=True)
    base = torch.where(whole == float("-inf"), 0.0, whole)  # every split masked: their -inf add 0, not NaN
    others = torch.exp(top - base) * (1.0 + rest)
    others.scatter_(0, first, 0.0)
    return whole[0], log_sum_from_rest_(whole[0], rest.gather(0, first)[0] + others.sum(0))
