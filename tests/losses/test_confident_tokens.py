"""Confident tokens (p_t = 1 - 6e-6..4e-5 in every head) at large logits (|z| ~ 80-190), float32 inputs.

A head's logsumexp kept as one float32 number (lse = m + log s) carries an absolute error of up to
half an ulp of |lse| (8e-6 at |lse| = 130), so log p_t = y_t - lse of a confident target -- the whole
loss of the token, and its gradient p_t - 1 -- gets O(1) relative error.  Eager float32 (log_softmax
subtracts the max first) only rounds s = 1 + 1e-5 (one ulp of 1: ~1e-3..1e-2 relative here).  Pinned:
per-token losses (reduction "none"), dX / dW / db of a summed loss (one head, also with label
smoothing / z-loss: the target column's alpha * p_t - beta; H = 2 and 3 mixtures), and
multi_head_logprobs' top entry and its gradient (upstream one-hot at the top entry, or random), on
both backends.  Ground truth: the same formulas in float64 on the same float32 inputs.  Accepted:
RATIO x eager float32's relative error (per token for losses, max abs error / max |ref| for gradients),
or RATIO x a floor of one float32 ulp of 1 in log p_t / p_t (so that a correct op does not fail where
eager's rounding happens to be lucky) plus half an ulp of the largest logit (the logits' own rounding).
"""

import math
import os

import pytest
import torch
import torch.nn.functional as F

import hf_mhce
from reference import HAVE_TRITON

# HF_MHCE_TEST_DEVICE=cuda runs the fused ops on a GPU (benchmarks/device_run.sh tune); references stay on the CPU
DEVICE = torch.device(os.environ.get("HF_MHCE_TEST_DEVICE", "cpu"))
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAVE_TRITON, reason="no triton"))]
F64 = torch.float64
# FLOOR_ABS: one float32 ulp of 1, the resolution of p_t ~ 1 and of a softmax denominator s ~ 1, which eager
# rounds too; the defect is ulp(|lse|) / 2, 32-64x that.  Seeds fixed (the N = 1 cases: not a lucky lse rounding).
RATIO, FLOOR_ABS = 3.0, 2.0 ** -23
# (N, D, V, bias, seed): N = 1 and 7, V = 37 (no block multiple), D odd where the heads allow
CASES = {1: [(1, 5, 37, False, 1), (7, 13, 37, True, 2)],
         2: [(1, 6, 37, True, 3), (7, 18, 37, False, 4)],
         3: [(1, 3, 37, False, 13), (7, 21, 37, True, 6)]}
ALL_CASES = [(h, *c) for h in CASES for c in CASES[h]]


def _confident(n, d, v, heads, bias, seed):
    """float32 (x [n, d], W [v, d], b [v] or None, labels [n]): in every head the target's logit is the top one,
    at |z| 80-150, 10.5-12 above the runner-up and the rest 4-24 further down (p_t = 1 - 6e-6..4e-5).  X_h's rows
    are orthonormal (x8); W_h solves X_h W_h^T = Z_h - b, plus a random part orthogonal to X_h's rows."""
    g = torch.Generator().manual_seed(seed)
    dh = d // heads
    assert dh >= n
    labels = torch.randint(0, v, (n,), generator=g)
    sign = torch.randint(0, 2, (n, heads, 1), generator=g) * 2 - 1
    top = (80 + 70 * torch.rand(n, heads, 1, generator=g, dtype=F64)) * sign
    gap = 10.5 + 1.5 * torch.rand(n, heads, 1, generator=g, dtype=F64)
    z = top - gap - 4 - 20 * torch.rand(n, heads, v, generator=g, dtype=F64) ** 2
    runner = torch.randint(0, v - 1, (n,), generator=g)
    runner = runner + (runner >= labels).long()  # a non-target column exactly `gap` below the target
    z[torch.arange(n), :, runner] = (top - gap)[:, :, 0]
    z[torch.arange(n), :, labels] = top[:, :, 0]
    b = 3 * torch.randn(v, generator=g, dtype=F64) if bias else torch.zeros(v, dtype=F64)
    xs, ws = [], []
    for h in range(heads):
        q, _ = torch.linalg.qr(torch.randn(dh, n, generator=g, dtype=F64))  # [dh, n] orthonormal columns
        rnd = torch.randn(v, dh, generator=g, dtype=F64)
        xs.append(8 * q.T)
        ws.append((z[:, h, :] - b).T @ q.T / 8 + 2 * (rnd - rnd @ q @ q.T))
    x, w = torch.cat(xs, 1), torch.cat(ws, 1)
    return x.float(), w.float(), (b.float() if bias else None), labels


