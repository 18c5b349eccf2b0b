"""Confident tokens across many logits blocks and tiles (NOTES change 13), float32 inputs.

Each token's target logit is the top one (at +-60..100) and the rest of its softmax's sum, 1 - p_t ~ 1e-6..1e-4,
is spread over V = 3001 entries, so every torch column block (HF_MHCE_CHUNK_MB small) or Triton tile holds a
share of it far below an ulp of 1.  A running sum exp(y - max) that holds the maximum's own 1 rounded those
shares away (loss and target gradient 1e-2..1 off; eager float32 on the CPU: 5e-2 at V = 32768).  The hidden
rows are one-hot per head, so the logits are the weight's entries exactly and the reference, float64 on the
same float32 values, has nothing of the matmul's rounding in it.  Also: a tie for the maximum (two entries at
the top, rest >= 1), the maximum in the first and in the last column, several forward splits (combine_splits),
and the gradients formed in the forward (row-stats kernel) and in the backward.
"""

import math
import os

import pytest
import torch

import hf_mhce
from hf_mhce.ops.triton_tile import override_tiles
from reference import HAVE_TRITON

F64 = torch.float64
# HF_MHCE_TEST_DEVICE=cuda runs the fused ops on a GPU (benchmarks/device_run.sh tune); references stay on the CPU
DEVICE = torch.device(os.environ.get("HF_MHCE_TEST_DEVICE", "cpu"))
V, N = 3001, 5
# Relative error allowed (loss per token, target column's gradient per token): the float32 sum of V terms
# in blocks or tiles (~100 additions of 2^-24 each) and the logits' exp; the defect was 1e-2..1.
TOL = 2e-5
TRITON = pytest.mark.skipif(not HAVE_TRITON, reason="no triton")


