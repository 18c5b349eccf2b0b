"""A -inf bias restricting predictions to a sub-vocabulary, on the torch backend: the online logsumexp
starts from -inf, and vocabulary chunks that are wholly masked must not turn it NaN (exp(-inf - -inf)).
Values are torch's: F.cross_entropy gives an infinite loss for a masked target and with label
smoothing (-sum log p over masked entries), with finite gradients.  HF_MHCE_CHUNK_MB is small enough
that the masked leading block spans several chunks.  Triton: tests/ops/test_triton_interpret.py."""

import math

import pytest
import torch
import torch.nn.functional as F

import reference as R
from reference import assert_close_scaled, assert_same_nonfinite, make_inputs, run_with_grads

import hf_mhce
from hf_mhce.losses import collect_ranks

N, D, V = 26, 32, 613
TINY_CHUNKS = "0.01"  # 10 KB blocks: 4-8 vocabulary columns, two token blocks


def masked_inputs(num_heads, masked_targets=3, dtype=torch.float32):
    """Inputs with bias -inf on a leading block of 250 columns, a block inside and a few scattered
    columns; labels in the allowed columns except ``masked_targets`` rows, and some ignored."""
    hidden, weight, b, _ = make_inputs((N,), D, V, bias=True, num_heads=num_heads, dtype=dtype, logit_std=2.5)
    b[:250] = -math.inf
    b[400:420] = -math.inf
    b[torch.randperm(V)[:15]] = -math.inf
    allowed = torch.isfinite(b).nonzero()[:, 0]
    labels = allowed[torch.randint(0, allowed.numel(), (N,))]
    labels[3:3 + masked_targets] = torch.tensor([0, 249, 410])[:masked_targets]
    labels[[7, 19]] = -100
    return hidden, weight, b, labels


def _compare(hidden, weight, b, labels, H, rtol=1e-5, atol=1e-6, **opts):
    g = torch.randn(labels.shape)
    ours = run_with_grads(hf_mhce.multi_head_cross_entropy, hidden, weight, labels, H, bias=b, grad_out=g,
                          backend="torch", reduction="none", **opts)
    ref = run_with_grads(R.masked_vocab_loss, hidden, weight, labels, H, bias=b, grad_out=g.double(),
                         dtype=torch.float64, **opts)
    assert_same_nonfinite(ours[0], ref[0], name="loss", rtol=rtol, atol=atol)
    for name, o, r in zip(["d_hidden", "d_weight", "d_bias"], ours[1:], ref[1:]):
        assert_close_scaled(o, r, rtol=rtol, atol=atol, name=name)
    return ours, ref


@pytest.mark.parametrize("opts", [{}, dict(label_smoothing=0.1), dict(z_loss=1e-3),
                                  dict(label_smoothing=0.2, z_loss=1e-2)], ids=["plain", "ls", "z", "ls+z"])
@pytest.mark.parametrize("H", [1, 2])
def test_masked_leading_chunks(monkeypatch, H, opts):
    monkeypatch.setenv("HF_MHCE_CHUNK_MB", TINY_CHUNKS)
    ours, ref = _compare(*masked_inputs(H), H, **opts)
    loss = ours[0]
    assert loss[3:6].isinf().all()  # masked targets: inf, as torch's
    if not opts.get("label_smoothing"):
        assert loss[6:].isfinite().all() and loss[6:].abs().max() > 0


def test_one_head_is_torch_cross_entropy(monkeypatch):
    """Beside the float64 reference, the library's own float32 against F.cross_entropy on the
    materialised float32 logits, with reduction "mean" (inf: some targets are masked)."""
    monkeypatch.setenv("HF_MHCE_CHUNK_MB", TINY_CHUNKS)
    for kw, masked in [(dict(label_smoothing=0.1), 3), ({}, 0)]:
        hidden, weight, b, labels = masked_inputs(1, masked_targets=masked)
        ours = run_with_grads(hf_mhce.linear_cross_entropy, hidden, weight, labels, bias=b, backend="torch", **kw)

        def torch_ce(h, w, lab, bias=None):
            return F.cross_entropy(F.linear(h, w, bias), lab, **kw)

        eager = run_with_grads(torch_ce, hidden, weight, labels, bias=b)
        assert_same_nonfinite(ours[0], eager[0], name="loss", rtol=1e-5, atol=1e-6)
        assert bool(ours[0].isinf()) == (masked > 0 or "label_smoothing" in kw)
        for name, o, e in zip(["d_hidden", "d_weight", "d_bias"], ours[1:], eager[1:]):
            assert_close_scaled(o, e, rtol=1e-4, atol=1e-5, name=name)


