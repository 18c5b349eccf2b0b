"""Chunked torch implementation of the multi-head vocabulary sweeps (CPU and any non-CUDA device).

Blocks of [H, rows, cols] logits are formed one at a time, never the [N, V] (or [N, H, V]) logits.
The block shape follows a memory budget, ``HF_MHCE_CHUNK_MB`` (default 64 MB), which bounds every
temporary of a block: the logits block and its three elementwise companions, the weight columns
upcast to the compute dtype and, in the backward, their gradient accumulator.  Outside the budget
the sweeps keep O(N * H) statistics, plus (backward) a compute-dtype dX buffer when hidden is not
already in the compute dtype (otherwise that buffer is the returned dX).

Block-sized temporaries live in buffers reused across the blocks of a sweep (``_Problem.scratch``),
with in-place elementwise steps: a fresh [H, rows, cols] tensor per block is large enough that
glibc maps and unmaps it every time, and those page faults cost a third of an MHCE sweep's CPU time.

Loops run over vocabulary chunks outermost so that each weight chunk is upcast once and its
gradient is accumulated in the compute dtype (float32, or float64 for float64 inputs) and written
to dW once: no low-precision accumulation of dW across chunks.

``low_rank`` = (U [N, H, R], B [V, R]) adds a rank-R term to every head, y_h += U_h B^T: a LoRA
adapter on the head (B shared by the heads, U_h = A_h x_h) without a widened [V, D + H*R] copy
of the weight, and with dW of a frozen base weight skipped (see ``backward``'s ``needs``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .budget import megabytes_env

DEFAULT_CHUNK_MB = 64.0
_MAX_COLS = 4096


def chunk_bytes() -> int:
    """Memory budget of one block in bytes, from ``HF_MHCE_CHUNK_MB`` (read on every call)."""
    return megabytes_env("HF_MHCE_CHUNK_MB", DEFAULT_CHUNK_MB)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_shape(n: int, v: int, d: int, h: int, elem: int, budget: int) -> tuple[int, int]:
    """(rows, cols) of a logits block so that its temporaries fit in ``budget`` bytes."""
    cols = min(v, _MAX_COLS)
    while True:
        fixed = 3 * cols * d * elem  # upcast weight chunk, its gradient accumulator and one block's product
        per_row = 4 * h * cols * elem + 2 * d * elem  # logits-sized temporaries + hidden rows
        rows = (budget - fixed) // per_row
        if rows >= min(n, 16) or cols == 1:
            return int(max(1, min(n, rows))), cols
        cols = max(1, cols // 2)


def _blocks(total: int, size: int):
    for start in range(0, total, size):
        yield start, min(start + size, total)


# CPU BLAS takes other kernels for products of a few rows or columns, where an entry rounds with its
# position (in one full logits matmul too): every logits product has at least this many of each.
MIN_GEMM_SIZE = 16


class _Problem:
    """Inputs of one sweep, viewed per head, with block iteration helpers."""

    def __init__(self, x, w, bias, num_heads, softcap, low_rank=None):
        self.x, self.w, self.bias, self.h, self.softcap = x, w, bias, num_heads, softcap
        self.u, self.b = low_rank if low_rank is not None else (None, None)
        self.n, self.d = x.shape
        self.v = w.shape[0]
        self.dh = self.d // num_heads
        self.cdt = compute_dtype(x.dtype)
        elem = torch.finfo(self.cdt).bits // 8
        self.rows, self.cols = block_shape(self.n, self.v, self.d, num_heads, elem, chunk_bytes())
        self._scratch = {}

    def scratch(self, name, *shape, dtype=None):
        """A contiguous tensor of ``shape`` (compute dtype by default) in buffer ``name``, reused block
        after block (the first block is the largest, so a buffer is allocated once per sweep)."""
        numel = math.prod(shape)
        flat = self._scratch.get(name)
        if flat is None or flat.numel() < numel:
            flat = self._scratch[name] = torch.empty(numel, dtype=dtype or self.cdt, device=self.x.device)
        return flat[:numel].view(shape)

    def weight_chunk(self, v0, v1):
        """[H, Dh, cols] compute-dtype view of weight rows v0:v1."""
        return self.w[v0:v1].to(self.cdt).view(v1 - v0, self.h, self.dh).permute(1, 2, 0)

    def hidden_chunk(self, n0, n1):
        """[H, rows, Dh] compute-dtype view of hidden rows n0:n1."""
        return self.x[n0:n1].to(self.cdt).view(n1 - n0, self.h, self.dh).transpose(0, 1)

    def low_rank_chunk(self, n0, n1, v0, v1):
        """(U [H, rows, R], B^T [R, cols]) in compute dtype, or None without a low-rank term."""
        if self.u is None:
            return None
        return self.u[n0:n1].to(self.cdt).transpose(0, 1), self.b[v0:v1].to(self.cdt).T

    def logits(self, n0, n1, v0, v1, wc, softcap=True):
        """Logits block [H, n1 - n0, v1 - v0] in compute dtype, softcap applied unless ``softcap`` is False
        (wc: ``weight_chunk(v0, v1)``), in the scratch buffer "y": valid until the next block's logits.

        Every product has at least MIN_GEMM_SIZE rows and columns: a smaller last block is the end of a
        window of that size, a smaller whole dimension is zero-padded.  CPU BLAS takes other kernels for
        products of fewer, where an entry rounds with its position (equal weight rows gave unequal
        logits, and a rank tie fell either side); with at least 16 of each, every entry rounded as in
        one full logits matmul (float32 on MKL: random sub-products, K = 32 to 4096, bit-equal; float64
        sub-products differ from the full product at any size, so float64 ties are not exact)."""
        a0, b0 = max(0, min(n0, n1 - MIN_GEMM_SIZE)), max(0, min(v0, v1 - MIN_GEMM_SIZE))
        xc = self.hidden_chunk(a0, n1)
        wc = wc if b0 == v0 else self.weight_chunk(b0, v1)
        lr = self.low_rank_chunk(a0, n1, b0, v1)
        if n1 - a0 < MIN_GEMM_SIZE:
            xc = self._padded("x_pad", xc, 1)
            lr = (self._padded("u_pad", lr[0], 1), lr[1]) if lr is not None else None
        if v1 - b0 < MIN_GEMM_SIZE:
            wc = self._padded("w_pad", wc, 2)
            lr = (lr[0], self._padded("b_pad", lr[1][None], 2)[0]) if lr is not None else None
        y = torch.matmul(xc, wc, out=self.scratch("y", self.h, xc.shape[1], wc.shape[2]))
        if lr is not None:
            y.baddbmm_(lr[0], lr[1].expand(self.h, *lr[1].shape))
        y = y[:, n0 - a0:n1 - a0, v0 - b0:v1 - b0]
        if self.bias is not None:
            y += self.bias[v0:v1].to(self.cdt)
        if softcap and self.softcap is not None:
            y.div_(self.softcap).tanh_().mul_(self.softcap)
        return y

    def logits_and_slope(self, n0, n1, v0, v1, wc):
        """(y, dy/dz) for a backward: the logits block as ``logits`` rounds it and, with a softcap, its
        derivative 1 - tanh(z / c)^2 as cosh(z / c)^-2, which does not cancel where |tanh| -> 1 (from a
        rounded tanh: 1e-7 / (1 - |tanh|) relative error); in two scratch buffers, None without a softcap."""
        if self.softcap is None:
            return self.logits(n0, n1, v0, v1, wc), None
        u = self.logits(n0, n1, v0, v1, wc, softcap=False).div_(self.softcap)
        y = torch.tanh(u, out=self.scratch("capped", *u.shape)).mul_(self.softcap)
        return y, u.cosh_().square_().reciprocal_()  # cosh overflows to inf past |u| ~ 89: slope 0

    def _padded(self, name, t, dim):
        """``t`` (3-D) with zeros after it along ``dim`` up to MIN_GEMM_SIZE."""
        shape = list(t.shape)
        shape[dim] = MIN_GEMM_SIZE
        out = self.scratch(name, *shape).zero_()
        out.narrow(dim, 0, t.shape[dim]).copy_(t)
        return out


class SweepStats(NamedTuple):
    """Per-token statistics of a forward sweep; [N, H] in compute dtype, ranks [N] int64.

    The logsumexp is kept as its two parts, ``top`` = max_j y_j and ``log_sum`` = log sum_j exp(y_j - top):
    one rounded float32 lse would put half an ulp of |lse| into every log-probability (see ``mixture``).
    ``log_sum`` is log1p of the sum without the maximum's 1 (``_lse_sweep``): exact to float32's precision
    for a confident token however many blocks the vocabulary takes."""

    top: torch.Tensor
    log_sum: torch.Tensor
    target: torch.Tensor
    logit_sum: torch.Tensor | None
    ranks: torch.Tensor | None

    @property
    def lse(self) -> torch.Tensor:
        """logsumexp_j y_j [N, H], rounded once (the z-loss, smoothing and mixture-rank terms)."""
        return self.top + self.log_sum

    @property
    def log_p_target(self) -> torch.Tensor:
        """log p_h(t) [N, H] = (target - top) - log_sum: exact where the target is the maximum."""
        return (self.target - self.top) - self.log_sum

    def rows(self, n0: int, n1: int) -> SweepStats:
        """The statistics of tokens n0:n1."""
        return SweepStats(*(t[n0:n1] if t is not None else None for t in self))


def forward_stats(x, w, bias, labels, num_heads, softcap, need_logit_sum, need_ranks=False, low_rank=None):
    """Per-head logsumexp, target logit, optional logit sum and optional target ranks.

    ``labels`` [N] int64, -1 for ignored tokens (their target is 0, their statistics unused).
    The target logits are read off the sweep's own logits blocks, so that they are the very values
    the ranks compare against: a logit computed by a separate matmul rounds with its shape (CPU BLAS
    takes other kernels for a few rows), and a weight row equal to the target's then fell either side
    of it.  Ranks therefore take a second sweep, once the targets are known: entries j != t with
    y_j > y_t for one head, log pbar_j > log pbar_t under the mixture (compared in float32).  Entries
    whose logits equal the target's exactly (a duplicated weight row, float32: see ``logits``) rank
    below it.
    """
    pb = _Problem(x, w, bias, num_heads, softcap, low_rank)
    top, log_sum, target, logit_sum = _lse_sweep(pb, need_logit_sum, labels)
    ranks = _rank_sweep(pb, top + log_sum, target, labels) if need_ranks else None
    return SweepStats(top, log_sum, target, logit_sum, ranks)


def _columns_in(labels, v0, v1):
    """(rows, columns within v0:v1) of the labels that fall in the vocabulary block v0:v1."""
    t = labels - v0
    hit = ((t >= 0) & (t < v1 - v0)).nonzero().squeeze(1)
    return hit, t[hit]


def _count_above(pb, values, reference, labels, v0):
    """Per row, entries of ``values`` [rows, cols] strictly above ``reference`` [rows], target excluded."""
    above = torch.gt(values, reference[:, None], out=pb.scratch("above", *values.shape, dtype=torch.bool))
    hit, cols = _columns_in(labels, v0, v0 + values.shape[1])
    above[hit, cols] = False
    return above.sum(-1)


def _lse_sweep(pb: _Problem, need_logit_sum: bool, labels=None):
    """[N, H] maxima m and log sum exp(y - m) (their sum is the logsumexp, kept apart for accuracy: see
    ``mixture``), target logits (given ``labels``; read off the blocks) and optional logit sums.

    The sum is kept as rest = sum exp(y - m) - 1, without the maximum's own 1 (log sum = log1p(rest)):
    a running sum holding that 1 rounds each later block's share of 1 - p_t to an ulp of 1, all of a
    confident token's loss at a large vocabulary (NOTES change 13).  rest starts at -1 (an empty sum)."""
    shape = (pb.h, pb.n)
    dev = pb.x.device
    m = torch.full(shape, -math.inf, dtype=pb.cdt, device=dev)
    rest = torch.full(shape, -1.0, dtype=pb.cdt, device=dev)
    ysum = torch.zeros(shape, dtype=pb.cdt, device=dev) if need_logit_sum else None
    target = torch.zeros(pb.n, pb.h, dtype=pb.cdt, device=dev) if labels is not None else None
    for v0, v1 in _blocks(pb.v, pb.cols):
        wc = pb.weight_chunk(v0, v1)
        for n0, n1 in _blocks(pb.n, pb.rows):
            y = pb.logits(n0, n1, v0, v1, wc)
            if target is not None:  # before the in-place exp below
                hit, cols = _columns_in(labels[n0:n1], v0, v1)
                target[n0 + hit] = y[:, hit, cols].T
            if ysum is not None:
                ysum[:, n0:n1] += y.sum(-1)
            rest[:, n0:n1], m[:, n0:n1] = _add_block(pb, y, m[:, n0:n1], rest[:, n0:n1])
    log_sum = rest.log1p_()
    return m.T.contiguous(), log_sum.T.contiguous(), target, (ysum.T.contiguous() if ysum is not None else None)