def _on(*tensors):
    """``tensors`` on DEVICE (differentiable copies; None stays None)."""
    return [t.to(DEVICE) if t is not None else None for t in tensors]


def _logits(x, w, b, heads):
    """[N, H, V] head logits, computed eagerly in x's dtype."""
    n, dh = x.shape[0], x.shape[1] // heads
    y = torch.einsum("nhd,vhd->nhv", x.view(n, heads, dh), w.view(-1, heads, dh))
    return y + b if b is not None else y


def _loss(y, labels, label_smoothing=0.0, z_loss=0.0):
    """Per-token loss [N] from head logits (one head: F.cross_entropy; more: log_softmax per head, then mix)."""
    heads = y.shape[1]
    lse = torch.logsumexp(y, -1)  # [N, H]
    if heads == 1:
        loss = F.cross_entropy(y[:, 0], labels, reduction="none", label_smoothing=label_smoothing)
    else:
        nll = -_mix(y).gather(1, labels[:, None])[:, 0]
        loss = (1 - label_smoothing) * nll + label_smoothing * (lse - y.mean(-1)).mean(1)
    return loss + z_loss * (lse ** 2).mean(1)


def _mix(y):
    """log pbar [N, V] of head logits [N, H, V]."""
    return torch.logsumexp(torch.log_softmax(y, -1), 1) - math.log(y.shape[1])


def _grads(fn, tensors, dtype, grad_out=None):
    """(output, grads) of fn on leaf copies of ``tensors`` cast to dtype; backward of (out * grad_out).sum()."""
    leaves = [t.detach().to(dtype).clone().requires_grad_(True) if t is not None else None for t in tensors]
    out = fn(*leaves)
    (out.sum() if grad_out is None else (out * grad_out.to(out.dtype)).sum()).backward()
    return out.detach(), [t.grad if t is not None else None for t in leaves]


def _grad_floors(x, w, b, heads, labels, weight):
    """Absolute error of dX, dW, db that FLOOR_ABS * weight[n] in every head's target column of the logits'
    gradient (p_t ~ 1 rounded) gives, through the matmul: |E| @ |W|, |E|^T @ |X|, sum |E|."""
    e = torch.zeros(x.shape[0], heads, w.shape[0], dtype=F64)
    e[torch.arange(x.shape[0]), :, labels] = FLOOR_ABS * weight.abs()[:, None]
    absolute = (x.abs(), w.abs(), b.abs() if b is not None else None)
    return _grads(lambda x, w, b: (_logits(x, w, b, heads) * e).sum(), absolute, F64)[1]


def _ymax(x, w, b, heads):
    return _logits(x.double(), w.double(), b.double() if b is not None else None, heads).abs().max().item()


def _check(name, ours, eager, ref, ymax, abs_floor=None):  # -> [] or [the failure's line]
    """Relative error of ours <= RATIO x max(eager float32's, floor).  abs_floor None: per-token relative error
    max_n |a_n - r_n| / |r_n|, floor FLOOR_ABS / min_n |r_n|; else max abs err / max |ref|, floor max(abs_floor) /
    max |ref|.  Both floors plus 2**-24 * ymax: half an ulp of the largest logit, relative (the logits' own
    float32 rounding, which the op's blocked matmul need not round as eager's)."""
    ref = ref.double()
    assert ref.abs().max() > 0, f"{name}: zero reference"
    per_token = abs_floor is None

    def err(a):
        e = (a.double() - ref).abs()
        return (e / ref.abs()).max().item() if per_token else (e.max() / ref.abs().max()).item()
    e_ours, e_eager = err(ours), err(eager)
    if per_token:
        rel_floor = FLOOR_ABS / ref.abs().min().item() + 2.0 ** -24 * ymax
    else:
        rel_floor = abs_floor.max().item() / ref.abs().max().item() + 2.0 ** -24 * ymax
    tol = RATIO * max(e_eager, rel_floor)
    line = f"{name}: ours {e_ours:.2e}  eager fp32 {e_eager:.2e}  floor {rel_floor:.1e}  tol {tol:.2e}"
    print(line)
    return [] if e_ours <= tol else [line]


def _assert_confident(ref_loss):
    assert ((ref_loss > 1e-6) & (ref_loss < 1e-3)).all(), ref_loss  # confident, and not so much that loss = 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads,n,d,v,bias,seed", ALL_CASES)