def test_default_chunks():
    """The review's case: default chunk size (4096 columns), V = 5000, only 10 tokens allowed."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=g), torch.randn(5000, 8, generator=g)
    bias = torch.full((5000,), -math.inf)
    bias[4500:4510] = 0.0
    y = torch.tensor([4500, 4501, 4505, 4509])
    for H in (1, 2):
        got = hf_mhce.multi_head_cross_entropy(x, w, y, H, bias=bias, reduction="none", backend="torch")
        expected = R.masked_vocab_loss(x.double(), w.double(), y, H, bias=bias.double())
        assert_close_scaled(got, expected, name=f"H={H}")


def test_float64(monkeypatch):
    monkeypatch.setenv("HF_MHCE_CHUNK_MB", TINY_CHUNKS)
    _compare(*masked_inputs(2, dtype=torch.float64), 2, rtol=1e-10, atol=1e-12, label_smoothing=0.1, z_loss=1e-3)


def test_ranks(monkeypatch):
    """collect_ranks: a masked target ranks below every allowed entry; masked entries rank below all."""
    monkeypatch.setenv("HF_MHCE_CHUNK_MB", TINY_CHUNKS)
    for H in (1, 2):
        hidden, weight, b, labels = masked_inputs(H)
        got = []
        with torch.no_grad(), collect_ranks(lambda r, nll: got.append((r, nll))):
            hf_mhce.multi_head_cross_entropy(hidden, weight, labels, H, bias=b, backend="torch")
        (ranks, nll), = got
        valid = labels != -100
        logp = R.reference_logprobs(hidden.double(), weight.double(), H, bias=b.double())[valid]
        t = labels[valid, None]
        above = logp > logp.gather(1, t)
        above.scatter_(1, t, False)
        assert torch.equal(ranks, above.sum(-1))
        assert torch.equal(ranks[3:6], torch.full((3,), int(torch.isfinite(b).sum())))  # the masked targets
        assert torch.equal(nll.isinf(), logp.gather(1, t)[:, 0].isinf())


# ------------------------------------------------------------------------------------------------
# multi_head_logprobs
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("H", [1, 2])
def test_logprobs(monkeypatch, H):
    monkeypatch.setenv("HF_MHCE_CHUNK_MB", TINY_CHUNKS)
    hidden, weight, b, _ = masked_inputs(H)
    g = torch.randn(N, V)  # masked entries too: log_softmax passes their gradient to the logits

    def ours_fn(h, w, _labels, bias=None):
        return hf_mhce.multi_head_logprobs(h, w, H, bias=bias)

    def ref_fn(h, w, _labels, bias=None):
        return R.masked_vocab_logprobs(h, w, H, bias=bias)

    ours = run_with_grads(ours_fn, hidden, weight, None, bias=b, grad_out=g)
    ref = run_with_grads(ref_fn, hidden, weight, None, bias=b, grad_out=g.double(), dtype=torch.float64)
    assert_same_nonfinite(ours[0], ref[0], name="logprobs")
    assert ours[0][:, :250].isneginf().all()
    for name, o, r in zip(["d_hidden", "d_weight", "d_bias"], ours[1:], ref[1:]):
        assert_close_scaled(o, r, name=name)
    if H == 1:  # and literally torch's log_softmax
        x = hidden.clone().requires_grad_()
        torch.log_softmax(F.linear(x, weight, b), -1).backward(g)
        assert_close_scaled(ours[1], x.grad, rtol=1e-4, atol=1e-5, name="d_hidden vs torch")


def test_logprobs_gradient_of_targets():
    """The review's case: d/dx of the picked log-probabilities, all masked columns in one chunk."""
    x, w = torch.randn(3, 8), torch.randn(10, 8)
    bias = torch.zeros(10)
    bias[7:] = -math.inf
    t = torch.tensor([1, 2, 3])
    for H in (1, 2):
        xa, xb = x.clone().requires_grad_(), x.double().requires_grad_()
        hf_mhce.multi_head_logprobs(xa, w, H, bias=bias).gather(1, t[:, None]).sum().backward()
        R.masked_vocab_logprobs(xb, w.double(), H, bias=bias.double()).gather(1, t[:, None]).sum().backward()
        assert_close_scaled(xa.grad, xb.grad, name=f"H={H}")
