"""Prototypes of the two other designs for the fused CE backward, measured beside our Triton kernels by
peers.py (issue P6).  Not part of the package: which design hf_mhce ships follows these numbers.

Our first Triton backward (replaced by the slab backward of hf_mhce/ops/triton_backward.py, which came
out of these measurements) reduced dX and dW across tiles with float32 atomics: per BLOCK_N x BLOCK_V tile
it added 4 * D * (BLOCK_N + BLOCK_V) bytes for 6 * BLOCK_N * BLOCK_V * D FLOPs, i.e. at 64 x 128 tiles
64 FLOP per atomic byte: an H100 at 750 TFLOP/s would need ~12 TB/s of L2 atomics.  The designs here
have no atomics: cuBLAS matmuls on a materialised slab of the logits, in float32, bounded by
``slab_mb`` (one slab of logits + its bf16 gradient at a time).

  slab_vocab    forward: logsumexp over vocabulary slices; backward: per slice, recompute the logits
                [N, c], form dY (bf16), dW[slice] = dY^T X in one matmul (float32 accumulation, one
                rounding, as eager), dX += dY W[slice] into a float32 dX.  8NDV FLOPs (forward
                recomputed), extra memory dX32 + slab.
  slab_fwdgrad  Liger's order with float32 dW: per token chunk, logits over the whole vocabulary, lse,
                dY, dX[chunk] = dY W, dW32 += dY^T X[chunk]; the backward only scales.  6NDV FLOPs,
                extra memory dW32 (2 x the bf16 dW) + slab.
CE only (one head, no bias, mean over valid tokens, labels -100 ignored).
"""

from __future__ import annotations

import torch


def _mm32(a, b):
    """a @ b with float32 output from 16-bit operands (cuBLAS accumulates in float32 either way)."""
    if a.is_cuda and a.dtype != torch.float32:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # torch without mm(out_dtype=)
            pass
    return (a @ b).float()


def _slice_cols(n, budget_bytes, v, align=256):
    cols = max(align, budget_bytes // (6 * max(n, 1)) // align * align)  # fp32 logits + bf16 dY
    return min(cols, v)


def _dy(z, lse, scale, t, v0):
    """Gradient of scale * (lse - z_t) w.r.t. the slab z (in place, float32)."""
    z.sub_(lse[:, None]).exp_().mul_(scale[:, None])
    rows = ((t >= v0) & (t < v0 + z.shape[1])).nonzero().squeeze(1)
    z[rows, t[rows] - v0] -= scale[rows]
    return z


class SlabVocab(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, labels, slab_mb):
        n, v = x.shape[0], w.shape[0]
        cols = _slice_cols(n, int(slab_mb * 2**20), v)
        valid = labels != -100
        t = torch.where(valid, labels, 0)
        lse = torch.full((n,), float("-inf"), device=x.device)
        for v0 in range(0, v, cols):
            lse = torch.logaddexp(lse, torch.logsumexp(_mm32(x, w[v0:v0 + cols].T), dim=1))
        target = torch.einsum("nd,nd->n", x.float(), w[t].float())
        count = valid.sum().clamp_min(1)
        ctx.save_for_backward(x, w, t, valid, lse, count)
        ctx.cols = cols
        return ((lse - target) * valid).sum() / count

    @staticmethod
    def backward(ctx, grad):
        x, w, t, valid, lse, count = ctx.saved_tensors
        scale = valid * (grad / count)
        dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        dw = torch.empty_like(w)
        for v0 in range(0, w.shape[0], ctx.cols):
            wc = w[v0:v0 + ctx.cols]
            dy = _dy(_mm32(x, wc.T), lse, scale, t, v0).to(x.dtype)
            dw[v0:v0 + ctx.cols] = dy.T @ x
            dx += _mm32(dy, wc)
        return dx.to(x.dtype), dw, None, None


class SlabFwdGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, labels, slab_mb):
        n, v = x.shape[0], w.shape[0]
        rows = max(1, int(slab_mb * 2**20) // (6 * v))
        valid = labels != -100
        t = torch.where(valid, labels, 0)
        count = valid.sum().clamp_min(1)
        scale = valid / count
        dx = torch.empty_like(x)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        total = torch.zeros((), device=x.device)
        for n0 in range(0, n, rows):
            xc = x[n0:n0 + rows]
            z = _mm32(xc, w.T)
            lse = torch.logsumexp(z, dim=1)
            zt = z.gather(1, t[n0:n0 + rows, None]).squeeze(1)
            total += ((lse - zt) * valid[n0:n0 + rows]).sum()
            dy = _dy(z, lse, scale[n0:n0 + rows], t[n0:n0 + rows], 0).to(x.dtype)
            dx[n0:n0 + rows] = dy @ w
            dw += _mm32(dy.T, xc)
        ctx.save_for_backward(dx, dw)
        ctx.w_dtype = w.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad):
        dx, dw = ctx.saved_tensors
        # in place: a second float32 dW would count against this design's memory (no retain_graph here)
        return dx * grad.to(dx.dtype), dw.mul_(grad).to(ctx.w_dtype), None, None


def slab_vocab(x, w, labels, slab_mb=512.0):
    return SlabVocab.apply(x, w, labels, slab_mb)


def slab_fwdgrad(x, w, labels, slab_mb=512.0):
    return SlabFwdGrad.apply(x, w, labels, slab_mb)


if __name__ == "__main__":  # self-check on CPU against float64 autograd: odd sizes, slices that do not divide V
    g = torch.Generator().manual_seed(0)
    n, d, v = 37, 24, 1031
    x0, w0 = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g) / d ** 0.5
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = -100
    xr, wr = x0.double().requires_grad_(), w0.double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(xr @ wr.T, labels, ignore_index=-100)
    ref.backward()
    for fn in (slab_vocab, slab_fwdgrad):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = fn(x, w, labels, slab_mb=0.05)
        (2.0 * loss).backward()
        for name, a, b in (("loss", loss, ref), ("dx", x.grad / 2, xr.grad), ("dw", w.grad / 2, wr.grad)):
            err = float((a.detach().double() - b.detach()).norm() / b.detach().norm())
            assert err < 1e-5, (fn.__name__, name, err)
        print(f"{fn.__name__}: loss, dX, dW match float64 (slab {0.05} MB)")