def _add_block(pb, y, m, rest):
    """(rest, m) [H, rows] after the logits block y [H, rows, cols] (overwritten with -exp(y - m_new) below
    the maximum, 0 at it).

    Where the block holds a new maximum, one entry equal to it becomes the implicit 1 and the old sum,
    1 + rest, is rescaled; every other entry (further ties included) adds to rest.  The entries at the
    maximum are told by sign(y - m_new) = 0, in float ops (an argmax or a comparison into bools ran
    at a tenth of an exp's speed on the CPU)."""
    block_max = y.amax(dim=-1)
    m_new = torch.maximum(m, block_max)
    base = _finite_base(m_new)
    d = y.sub_(base[..., None])
    below_max = torch.sign(d, out=pb.scratch("sign", *d.shape))  # -1, 0 at the maximum (NaN: 0, see below)
    ties = below_max.sum(-1).add_(d.shape[-1])  # entries at the maximum (exact: at most 4096)
    below = d.exp_().mul_(below_max).sum(-1).neg_()  # a NaN entry keeps NaN: NaN * 0
    scale = torch.exp(m - base)  # 0 while m = -inf (rest is -1 then: an empty sum)
    carried = torch.where(block_max > m, scale + rest * scale + (ties - 1), rest + ties)
    return carried + below, m_new


