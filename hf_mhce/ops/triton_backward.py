"""Triton backward: slabs of the logits' gradient dY written by a kernel, reduced by matmuls.

The kernel recomputes a [tokens x vocabulary] range of each head's logits tile by tile (the forward's
``logits_tile``), forms dY = alpha * softmax - gamma, target_grad - gamma at the target (see
``mixture.grad_coefficients``) times the softcap derivative, and stores it in the input dtype (the
rounding autograd gives dlogits in a 16-bit model) into a slab [H, tokens, columns].  dX = dY W and
dW = dY^T X are then torch matmuls on the slab (cuBLAS on a GPU, float32 accumulation inside):
no atomics.  The first GPU run measured the earlier design, which added every tile's dX and dW into
float32 buffers with atomics, at 14.6x the matmul floor, bound by the atomics (benchmarks/NOTES.md).

A gradient summed over one slab's whole span is written once, in its dtype (dW over all tokens, or
dX over the whole vocabulary, rounded once as eager rounds it); one summed over several slabs adds
into a float32 accumulator.  ``HF_MHCE_WORKSPACE_MB`` (default 512) bounds slabs, accumulators and
temporaries together:
- fused (dX and dW, 16-bit, when a float32 dX fits): slabs over all tokens by vocabulary range, dW
  of each range written directly, dX added into a float32 dX: 8NDV FLOPs with the forward;
- otherwise a dW pass by vocabulary range and a dX pass by token range (one more recompute, 10NDV,
  in exchange for memory), each skipped when its gradient is not needed;
- float32 inputs: one pass, the outputs are the accumulators.
dB: each tile writes its float32 column sums of dY (before rounding) into a [H x token blocks, columns]
buffer, reduced by torch in a fixed order, so that dB is bitwise reproducible and as precise as before:
float32 atomics made its rounding depend on the order the tiles ran in, and the column sums of the
rounded slab were about 2x less accurate in bf16 (at eager's level).  The low-rank gradients (LoRA on
the head) dU = dY B and dB_low = dY^T U are matmuls on the slabs of the first pass, in float32 buffers.
Outside the bound: a copy of X (and U) with the ignored rows zeroed, made only when one of those rows
is not finite (a fully masked attention row), so that 0 * NaN does not reach dW.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .budget import workspace_bytes
from .triton_tile import dot_settings, launch_config, logits_tile, low_rank_args, softcap_and_slope


@triton.jit
def _dlogits_kernel(
    X, W, B, U, LB, Labels, Top, LogSum, Alpha, TargetGrad, Gamma, DY, DB,
    n_start, n_end, v_start, v_end, Dh, R, stride_x, stride_w, stride_u, stride_lb, stride_dy_head, stride_dy,
    softcap,
    NUM_HEADS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_LOW_RANK: tl.constexpr,
    NEED_DB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    DOT_IN_ORDER: tl.constexpr, PRECISION: tl.constexpr,
):
    head = tl.program_id(1).to(tl.int64)
    # Grouped order: GROUP_N token blocks sweep the vocabulary blocks together, so that the programs
    # running at once read a few X rows and W rows (L2).  int64: GROUP_N x vocabulary blocks may pass 2^31.
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
    dy = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    # Tiles of ignored tokens only (padding) skip their matmul; their slab entries are still written (0).
    if tl.sum(row_valid.to(tl.int32), axis=0) > 0:
        col0 = head * Dh
        y = logits_tile(X, W, B, U, LB, rows, cols, row_mask, col_mask, col0, Dh, head * R, R,
                        stride_x, stride_w, stride_u, stride_lb, softcap,
                        HAS_BIAS, False, HAS_LOW_RANK, BLOCK_N, BLOCK_V, BLOCK_K, DOT_IN_ORDER, PRECISION)
        if HAS_SOFTCAP:
            y, slope = softcap_and_slope(y, softcap)
        stat = rows * NUM_HEADS + head
        top = tl.load(Top + stat, mask=row_valid, other=0.0)
        log_sum = tl.load(LogSum + stat, mask=row_valid, other=0.0)
        alpha = tl.load(Alpha + stat, mask=row_valid, other=0.0)
        target_grad = tl.load(TargetGrad + stat, mask=row_valid, other=0.0)
        gamma = tl.load(Gamma + rows, mask=row_valid, other=0.0)
        # p from the logsumexp's two parts, the target's entry from the forward's log p_t (mixture.py)
        p = tl.exp((y - top[:, None]) - log_sum[:, None])
        dy = tl.where(cols[None, :] == labels[:, None], target_grad[:, None], alpha[:, None] * p)
        dy -= gamma[:, None]
        if HAS_SOFTCAP:
            dy *= slope
        # Ignored rows (padding) contribute nothing, even with NaN logits (their hidden rows are zeroed
        # for dW by the host when they are not finite: 0 * NaN would be NaN).
        dy = tl.where(row_valid[:, None] & col_mask[None, :], dy, 0.0)
    if NEED_DB:  # this tile's float32 column sums, in its own row of the partials (zeros for a padding tile)
        part = DB + (head * n_blocks + pid_n) * (v_end - v_start) + (cols - v_start)
        tl.store(part, tl.sum(dy, axis=0), mask=col_mask)
    out = DY + head * stride_dy_head + (rows - n_start)[:, None] * stride_dy + (cols - v_start)[None, :]
    tl.store(out, dy.to(DY.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def backward(x, w, bias, labels, top, log_sum, alpha, target_grad, gamma, num_heads, softcap, needs, low_rank=None):
    """Triton counterpart of ``torch_sweep.backward`` (labels: -1 marks ignored tokens)."""
    n, d = x.shape
    v = w.shape[0]
    need_dx, need_dw, need_db = needs[:3]
    need_du, need_dlb = needs[3:] if low_rank is not None else (False, False)
    f32 = {"dtype": torch.float32, "device": x.device}
    slabs = _Slabs(x, w, bias, labels, (top, log_sum), alpha, target_grad, gamma, num_heads, softcap, low_rank,
                   db=torch.zeros(v, **f32) if need_db else None,
                   du=torch.zeros(low_rank[0].shape, **f32) if need_du else None,
                   dlb=torch.zeros(low_rank[1].shape, **f32) if need_dlb else None, sanitize=need_dw or need_dlb)
    budget = workspace_bytes()
    if x.dtype == torch.float32:  # the outputs are float32 already: they are the accumulators
        dx = torch.zeros_like(x) if need_dx else None
        dw = torch.zeros_like(w) if need_dw else None
        _reduction_pass(slabs, dw, "vocab", budget, True, dx_acc=dx)
        return slabs.outputs(dx, dw)
    dx = torch.empty_like(x) if need_dx else None
    dw = torch.empty_like(w) if need_dw else None
    dx_bytes = n * d * 4
    if need_dx and need_dw and n * slabs.cfg["BLOCK_V"] * slabs.entry_bytes <= slabs.slab_share(budget - dx_bytes):
        dx32 = torch.zeros(n, d, **f32)
        _reduction_pass(slabs, dw, "vocab", budget - dx_bytes, True, dx_acc=dx32)
        dx.copy_(dx32)
        return slabs.outputs(dx, dw)
    side = True  # dB, dU, dB_low cover all tokens and all of V: they go with the first pass, whichever
    if need_dw or not need_dx:
        _reduction_pass(slabs, dw, "vocab", budget, side)
        side = False
    if need_dx:
        _reduction_pass(slabs, dx, "tokens", budget, side)
    return slabs.outputs(dx, dw)


def _fit(total: int, block: int, unit_bytes: int, budget: int) -> int:
    """The largest multiple of ``block`` (at least one block) of units of ``unit_bytes`` within ``budget``,
    at most ``total``."""
    return min(total, max(block, budget // max(unit_bytes, 1) // block * block))


def _aligned(columns: int) -> int:
    """Row stride of a slab of ``columns`` vocabulary entries: a multiple of 8 (16 bytes), which cuBLAS
    needs for its fast kernels (GPT-2's V = 50257 would misalign every row)."""
    return -(-columns // 8) * 8


def _reduction_pass(slabs, out, rows_axis, budget, side, dx_acc=None):
    """``out`` = dW (rows_axis "vocab": rows are vocabulary entries, summed over tokens) or dX ("tokens"),
    or None (side gradients only), from slabs within ``budget``.  ``dx_acc`` (vocab only): a float32
    [N, D] into which the same slabs' dX products are added (the fused pass).

    A slab spanning the whole sum gives ``out`` rows directly; otherwise each range of rows is summed in
    a float32 accumulator (at most ``budget`` / 2), or in ``out`` itself when it is float32.  Slabs and
    the matmuls' temporaries share the rest (``_Slabs.slab_share``).
    """
    slabs.buffer = None  # an earlier pass's slab is not kept beside this pass's
    n, v, d, entry = slabs.n, slabs.v, slabs.d, slabs.entry_bytes
    vocab_rows = rows_axis == "vocab"
    bn, bv = slabs.cfg["BLOCK_N"], slabs.cfg["BLOCK_V"]
    total_rows, block_rows, total_sum, block_sum = (v, bv, n, bn) if vocab_rows else (n, bn, v, bv)
    if total_rows == 0 or total_sum == 0:  # no tokens: zero gradients
        if out is not None:
            out.zero_()
        return

    def fit(total, block, unit_bytes, room, vocab):  # vocabulary extents count with their aligned stride
        return min(total, _fit(_aligned(total) if vocab else total, block, unit_bytes, room))

    whole = (total_sum if vocab_rows else _aligned(total_sum)) * entry  # slab bytes of one row over the whole sum
    if block_rows * whole <= slabs.slab_share(budget):
        room, span = budget, total_sum
        rows = fit(total_rows, block_rows, whole, slabs.slab_share(room), vocab_rows)
    else:
        room = budget // 2  # the other half: a float32 accumulator of ``rows`` rows
        acc_row = 0 if out is None or out.dtype == torch.float32 else 4 * d
        rows = min(fit(total_rows, block_rows, acc_row, room, vocab_rows),
                   fit(total_rows, block_rows, block_sum * entry, slabs.slab_share(room), vocab_rows))
        span = fit(total_sum, block_sum, (_aligned(rows) if vocab_rows else rows) * entry, slabs.slab_share(room),
                   not vocab_rows)
    temp = room - slabs.slab_share(room)
    accumulate = span < total_sum
    acc = None
    if out is not None and accumulate and out.dtype != torch.float32:
        acc = torch.zeros(rows, d, dtype=torch.float32, device=out.device)
    for r0 in range(0, total_rows, rows):
        r1 = min(total_rows, r0 + rows)
        target = None if out is None else (acc[: r1 - r0] if acc is not None else out[r0:r1])
        if acc is not None:
            target.zero_()
        for s0 in range(0, total_sum, span):
            s1 = min(total_sum, s0 + span)
            n_range, v_range = ((s0, s1), (r0, r1)) if vocab_rows else ((r0, r1), (s0, s1))
            slab = slabs.compute(n_range, v_range, with_db=side)
            if target is not None:
                slabs.product(rows_axis, slab, n_range, v_range, target, accumulate, temp)
            if dx_acc is not None:
                slabs.product("tokens", slab, n_range, v_range, dx_acc[n_range[0]:n_range[1]], True, temp)
            if side:
                slabs.side_products(slab, n_range, v_range, temp)
        if acc is not None:
            out[r0:r1] = target


class _Slabs:
    """Computes dY slabs [H, tokens, columns] (one buffer, reused) and their matmuls into the gradients."""

    def __init__(self, x, w, bias, labels, head_stats, alpha, target_grad, gamma, num_heads, softcap, low_rank, db, du, dlb,
                 sanitize):
        self.x, self.w, self.bias, self.low_rank = x, w, bias, low_rank
        self.n, self.d = x.shape
        self.v, self.h, self.dh = w.shape[0], num_heads, x.shape[1] // num_heads
        self.cfg = launch_config("backward", x.dtype, x.device)
        self.entry_bytes = num_heads * x.element_size()  # one (token, column) entry of a slab, all heads
        self.db, self.du, self.dlb = db, du, dlb
        top, log_sum = head_stats
        u, lb, self.rank, self.stride_u, self.stride_lb = low_rank_args(low_rank, top)
        self.args = (x, w, bias if bias is not None else top, u, lb, labels, top, log_sum, alpha, target_grad, gamma)
        self.softcap = softcap
        self.buffer = None
        # Matmul temporaries: none where every product is written or added in place (float32 inputs; one
        # head with cuBLAS adding into float32), otherwise row chunks within half of what slabs may take.
        mode = accumulation_mode(x)
        self.temporaries = not (x.dtype == torch.float32 or (num_heads == 1 and mode == "addmm"))
        # dW = dY^T X and dB_low = dY^T U take ignored rows' hidden / U rows times 0: zeroed copies where such
        # a row is not finite (0 * NaN = NaN), as the torch backend does; one check, no copy otherwise.
        self.x_for_dw, self.u_for_dlb = x, low_rank[0] if low_rank is not None else None
        if sanitize:
            self.x_for_dw = _zero_ignored_nonfinite(x, labels)
            if low_rank is not None:
                self.u_for_dlb = _zero_ignored_nonfinite(low_rank[0], labels)

    def slab_share(self, room: int) -> int:
        """Bytes of ``room`` that slabs may take; the rest is for the matmuls' temporaries."""
        return room // 2 if self.temporaries else room

    def compute(self, n_range, v_range, with_db):
        """The slab [H, tokens, columns] of tokens ``n_range`` x vocabulary ``v_range``, rows aligned
        (valid until the next call)."""
        (n0, n1), (v0, v1) = n_range, v_range
        m, c, stride = n1 - n0, v1 - v0, _aligned(v1 - v0)
        size = self.h * m * stride
        if self.buffer is None or self.buffer.numel() < size:  # the first slab of a pass is the largest
            self.buffer = None
            self.buffer = torch.empty(size, dtype=self.x.dtype, device=self.x.device)
        slab = self.buffer[:size].view(self.h, m, stride)[:, :, :c]
        cfg = self.cfg
        n_blocks = triton.cdiv(m, cfg["BLOCK_N"])
        need_db = with_db and self.db is not None
        # dB partials [H x token blocks, columns], float32: 2 / BLOCK_N of a 16-bit slab's bytes
        parts = torch.empty(self.h * n_blocks, c, dtype=torch.float32, device=self.x.device) if need_db else slab
        grid = (n_blocks * triton.cdiv(c, cfg["BLOCK_V"]), self.h)
        _dlogits_kernel[grid](
            *self.args, slab, parts, n0, n1, v0, v1, self.dh, self.rank, self.x.stride(0), self.w.stride(0),
            self.stride_u, self.stride_lb, m * stride, stride, float(self.softcap) if self.softcap is not None else 1.0,
            NUM_HEADS=self.h, HAS_BIAS=self.bias is not None, HAS_SOFTCAP=self.softcap is not None,
            HAS_LOW_RANK=self.low_rank is not None, NEED_DB=need_db,
            **cfg, **dot_settings(self.x.dtype),
        )
        if need_db:
            self.db[v0:v1] += parts.sum(0)
        return slab

    def product(self, rows_axis, slab, n_range, v_range, out, accumulate, temp_bytes):
        """Per head: dW rows (``rows_axis`` "vocab") = dY^T X, or dX rows ("tokens") = dY W, into ``out``."""
        (n0, n1), (v0, v1) = n_range, v_range
        for h in range(self.h):
            cols = slice(h * self.dh, (h + 1) * self.dh)
            if rows_axis == "vocab":
                _matmul_into(out[:, cols], slab[h].T, self.x_for_dw[n0:n1, cols], accumulate, temp_bytes)
            else:
                _matmul_into(out[:, cols], slab[h], self.w[v0:v1, cols], accumulate, temp_bytes)

    def side_products(self, slab, n_range, v_range, temp_bytes):
        """dU [N, H, R] += dY_h B and dB_low [V, R] += sum_h dY_h^T U_h (float32 buffers)."""
        (n0, n1), (v0, v1) = n_range, v_range
        for h in range(self.h):
            if self.du is not None:
                _matmul_into(self.du[n0:n1, h], slab[h], self.low_rank[1][v0:v1], True, temp_bytes)
            if self.dlb is not None:
                _matmul_into(self.dlb[v0:v1], slab[h].T, self.u_for_dlb[n0:n1, h], True, temp_bytes)

    def outputs(self, dx, dw):
        db = self.db.to(self.bias.dtype) if self.db is not None else None
        if self.low_rank is None:
            return dx, dw, db
        return (dx, dw, db, self.du.to(self.low_rank[0].dtype) if self.du is not None else None,
                self.dlb.to(self.low_rank[1].dtype) if self.dlb is not None else None)


def _zero_ignored_nonfinite(t, labels):
    """``t`` [N, ...] with the rows of ignored tokens zeroed if one of them is not finite; ``t`` itself
    otherwise (one reduction and one host sync)."""
    rows = t.flatten(1)
    bad_ignored = ~torch.isfinite(torch.linalg.vector_norm(rows, float("inf"), dim=1)) & (labels < 0)
    if not bool(bad_ignored.any()):
        return t
    return t.masked_fill((labels < 0).view(-1, *([1] * (t.dim() - 1))), 0)


def _matmul_into(out, a, b, accumulate, temp_bytes):
    """out = a @ b (rounded once into out's dtype, written in place), or out += a @ b with out float32 and
    the products of 16-bit a, b summed in float32; temporaries of at most about ``temp_bytes`` on a GPU
    whose torch has mm / addmm with out_dtype (the upcast copies of the fallback, CPU included, are
    outside that bound)."""
    if not accumulate:
        torch.mm(a, b, out=out)  # cuBLAS writes a row-strided out (a head's columns) in place
        return
    if a.dtype == out.dtype:
        out.addmm_(a, b)
        return
    mode = accumulation_mode(a)
    if mode == "addmm" and out.is_contiguous():  # cuBLAS adds into out: no temporary, half the traffic
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        return
    # per row of a: the float32 product row, and without mm(out_dtype=) the upcast row of a
    rows = max(1, temp_bytes // (4 * max(out.shape[1], 1) + (0 if mode else 4 * a.shape[1])))
    b32 = None if mode else b.float()  # products of 16-bit values are exact in float32
    for r0 in range(0, a.shape[0], rows):
        part = a[r0:r0 + rows]
        if mode:
            out[r0:r0 + rows].add_(torch.mm(part, b, out_dtype=torch.float32))
        else:  # CPU, or torch before mm(out_dtype=)
            out[r0:r0 + rows].addmm_(part.float(), b32)


_ACCUMULATION: dict = {}  # device -> mode, cached once found (a failed check is tried again)


def accumulation_mode(t: torch.Tensor) -> str:
    """How 16-bit products add into a float32 tensor on ``t``'s device: "addmm" where
    addmm(acc, a, b, out_dtype=float32, out=acc) adds in place (checked on exact small values, since
    an aliased out is not documented) and mm(out_dtype=float32) works, "mm" where only the latter
    does, "" otherwise (CPU, older torch: float32 upcast copies)."""
    if not t.is_cuda:
        return ""
    mode = _ACCUMULATION.get(t.device)
    if mode is None:
        mode = _probe_accumulation(t.device)
        if mode:
            _ACCUMULATION[t.device] = mode
    return mode


def _probe_accumulation(device: torch.device) -> str:
    a = (torch.arange(48 * 40, device=device) % 7 - 3).view(48, 40).to(torch.bfloat16)
    b = (torch.arange(40 * 24, device=device) % 5 - 2).view(40, 24).to(torch.bfloat16)
    product = a.float() @ b.float()  # small integers: exact in any order
    try:
        if not torch.equal(torch.mm(a, b, out_dtype=torch.float32), product):
            return ""
    except (TypeError, RuntimeError, NotImplementedError):
        return ""
    try:
        acc = torch.ones(48, 24, device=device)
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return "addmm" if torch.equal(acc, product + 1.0) else "mm"
    except (TypeError, RuntimeError, NotImplementedError):
        return "mm"
