"""Gradients computed in the forward (training with a mean or summed loss): 6NDV FLOPs instead of 8NDV.

A design that never holds the logits recomputes them in the backward (8NDV, 1.33x the 6NDV floor at
best).  When every valid token's incoming gradient is known at forward time up to one common factor
(the loss is a mean or a sum of the per-token losses), the forward can form dY as soon as a chunk of
tokens has its statistics and do dX and dW at once.  The backward then scales the stored gradients by
(incoming gradient) / (assumed gradient): exactly 1 for ``loss.backward()`` of a mean, a power of two
under gradient accumulation or a loss scaler (exact too), one more rounding otherwise.

Per chunk of tokens (all heads, the whole vocabulary), within ``HF_MHCE_WORKSPACE_MB``:
- float32 logits z_h = X_h W_h^T (+ U_h B^T) from matmuls (cuBLAS on a GPU) into a slab [H, rows, V]
  (rows padded to 8 entries, as cuBLAS's fast kernels need);
- ``_row_stats_kernel``: bias and softcap, then logsumexp (max and the rest of the sum, as the tiles keep
  them: ``triton_tile.add_tile``), target logit and logit sum of each row;
- ``mixture.grad_coefficients``, then ``_dlogits_in_place_kernel``: dY in the input dtype, written over
  the front of its own row of the slab (one program per row: every 16-bit store lands on bytes that the
  row's earlier blocks already read, and a barrier orders the warps);
- dX[chunk, head h] = dY_h W_h, written once (the chunk spans the vocabulary); dW_h = dY_h^T X_h written
  once when one chunk holds every token, else summed in float32 (4VD bytes, counted in the workspace);
  dU likewise per chunk, dB_low and dB summed in float32.
Statistics round like the Triton forward's (float32 logits), not like eager's bf16 logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import mixture
from .budget import grad_in_forward, workspace_bytes
from .torch_sweep import MIN_GEMM_SIZE, SweepStats
from .triton_backward import _aligned, _matmul_into, _zero_ignored_nonfinite, accumulation_mode
from .triton_tile import log_sum_from_rest_, softcap_and_slope, softcap_fn

# Below this many tokens per chunk the matmuls run thin (and the float32 dW is summed often): the
# backward's slabs are the better use of a small workspace.
MIN_ROWS = 256
_BLOCK_V = 1024


@triton.jit
def _logits_block(z_row, B, cols, mask, softcap, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """The logits y at ``cols`` of a slab row of matmul outputs z: bias, then softcap."""
    y = tl.load(z_row + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        y = softcap_fn(y, softcap)
    return y


@triton.jit
def _row_stats_kernel(
    Z, B, Labels, Top, Rest, Target, LogitSum, Ranks, n0, V, stride_head, stride_row, softcap,
    NUM_HEADS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, NEED_SUM: tl.constexpr,
    NEED_RANKS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    z_row = Z + head * stride_head + row * stride_row
    # The target logit first, read off the slab: it rounds as its row's entries do (exact rank ties).
    label = tl.load(Labels + n0 + row)
    t_col = tl.maximum(label, 0)
    t = tl.load(z_row + t_col)
    if HAS_BIAS:
        t += tl.load(B + t_col).to(tl.float32)
    if HAS_SOFTCAP:
        t = softcap_fn(t, softcap)
    rank = tl.zeros([BLOCK_V], dtype=tl.int64)
    # Per lane running max and rest = sum exp(y - max) - 1 (no reduction inside the loop), combined at the
    # end.  The sum keeps its maximum's 1 out (-1: an empty sum), as triton_tile.add_tile explains.
    m = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
    rest = tl.full([BLOCK_V], -1.0, dtype=tl.float32)
    y_sum = tl.zeros([BLOCK_V], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        mask = cols < V
        y = _logits_block(z_row, B, cols, mask, softcap, HAS_BIAS, HAS_SOFTCAP)
        if NEED_SUM:
            y_sum += tl.where(mask, y, 0.0)
        y = tl.where(mask, y, float("-inf"))
        m_new = tl.maximum(m, y)
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far (masked vocabulary): adds 0
        scale = tl.exp(m - base)
        rest = tl.where(y > m, scale + rest * scale, rest + tl.exp(y - base))  # a new maximum: its 1 implicit
        m = m_new
        if NEED_RANKS:  # one head: entries j != t above the target (masked columns are -inf)
            rank += ((y > t) & (cols != label)).to(tl.int64)
    top = tl.max(m, axis=0)
    top_base = tl.where(top == float("-inf"), 0.0, top)
    # the lane holding the maximum gives its rest, every other lane its whole sum rescaled
    first = tl.argmax(m, axis=0)
    lanes = tl.arange(0, BLOCK_V)
    row_rest = tl.sum(tl.where(lanes == first, rest, tl.exp(m - top_base) * (1.0 + rest)), axis=0)
    out = (n0 + row) * NUM_HEADS + head
    tl.store(Top + out, top)  # the logsumexp's two parts, apart: see mixture.py
    tl.store(Rest + out, row_rest)  # log1p on the host
    tl.store(Target + out, tl.where(label >= 0, t, 0.0))
    if NEED_SUM:
        tl.store(LogitSum + out, tl.sum(y_sum, axis=0))
    if NEED_RANKS:
        tl.store(Ranks + n0 + row, tl.sum(rank, axis=0))


@triton.jit
def _dlogits_in_place_kernel(
    Z, DY, B, Labels, Top, LogSum, Alpha, TargetGrad, Gamma, n0, V, stride_head, stride_row, dy_stride_head, dy_stride_row,
    softcap,
    NUM_HEADS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    z_row = Z + head * stride_head + row * stride_row
    dy_row = DY + head * dy_stride_head + row * dy_stride_row
    label = tl.load(Labels + n0 + row)
    valid = label >= 0
    local = row * NUM_HEADS + head  # the coefficients are the chunk's, the statistics all tokens'
    stat = n0 * NUM_HEADS + local
    top = tl.where(valid, tl.load(Top + stat), 0.0)  # an ignored row's NaN stays out
    log_sum = tl.where(valid, tl.load(LogSum + stat), 0.0)
    alpha = tl.where(valid, tl.load(Alpha + local), 0.0)
    target_grad = tl.where(valid, tl.load(TargetGrad + local), 0.0)
    gamma = tl.where(valid, tl.load(Gamma + row), 0.0)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        mask = cols < V
        y = _logits_block(z_row, B, cols, mask, softcap, HAS_BIAS, False)
        if HAS_SOFTCAP:
            y, slope = softcap_and_slope(y, softcap)
        p = tl.exp((y - top) - log_sum)  # the target's entry from log p_t: see mixture.py
        dy = tl.where(cols == label, target_grad, alpha * p) - gamma
        if HAS_SOFTCAP:
            dy *= slope
        dy = tl.where(valid, dy, 0.0)  # ignored rows: 0, even where their logits are NaN
        # Every warp has read this block before any warp writes it: a 16-bit store of block j overlaps
        # the float32 entries of blocks <= j / 2, which other warps read.
        tl.debug_barrier()
        tl.store(dy_row + cols, dy.to(DY.dtype.element_ty), mask=mask)


def chunk_rows(n: int, v: int, d: int, num_heads: int, dtype: torch.dtype, need_dw: bool, budget: int) -> int:
    """Tokens per chunk within ``budget`` bytes, or 0 when gradients in the forward do not fit (then the
    forward keeps only statistics and the backward recomputes).  An eighth of the budget is kept for
    the matmuls' temporaries; several chunks of 16-bit inputs also need the float32 dW (4VD bytes)."""
    row_bytes = num_heads * _aligned(v) * 4
    room = budget - budget // 8
    if n * row_bytes <= room:
        return n
    if need_dw and dtype != torch.float32:
        room -= 4 * v * d
    rows = max(room, 0) // row_bytes
    return rows if rows >= MIN_ROWS else 0