def head_logprobs(y, top, log_sum, n0, n1, out=None):
    """log p_h = (y - top) - log_sum [H, rows, cols] of the logits block of tokens n0:n1 (in place unless
    ``out``); top, log_sum [N, H] as in ``SweepStats``."""
    out = torch.sub(y, top.T[:, n0:n1, None], out=out) if out is not None else y.sub_(top.T[:, n0:n1, None])
    return out.sub_(log_sum.T[:, n0:n1, None])


def _finite_base(m):
    """The running maximum ``m`` as the base to subtract before exp, with -inf (every entry so far
    masked, e.g. by a -inf bias) replaced by 0: exp(-inf - -inf) would be NaN, exp(-inf - 0) is 0."""
    return torch.where(m == -math.inf, 0.0, m)


def _logsumexp_heads(t, pb=None):
    """logsumexp over dim 0 written out, so that the target and the blocks round identically
    (overwrites ``t``; given ``pb``, the result lives in its scratch buffers)."""
    shape = t.shape[1:]
    m = t.amax(dim=0) if pb is None else torch.amax(t, 0, out=pb.scratch("max", *shape))
    # An entry -inf in every head (a -inf bias) has m = -inf: the lowest finite value instead, in
    # place (a block-sized temporary otherwise), keeps exp(t - m) at 0 rather than NaN; finite m unchanged.
    m.clamp_min_(torch.finfo(m.dtype).min)
    e = t.sub_(m).exp_()
    s = e.sum(dim=0) if pb is None else torch.sum(e, 0, out=pb.scratch("sum", *shape))
    return s.log_().add_(m)


