"""Triton rank sweep under the mixture (several heads): per token, the number of entries j != t
with log pbar_j > log pbar_t, compared in float32.

The mixture's per-entry log-probabilities need every head's logsumexp, so this is a second sweep
after ``triton_forward``.  Grid: token blocks x vocabulary splits (as the forward's, so that a few
thousand tokens still fill the device); each program streams its split and, per tile, combines the H
head tiles with an online logsumexp; the splits' counts are added afterwards (exact integers).  The
target's mixture value is built by the same sequence of operations from the target logits, so exact
ties compare equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_tile import at_labels, dot_settings, launch_config, logits_tile, low_rank_args, vocab_grid


@triton.jit
def _mixture_rank_kernel(
    X, W, B, U, LB, Labels, Lse, Target, Ranks,
    N, V, per_split, Dh, R, stride_x, stride_w, stride_u, stride_lb, softcap,
    NUM_HEADS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_LOW_RANK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_IN_ORDER: tl.constexpr, PRECISION: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    labels = tl.load(Labels + rows, mask=row_mask, other=-1)

    t_max = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    t_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    for h in range(0, NUM_HEADS):
        lp = tl.load(Target + rows * NUM_HEADS + h, mask=row_mask, other=0.0) \
            - tl.load(Lse + rows * NUM_HEADS + h, mask=row_mask, other=0.0)
        new_max = tl.maximum(t_max, lp)
        base = tl.where(new_max == float("-inf"), 0.0, new_max)  # a target masked (-inf) in every head
        t_sum = t_sum * tl.exp(t_max - base) + tl.exp(lp - base)
        t_max = new_max
    t_mix = t_max + tl.log(t_sum)

    split = tl.program_id(1)
    v_start = split * per_split
    v_end = tl.minimum(V, v_start + per_split)
    rank = tl.zeros([BLOCK_N], dtype=tl.int32)  # below V < 2^31
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_mask = cols < v_end
        m = tl.full([BLOCK_N, BLOCK_V], float("-inf"), dtype=tl.float32)
        s = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
        for h in range(0, NUM_HEADS):
            y = logits_tile(X, W, B, U, LB, rows, cols, row_mask, col_mask, h * Dh, Dh, h * R, R,
                            stride_x, stride_w, stride_u, stride_lb, softcap, HAS_BIAS, HAS_SOFTCAP,
                            HAS_LOW_RANK, BLOCK_N, BLOCK_V, BLOCK_K, DOT_IN_ORDER, PRECISION)
            # the select keeps y rounded on its own before the subtraction: a GPU compile would otherwise fuse a
            # softcap's c * tanh into it (one fma), and a row equal to the target's, whose y _target_kernel
            # stored rounded, would compare unequal (an exact tie ranked above the target)
            y = tl.where(col_mask[None, :], y, float("-inf"))
            lp = y - tl.load(Lse + rows * NUM_HEADS + h, mask=row_mask, other=0.0)[:, None]
            new_max = tl.maximum(m, lp)
            base = tl.where(new_max == float("-inf"), 0.0, new_max)  # entries masked (-inf bias): not NaN
            s = s * tl.exp(m - base) + tl.exp(lp - base)
            m = new_max
        mix = m + tl.log(s)
        above = (mix > t_mix[:, None]) & col_mask[None, :] & ~at_labels(labels, v0, BLOCK_V)
        rank += tl.sum(above.to(tl.int32), axis=1)
    tl.store(Ranks + split * N + rows, rank, mask=row_mask)


def mixture_ranks(x, w, bias, labels, lse, target, num_heads, softcap, low_rank=None):
    """Ranks [N] int64 under the mixture, from the forward's float32 lse and target [N, H]."""
    n, d = x.shape
    v = w.shape[0]
    dh = d // num_heads
    cfg = launch_config("ranks", x.dtype, x.device)
    requested = cfg.pop("SPLITS")  # host side: the grid, not a kernel argument
    n_blocks, splits, per_split = vocab_grid(n, v, cfg["BLOCK_N"], cfg["BLOCK_V"], x.device, requested)
    ranks = torch.empty(splits, n, dtype=torch.int64, device=x.device)
    u, lb, rank, stride_u, stride_lb = low_rank_args(low_rank, x)
    _mixture_rank_kernel[(n_blocks, splits)](
        x, w, bias if bias is not None else x, u, lb, labels, lse, target, ranks,
        n, v, per_split, dh, rank, x.stride(0), w.stride(0), stride_u, stride_lb,
        float(softcap) if softcap is not None else 1.0,
        NUM_HEADS=num_heads, HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
        HAS_LOW_RANK=low_rank is not None,
        **cfg, **dot_settings(x.dtype),
    )
    return ranks[0] if splits == 1 else ranks.sum(0)