def forward_with_grads(x, w, bias, labels, valid, num_heads, softcap, label_smoothing, z_loss, grad_scale, needs,
                       low_rank=None):
    """(SweepStats, gradients) with every valid token's incoming gradient taken as ``grad_scale`` (a
    float32 0-dim tensor), or None when the workspace cannot hold it (see ``chunk_rows``),
    ``HF_MHCE_GRAD_IN_FORWARD`` is 0, or the inputs are fp16.

    Arguments as ``triton_forward.forward_stats`` and ``triton_backward.backward`` (labels -1 for
    ignored tokens, ``valid`` their mask); the gradients are those ``backward`` returns for ``needs``.
    """
    n, d = x.shape
    v, h = w.shape[0], num_heads
    dh = d // h
    need_dx, need_dw, need_db = needs[:3]
    need_du, need_dlb = needs[3:] if low_rank is not None else (False, False)
    if not grad_in_forward() or x.dtype == torch.float16 or not _slabs_apply(x):
        # fp16: dY formed at the assumed gradient (1 / tokens) would underflow where a loss scaler's factor,
        # known only in the backward, keeps the recompute schedule's dY in range
        return None
    budget = workspace_bytes()
    rows = chunk_rows(n, v, d, h, x.dtype, need_dw, budget)
    if rows == 0:
        return None
    temp = budget // 8
    f32 = {"dtype": torch.float32, "device": x.device}
    stats = _empty_stats(n, h, x.device, bool(label_smoothing), False)
    single = rows >= n
    dx = torch.empty_like(x) if need_dx else None
    dw = torch.empty_like(w) if need_dw else None
    dw_acc = torch.zeros(h, v, dh, **f32) if need_dw and not single and x.dtype != torch.float32 else None
    db = torch.zeros(v, **f32) if need_db else None
    u, lb = low_rank if low_rank is not None else (None, None)
    du = torch.empty_like(u) if need_du else None
    dlb = torch.zeros(lb.shape, **f32) if need_dlb else None
    x_for_dw = _zero_ignored_nonfinite(x, labels) if need_dw else x
    u_for_dlb = _zero_ignored_nonfinite(u, labels) if need_dlb else u
    flags, cap = _row_kernel_flags(h, bias, softcap)
    for n0, n1, z in _slab_sweep(x, w, bias, labels, h, softcap, low_rank, rows, temp, stats):
        m = n1 - n0
        dy = z.view(x.dtype)[:, :, :v]  # dY of a row: the front of that row's bytes
        part = stats.rows(n0, n1)
        alpha, target_grad, gamma = mixture.grad_coefficients(part.lse, part.log_p_target, valid[n0:n1],
                                                              grad_scale.expand(m), v, label_smoothing, z_loss)
        _dlogits_in_place_kernel[(m, h)](
            z, dy, bias if bias is not None else stats.top, labels, stats.top, stats.log_sum, alpha.contiguous(),
            target_grad.contiguous(), gamma.contiguous(), n0, v, z.stride(0), z.stride(1), dy.stride(0), dy.stride(1),
            cap, **flags)
        for head in range(h):
            cols, dy_h = slice(head * dh, (head + 1) * dh), dy[head]
            if need_dx:
                torch.mm(dy_h, w[:, cols], out=dx[n0:n1, cols])
            if need_dw:
                if dw_acc is not None:
                    _matmul_into(dw_acc[head], dy_h.T, x_for_dw[n0:n1, cols], True, temp)
                elif n0 == 0:  # one chunk (rounded once), or float32 inputs (dW is the accumulator)
                    torch.mm(dy_h.T, x_for_dw[n0:n1, cols], out=dw[:, cols])
                else:
                    dw[:, cols].addmm_(dy_h.T, x_for_dw[n0:n1, cols])
            if need_db:  # column sums of the rounded dY, as eager's dB, in float32
                db += dy_h.sum(0, dtype=torch.float32)
            if need_du:
                torch.mm(dy_h, lb, out=du[n0:n1, head])
            if need_dlb:
                _matmul_into(dlb, dy_h.T, u_for_dlb[n0:n1, head], True, temp)
    if dw_acc is not None:
        dw.view(v, h, dh).copy_(dw_acc.transpose(0, 1))
    grads = (dx, dw, db.to(bias.dtype) if need_db else None)
    if low_rank is not None:
        grads += (du, dlb.to(lb.dtype) if need_dlb else None)
    return stats, grads