def _rank_sweep(pb: _Problem, lse, target, labels):
    """Entries j != t above the target (float32), on the same blocks as the targets were read from: of the
    logits for one head, of the mixture's log-probabilities log pbar for several."""
    lse_t = lse.T  # [H, N]
    # one head: the logits themselves; several: log(H * pbar_t) [N], a new tensor (overwritten)
    reference = target[:, 0] if pb.h == 1 else _logsumexp_heads(target.T - lse_t)
    ranks = torch.zeros(pb.n, dtype=torch.int64, device=pb.x.device)
    for v0, v1 in _blocks(pb.v, pb.cols):
        wc = pb.weight_chunk(v0, v1)
        for n0, n1 in _blocks(pb.n, pb.rows):
            y = pb.logits(n0, n1, v0, v1, wc)
            values = y[0] if pb.h == 1 else _logsumexp_heads(y.sub_(lse_t[:, n0:n1, None]), pb)
            ranks[n0:n1] += _count_above(pb, values, reference[n0:n1], labels[n0:n1], v0)
    return ranks


class _Grads:
    """Accumulators of (dX, dW, dB[, dU, dB_low]) over blocks of dz [H, rows, cols], in compute dtype.

    dW is accumulated per vocabulary chunk and written once (no low-precision sum across chunks);
    ``needs`` has three flags, five with a low-rank term (its U and B last)."""

    def __init__(self, pb: _Problem, needs):
        self.pb = pb
        dev, cdt = pb.x.device, pb.cdt
        self.need_dx, self.need_dw, self.need_db = needs[:3]
        self.need_du, self.need_dlb = needs[3:] if pb.u is not None else (False, False)
        # [N, H, Dh], hidden's layout: for hidden in the compute dtype this buffer is dX itself (no
        # [H, N, Dh] -> [N, D] copy); the blocks add into its per-head view.
        self.dx = torch.zeros(pb.n, pb.h, pb.dh, dtype=cdt, device=dev) if self.need_dx else None
        self.dw = torch.empty_like(pb.w) if self.need_dw else None
        self.db = torch.zeros(pb.v, dtype=cdt, device=dev) if self.need_db else None
        self.du = torch.zeros(pb.u.shape, dtype=cdt, device=dev) if self.need_du else None  # [N, H, R]
        self.dlb = torch.zeros(pb.b.shape, dtype=cdt, device=dev) if self.need_dlb else None  # [V, R]

    def start_chunk(self, v0, v1):
        self.v0, self.v1 = v0, v1
        if self.need_dw:
            self.dwc = self.pb.scratch("dw", self.pb.h, v1 - v0, self.pb.dh).zero_()

    def add(self, dz, xc, wc, lr, n0, n1):
        v0, v1 = self.v0, self.v1
        pb = self.pb
        if self.need_dx:  # products into scratch, then added: baddbmm_ would round worse on CPU
            prod = torch.matmul(dz, wc.transpose(1, 2), out=pb.scratch("dx", pb.h, n1 - n0, pb.dh))
            self.dx[n0:n1].transpose(0, 1).add_(prod)
        if self.need_dw:
            self.dwc += torch.matmul(dz.transpose(1, 2), xc, out=pb.scratch("dwt", pb.h, v1 - v0, pb.dh))
        if self.need_db:
            self.db[v0:v1] += dz.sum(dim=(0, 1))
        if self.need_du:  # [H, rows, cols] @ [cols, R]
            self.du[n0:n1] += torch.matmul(dz, lr[1].T).transpose(0, 1)
        if self.need_dlb:  # B is shared by the heads: sum of [cols, rows] @ [rows, R] over heads
            self.dlb[v0:v1] += torch.matmul(dz.transpose(1, 2), lr[0]).sum(0)

    def end_chunk(self):
        if self.need_dw:
            self.dw[self.v0:self.v1].view(-1, self.pb.h, self.pb.dh).copy_(self.dwc.transpose(0, 1))

    def result(self):
        pb = self.pb
        dx = self.dx.view(pb.n, pb.d).to(pb.x.dtype) if self.need_dx else None
        db = self.db.to(pb.bias.dtype) if self.need_db else None
        if pb.u is None:
            return dx, self.dw, db
        return (dx, self.dw, db, self.du.to(pb.u.dtype) if self.need_du else None,
                self.dlb.to(pb.b.dtype) if self.need_dlb else None)