def test_token_loss(backend, heads, n, d, v, bias, seed):
    """reduction="none": each token's loss (~1e-5) to eager float32's relative accuracy."""
    x, w, b, labels = _confident(n, d, v, heads, bias, seed)
    ref = _loss(_logits(x.double(), w.double(), b.double() if b is not None else None, heads), labels)
    _assert_confident(ref)
    ours = hf_mhce.multi_head_cross_entropy(*_on(x, w), _on(labels)[0], heads, bias=_on(b)[0], reduction="none",
                                            backend=backend).cpu()
    eager = _loss(_logits(x, w, b, heads), labels)
    bad = _check(f"loss {backend} H={heads} N={n}", ours, eager, ref, _ymax(x, w, b, heads))
    assert not bad, bad


# Triton: gradients formed in the forward (a sum's default) and recomputed in the backward (HF_MHCE_GRAD_IN_FORWARD=0)
SCHEDULES = [("torch", "1"), *[pytest.param("triton", flag, marks=pytest.mark.skipif(not HAVE_TRITON, reason="no triton"))
                               for flag in ("1", "0")]]


@pytest.mark.parametrize("backend,in_forward", SCHEDULES)
@pytest.mark.parametrize("heads,n,d,v,bias,seed,ls,zl", [
    *[(*c, 0.0, 0.0) for c in ALL_CASES],
    (1, 7, 13, 37, False, 7, 0.1, 0.0), (1, 7, 13, 37, True, 8, 0.0, 1e-4), (1, 1, 5, 37, True, 9, 1e-3, 1e-6),
])
def test_grads_of_summed_loss(backend, in_forward, heads, n, d, v, bias, seed, ls, zl, monkeypatch):
    """dX, dW, db of reduction="sum" over confident tokens only: every entry of p - onehot is ~1e-5 (with
    smoothing / z-loss the target column's alpha * p_t - beta is, alpha != beta)."""
    monkeypatch.setenv("HF_MHCE_GRAD_IN_FORWARD", in_forward)
    x, w, b, labels = _confident(n, d, v, heads, bias, seed)
    kw = dict(label_smoothing=ls, z_loss=zl)
    eager = lambda x, w, b: _loss(_logits(x, w, b, heads), labels, **kw)  # noqa: E731
    _, ref = _grads(eager, (x, w, b), F64)
    _, eag = _grads(eager, (x, w, b), torch.float32)
    _, ours = _grads(lambda x, w, b: hf_mhce.multi_head_cross_entropy(
        *_on(x, w), _on(labels)[0], heads, bias=_on(b)[0], reduction="sum", backend=backend, **kw).cpu(),
        (x, w, b), torch.float32)
    floors, ymax = _grad_floors(x, w, b, heads, labels, torch.ones(n, dtype=F64)), _ymax(x, w, b, heads)
    bad = [m for name, o, e, r, f in zip(["dX", "dW", "db"], ours, eag, ref, floors) if r is not None
           for m in _check(f"{name} {backend} H={heads} N={n} ls={ls} zl={zl}", o, e, r, ymax, f)]
    assert not bad, bad


@pytest.mark.parametrize("upstream", ["onehot_top", "random"])
@pytest.mark.parametrize("heads,n,d,v,bias,seed", ALL_CASES)
def test_logprobs_top_entry(heads, n, d, v, bias, seed, upstream):
    """multi_head_logprobs (one implementation, no backend argument): log pbar of the top entry (~ -1e-5) and
    the gradient of sum(G * log pbar), G one-hot at the top entry (scaled) or random [N, V]."""
    x, w, b, labels = _confident(n, d, v, heads, bias, seed)
    g = torch.Generator().manual_seed(seed + 100)
    if upstream == "onehot_top":
        grad_out = F.one_hot(labels, v).double() * (1 + torch.rand(n, 1, generator=g, dtype=F64))
    else:
        grad_out = torch.randn(n, v, generator=g, dtype=F64)
    eager = lambda x, w, b: _mix(_logits(x, w, b, heads))  # noqa: E731
    out_ref, ref = _grads(eager, (x, w, b), F64, grad_out)
    out_e, eag = _grads(eager, (x, w, b), torch.float32, grad_out)
    fused = lambda x, w, b: hf_mhce.multi_head_logprobs(*_on(x, w), heads, bias=_on(b)[0]).cpu()  # noqa: E731
    out, ours = _grads(fused, (x, w, b), torch.float32, grad_out)
    top = lambda t: t.gather(1, labels[:, None])[:, 0]  # noqa: E731
    _assert_confident(-top(out_ref))
    ymax = _ymax(x, w, b, heads)
    bad = _check(f"log pbar_top H={heads} N={n}", top(out), top(out_e), top(out_ref), ymax)
    floors = _grad_floors(x, w, b, heads, labels, top(grad_out))
    bad += [m for name, o, e, r, f in zip(["dX", "dW", "db"], ours, eag, ref, floors) if r is not None
            for m in _check(f"{name} H={heads} N={n} {upstream}", o, e, r, ymax, f)]
    assert not bad, bad