def _confident_logits(heads, seed):
    """float32 logits [N, H, V] and labels [N]: targets at columns 0, V - 1 and random ones; token 2 has a
    second entry equal to its top (a tie); the others lie 15-20 + [0, 3) below the top."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.cat([torch.tensor([0, V - 1]), torch.randint(1, V - 1, (N - 2,), generator=g)])
    top = (60 + 40 * torch.rand(N, heads, 1, generator=g, dtype=F64)) * (2 * (torch.arange(N) % 2) - 1)[:, None, None]
    gap = 15 + 5 * torch.rand(N, heads, 1, generator=g, dtype=F64)
    z = top - gap - 3 * torch.rand(N, heads, V, generator=g, dtype=F64)
    z[torch.arange(N), :, labels] = top[:, :, 0]
    z[2, :, (labels[2] + 1000) % V] = top[2, :, 0]
    return z.float(), labels


def _operands(z):
    """(x [N, H * N], W [V, H * N]) with x W_h^T = z[:, h] exactly: x one-hot per head."""
    heads = z.shape[1]
    x = torch.eye(N).repeat(1, heads)
    w = z.permute(2, 1, 0).reshape(V, heads * N).contiguous()
    return x, w


def _reference(z, labels):
    """(loss [N], dL/dz at each token's target column [N, H]) of the summed mixture loss, in float64."""
    z = z.double().requires_grad_(True)
    log_p = torch.log_softmax(z, -1)
    mix = torch.logsumexp(log_p, 1) - math.log(z.shape[1])
    loss = -mix.gather(1, labels[:, None])[:, 0]
    loss.sum().backward()
    return loss.detach(), z.grad[torch.arange(N), :, labels]


def _relative(ours, ref):
    return ((ours.double() - ref).abs() / ref.abs()).max().item()


def _ours(z, labels, backend):
    """(loss [N], gradient at the target columns [N, H]) through the fused op (a summed loss)."""
    x, w = (t.to(DEVICE) for t in _operands(z))
    w.requires_grad_(True)
    heads, on = z.shape[1], labels.to(DEVICE)
    loss = hf_mhce.multi_head_cross_entropy(x, w, on, heads, reduction="none", backend=backend)
    total = hf_mhce.multi_head_cross_entropy(x, w, on, heads, reduction="sum", backend=backend)
    total.backward()
    grad = w.grad.cpu().view(V, heads, N).permute(2, 1, 0)  # dL/dz [N, H, V]
    return loss.detach().cpu(), grad[torch.arange(N), :, labels]


def _check(z, labels, backend):
    ref_loss, ref_grad = _reference(z, labels)
    assert ((ref_loss[[0, 1, 3, 4]] > 1e-7) & (ref_loss[[0, 1, 3, 4]] < 1e-3)).all(), ref_loss  # confident
    loss, grad = _ours(z, labels, backend)
    errors = {"loss": _relative(loss, ref_loss), "target gradient": _relative(grad, ref_grad)}
    print(backend, {k: f"{e:.1e}" for k, e in errors.items()})
    assert all(e <= TOL for e in errors.values()), errors


@pytest.mark.parametrize("heads,seed", [(1, 0), (2, 1), (3, 2)])
@pytest.mark.parametrize("chunk_mb", ["0.02", "64"])
def test_torch_column_blocks(heads, seed, chunk_mb, monkeypatch):
    """The torch sweeps: 0.02 MB puts V = 3001 in blocks of a few dozen columns; 64 MB in one block."""
    monkeypatch.setenv("HF_MHCE_CHUNK_MB", chunk_mb)
    z, labels = _confident_logits(heads, seed)
    _check(z, labels, "torch")


@TRITON
@pytest.mark.parametrize("heads,seed", [(1, 3), (2, 4), (3, 5)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("in_forward", ["1", "0"])
def test_triton_tiles(heads, seed, splits, in_forward, monkeypatch):
    """The Triton kernels (tiles of 32 columns in the interpreter): the forward with one and three splits, the
    gradients formed in the forward (row-stats kernel over the whole row) or recomputed in the backward."""
    monkeypatch.setenv("HF_MHCE_GRAD_IN_FORWARD", in_forward)
    z, labels = _confident_logits(heads, seed)
    with override_tiles("forward", SPLITS=splits):
        _check(z, labels, "triton")


@pytest.mark.parametrize("chunk_mb", ["0.02", "64"])
def test_logprobs_top_entry(chunk_mb, monkeypatch):
    """multi_head_logprobs (one head: log p_t itself) at the confident target, across column blocks."""
    monkeypatch.setenv("HF_MHCE_CHUNK_MB", chunk_mb)
    z, labels = _confident_logits(1, 6)
    x, w = (t.to(DEVICE) for t in _operands(z))
    ours = hf_mhce.multi_head_logprobs(x, w, 1).cpu()[torch.arange(N), labels]
    ref = torch.log_softmax(z.double()[:, 0], -1)[torch.arange(N), labels]
    assert _relative(ours, ref) <= TOL, _relative(ours, ref)


@pytest.mark.parametrize("upstream", ["onehot_top", "random"])
@pytest.mark.parametrize("chunk_mb", ["0.02", "64"])
@pytest.mark.parametrize("heads,seed", [(1, 7), (2, 9), (3, 10)])
def test_logprobs_top_gradient(heads, seed, upstream, chunk_mb, monkeypatch):
    """The gradient of sum(G * multi_head_logprobs) at each head's top entry: g_top r_top (1 - p_top) - p_top S'
    formed without cancelling (eager's log_softmax backward, g_top - p_top S, keeps an ulp of g_top).
    G one-hot at the top entry (the log-probability of a sampled, confident token) or random."""
    monkeypatch.setenv("HF_MHCE_CHUNK_MB", chunk_mb)
    z, labels = _confident_logits(heads, seed)
    g = torch.Generator().manual_seed(seed + 100)
    grad_out = torch.randn(N, V, generator=g, dtype=F64) * (1e-4 if upstream == "random" else 0.0)
    grad_out[torch.arange(N), labels] = 1 + torch.rand(N, generator=g, dtype=F64)
    z64 = z.double().requires_grad_(True)
    mix = torch.logsumexp(torch.log_softmax(z64, -1), 1) - math.log(heads)
    (mix * grad_out).sum().backward()
    ref = z64.grad[torch.arange(N), :, labels]  # [N, H]
    x, w = (t.to(DEVICE) for t in _operands(z))
    w.requires_grad_(True)
    (hf_mhce.multi_head_logprobs(x, w, heads) * grad_out.float().to(DEVICE)).sum().backward()
    ours = w.grad.cpu().view(V, heads, N).permute(2, 1, 0)[torch.arange(N), :, labels]
    assert ref.abs().min() > 1e-9, ref
    err = _relative(ours, ref)
    print(f"logprobs top gradient H={heads} {upstream}: {err:.1e}")
    assert err <= TOL, err


def test_logprobs_top_gradient_beyond_float64():
    """1 - p_top ~ 1e-25: the top entry's gradient under a one-hot upstream is g (1 - p_top) = -(the others' sum),
    which float64 autograd itself rounds to 0 (its p_top is 1); ours keeps it to float32's precision."""
    z = torch.tensor([[0.0, -58.0, -60.0, -61.5]])
    x, w = torch.eye(1).to(DEVICE), z.T.contiguous().to(DEVICE).requires_grad_(True)
    grad_out = torch.zeros(1, 4)
    grad_out[0, 0] = 1.5
    (hf_mhce.multi_head_logprobs(x, w, 1) * grad_out.to(DEVICE)).sum().backward()
    ours = w.grad.cpu()[:, 0].double()
    others = -1.5 * torch.exp(z.double()[0, 1:] - torch.logsumexp(z.double()[0], -1))  # exact in float64
    exact = torch.cat([-others.sum()[None], others])
    assert _relative(ours, exact) <= TOL, (ours, exact)