def slab_forward_stats(x, w, bias, labels, num_heads, softcap, need_logit_sum, need_ranks=False, low_rank=None):
    """``triton_forward.forward_stats`` from cuBLAS logit slabs and ``_row_stats_kernel`` (ranks: one
    head, in the same pass), or None when a chunk of MIN_ROWS tokens does not fit the workspace or
    ranks under several heads are asked for.  A candidate for the statistics-only forward, measured
    beside the tile kernels by benchmarks/peers.py before it is used by default (NOTES change 9)."""
    n, d = x.shape
    v, h = w.shape[0], num_heads
    budget = workspace_bytes()
    rows = chunk_rows(n, v, d, h, x.dtype, False, budget)
    if rows == 0 or (need_ranks and h > 1) or not _slabs_apply(x):
        return None
    stats = _empty_stats(n, h, x.device, need_logit_sum, need_ranks)
    for _ in _slab_sweep(x, w, bias, labels, h, softcap, low_rank, rows, budget // 8, stats):
        pass
    return stats


def _empty_stats(n, num_heads, device, need_logit_sum, need_ranks) -> SweepStats:
    f32 = {"dtype": torch.float32, "device": device}
    top, log_sum, target = (torch.empty(n, num_heads, **f32) for _ in range(3))
    return SweepStats(top, log_sum, target, torch.empty(n, num_heads, **f32) if need_logit_sum else None,
                      torch.empty(n, dtype=torch.int64, device=device) if need_ranks else None)


def _slab_sweep(x, w, bias, labels, num_heads, softcap, low_rank, rows, temp, stats):
    """Chunks of ``rows`` tokens: their float32 logits in one slab [H, rows, V] (rows padded), and their
    row statistics written into ``stats``; yields (n0, n1, z), z [H, tokens, padded V] the chunk's logits
    before bias and softcap (valid until the next chunk)."""
    n, v, h = x.shape[0], w.shape[0], num_heads
    slab = torch.empty(h, rows, _aligned(v), dtype=torch.float32, device=x.device)
    flags, cap = _row_kernel_flags(h, bias, softcap)
    top = stats.top
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        z = slab[:, : n1 - n0]
        _chunk_logits(z[:, :, :v], x, w, low_rank, n0, n1, temp)
        _row_stats_kernel[(n1 - n0, h)](
            z, bias if bias is not None else top, labels, top, stats.log_sum, stats.target,
            stats.logit_sum if stats.logit_sum is not None else top,
            stats.ranks if stats.ranks is not None else labels, n0, v, z.stride(0), z.stride(1), cap,
            NEED_SUM=stats.logit_sum is not None, NEED_RANKS=stats.ranks is not None, **flags)
        log_sum_from_rest_(top[n0:n1], stats.log_sum[n0:n1])  # the kernel wrote the rest of the sum, sum - 1
        yield n0, n1, z


def _row_kernel_flags(num_heads, bias, softcap) -> tuple[dict, float]:
    """The row kernels' constexprs and launch options, and the softcap argument (1.0 when unused)."""
    flags = dict(NUM_HEADS=num_heads, HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, BLOCK_V=_BLOCK_V,
                 num_warps=8, enable_fp_fusion=True)  # FMA contraction stated, as dot_settings does for the tiles
    return flags, float(softcap) if softcap is not None else 1.0


def _slabs_apply(x) -> bool:
    """Whether cuBLAS logit slabs keep the tile kernels' numerics and the workspace bound here: not for
    float32 inputs while torch allows TF32 matmuls (the tiles take exact float32 products), nor on a GPU
    whose torch cannot write float32 products of 16-bit operands (upcast copies of W would exceed the
    bound)."""
    if not x.is_cuda:
        return True
    if x.dtype == torch.float32:
        return not torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest"
    return bool(accumulation_mode(x))


def _chunk_logits(z, x, w, low_rank, n0, n1, temp):
    """z [H, rows, V] (float32) = each head's logits of tokens n0:n1 before bias and softcap."""
    if not x.is_cuda and min(n1 - n0, w.shape[0]) < MIN_GEMM_SIZE:
        return _padded_chunk_logits(z, x, w, low_rank, n0, n1, temp)
    h = z.shape[0]
    dh = x.shape[1] // h
    for head in range(h):
        cols = slice(head * dh, (head + 1) * dh)
        _logits_into(z[head], x[n0:n1, cols], w[:, cols], temp)
        if low_rank is not None:
            _matmul_into(z[head], low_rank[0][n0:n1, head], low_rank[1].T, True, temp)


def _padded_chunk_logits(z, x, w, low_rank, n0, n1, temp):
    """``_chunk_logits`` from products of at least MIN_GEMM_SIZE rows and columns (the short side
    zero-padded): CPU BLAS rounds an entry of a product of a few rows or columns with its position,
    which gave copies of the target's weight row logits unequal to the target's (ranked above it)."""
    rows, v = n1 - n0, w.shape[0]
    u, b = low_rank if low_rank is not None else (None, None)
    x, w, b = _zero_padded(x[n0:n1], MIN_GEMM_SIZE), _zero_padded(w, MIN_GEMM_SIZE), _zero_padded(b, MIN_GEMM_SIZE)
    u = _zero_padded(u[n0:n1], MIN_GEMM_SIZE) if u is not None else None
    zp = torch.empty(z.shape[0], len(x), len(w), dtype=torch.float32)
    _chunk_logits(zp, x, w, (u, b) if u is not None else None, 0, len(x), temp)
    z.copy_(zp[:, :rows, :v])


def _zero_padded(t, size):
    """``t`` with zero rows after it up to ``size`` rows (``t`` itself if it has as many, or is None)."""
    if t is None or len(t) >= size:
        return t
    out = t.new_zeros(size, *t.shape[1:])
    out[: len(t)] = t
    return out


def _logits_into(z, x_h, w_h, temp):
    """z [rows, V] (float32, rows strided) = x_h @ w_h^T with float32 output; temporaries of at most
    about ``temp`` bytes where torch cannot write a float32 product of 16-bit operands into z."""
    if x_h.dtype == torch.float32:
        torch.mm(x_h, w_h.T, out=z)
    elif not accumulation_mode(x_h):  # CPU: upcast copies (products of 16-bit values are exact in float32)
        torch.mm(x_h.float(), w_h.float().T, out=z)
    elif writes_strided_float32(x_h):  # cuBLAS writes float32 from 16-bit operands into z's padded rows
        torch.mm(x_h, w_h.T, out_dtype=torch.float32, out=z)
    else:  # mm(out_dtype=) without such an out: row blocks, copied in
        step = max(1, temp // (4 * max(z.shape[1], 1)))
        for r0 in range(0, z.shape[0], step):
            z[r0:r0 + step] = torch.mm(x_h[r0:r0 + step], w_h.T, out_dtype=torch.float32)


_STRIDED: dict = {}  # device -> whether mm(out_dtype=float32) writes into a row-strided out


def writes_strided_float32(t: torch.Tensor) -> bool:
    """Whether mm(a, b, out_dtype=float32, out=o) fills a row-strided ``o`` on ``t``'s device (checked
    once on exact small values: the slabs' rows are padded)."""
    if t.device not in _STRIDED:
        a = (torch.arange(48 * 40, device=t.device) % 7 - 3).view(48, 40).to(torch.bfloat16)
        b = (torch.arange(40 * 24, device=t.device) % 5 - 2).view(40, 24).to(torch.bfloat16)
        out = torch.zeros(48, 32, device=t.device)[:, :24]
        try:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
            _STRIDED[t.device] = torch.equal(out, a.float() @ b.float())
        except (TypeError, RuntimeError, NotImplementedError):
            _STRIDED[t.device] = False
    return _STRIDED[t.device]