def backward(x, w, bias, labels, top, log_sum, alpha, target_grad, gamma, num_heads, softcap, needs, low_rank=None):
    """Gradients (dX, dW, dB[, dU, dB_low]) of sum_n loss_n given ``mixture.grad_coefficients`` and the
    forward's ``SweepStats.top`` and ``log_sum``.

    dy[n, h, j] = alpha[n, h] * p[n, h, j] - gamma[n] for j != t_n, target_grad[n, h] - gamma[n] at
    j = t_n (p_t from the forward's log p_t, as ``mixture`` explains), with p = exp((y - top) - log_sum),
    not exp(y - lse): a rounded lse would scale every p by one common error; ``needs`` says
    which gradients to produce (None in place of the others): three flags, five with ``low_rank``
    (its U and B last).  labels: -1 marks ignored tokens.
    """
    pb = _Problem(x, w, bias, num_heads, softcap, low_rank)
    valid = labels >= 0
    grads = _Grads(pb, needs)
    alpha_t, target_grad_t = alpha.T, target_grad.T  # [H, N]
    any_invalid = not bool(valid.all())
    for v0, v1 in _blocks(pb.v, pb.cols):
        wc = pb.weight_chunk(v0, v1)  # [H, Dh, cols]
        grads.start_chunk(v0, v1)
        for n0, n1 in _blocks(pb.n, pb.rows):
            xc = pb.hidden_chunk(n0, n1)
            lr = pb.low_rank_chunk(n0, n1, v0, v1)
            y, slope = pb.logits_and_slope(n0, n1, v0, v1, wc)
            dz = head_logprobs(y, top, log_sum, n0, n1)  # log p, in y's buffer
            dz.exp_().mul_(alpha_t[:, n0:n1, None])
            dz -= gamma[None, n0:n1, None]
            hit, cols = _columns_in(labels[n0:n1], v0, v1)  # tokens whose target is in this chunk
            if hit.numel():
                dz[:, hit, cols] = target_grad_t[:, n0:n1][:, hit] - gamma[n0:n1][hit]
            if slope is not None:
                dz *= slope
            if any_invalid:  # ignored tokens (padding) contribute nothing, even with a NaN/inf hidden row,
                # whose 0 * NaN would otherwise make dW NaN (as in eager torch) in one backend only
                ignored = ~valid[None, n0:n1, None]
                dz.masked_fill_(ignored, 0.0)
                if grads.need_dw:
                    xc = xc.masked_fill(ignored, 0.0)
                if grads.need_dlb:
                    lr = (lr[0].masked_fill(ignored, 0.0), lr[1])
            grads.add(dz, xc, wc, lr, n0, n1)
        grads.end_chunk()
    return grads.result()
