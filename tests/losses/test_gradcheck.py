"""torch.autograd.gradcheck (float64, finite differences) of the hand-written backward passes."""

import pytest
import torch

import hf_mhce  # no importorskip: a broken package must fail, not skip
from reference import make_inputs

N, D, V = 5, 4, 7


def _inputs(H=1, bias=True, lead=(N,)):
    hidden, weight, b, labels = make_inputs(lead, D, V, dtype=torch.float64, bias=bias, num_heads=H)
    labels.view(-1)[1] = -100  # one ignored token
    leaves = [hidden.requires_grad_(), weight.requires_grad_()]
    if bias:
        leaves.append(b.requires_grad_())
    return leaves, labels


CASES = [
    pytest.param(dict(), id="plain"),
    pytest.param(dict(label_smoothing=0.3), id="smooth"),
    pytest.param(dict(z_loss=0.1), id="zloss"),
    pytest.param(dict(softcap=1.5), id="softcap"),
    pytest.param(dict(label_smoothing=0.2, z_loss=0.05, softcap=2.0), id="all"),
]


@pytest.mark.parametrize("reduction", ["mean", "none", "sum"])
@pytest.mark.parametrize("opts", CASES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_gradcheck_linear_cross_entropy(opts, reduction, bias):
    leaves, labels = _inputs(bias=bias)

    def f(h, w, b=None):
        return hf_mhce.linear_cross_entropy(h, w, labels, bias=b, reduction=reduction, backend="torch", **opts)

    assert torch.autograd.gradcheck(f, tuple(leaves), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("opts", CASES)
@pytest.mark.parametrize("H", [2, 4])
def test_gradcheck_multi_head(opts, reduction, H):
    leaves, labels = _inputs(H=H)

    def f(h, w, b):
        return hf_mhce.multi_head_cross_entropy(h, w, labels, H, bias=b, reduction=reduction, backend="torch",
                                                **opts)

    assert torch.autograd.gradcheck(f, tuple(leaves), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_multi_head_leading_dims_num_items():
    leaves, labels = _inputs(H=2, lead=(2, 3))

    def f(h, w, b):
        return hf_mhce.multi_head_cross_entropy(h, w, labels, 2, bias=b, num_items_in_batch=7,
                                                label_smoothing=0.1, backend="torch")

    assert torch.autograd.gradcheck(f, tuple(leaves), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["nocap", "cap2"])
@pytest.mark.parametrize("H", [1, 2])
def test_gradcheck_multi_head_logprobs(H, softcap):
    leaves, _ = _inputs(H=H)

    def f(h, w, b):
        return hf_mhce.multi_head_logprobs(h, w, H, bias=b, softcap=softcap)

    assert torch.autograd.gradcheck(f, tuple(leaves), eps=1e-6, atol=1e-7, rtol=1e-5)
