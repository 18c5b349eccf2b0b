"""Non-finite logits in valid rows: the values eager float64 gives, on every path.

A +inf or NaN in a valid row's hidden state, or a +inf in the head's weight, makes that row's logits +-inf or NaN.
Eager's log_softmax then returns NaN for the whole row (its sum holds exp(inf - inf)), and a mixture over heads
NaN for the token, so a training run that diverged reports NaN.  The Triton tiles count +inf entries as ties of
the maximum, which gave such a row a finite log-sum and, with several heads, a finite loss: a diverged model
evaluated as a healthy one (found by an adversarial review; fixed in ``combine_splits``).  Rows without a
non-finite logit keep their finite values, and -inf logits (a masked entry, or a target at -inf) keep eager's.
"""

import contextlib
import math
import os

import pytest
import torch

import hf_mhce
from hf_mhce.ops.triton_tile import override_tiles
from reference import HAVE_TRITON, make_inputs

N, D, V = 7, 12, 37
# HF_MHCE_TEST_DEVICE=cuda runs the fused ops on a GPU (benchmarks/device_run.sh tune); references stay on the CPU
DEVICE = torch.device(os.environ.get("HF_MHCE_TEST_DEVICE", "cpu"))
# (name, break(hidden, weight)): row 2 hit in head 0's slice; row 4 by NaN in the last head's slice;
# a weight entry +inf: rows with a positive hidden entry there get a +inf logit, the others a -inf one.
BREAKS = {
    "hidden_inf": lambda h, w: h[2].__setitem__(0, float("inf")),
    "hidden_nan": lambda h, w: h[4].__setitem__(-1, float("nan")),
    "weight_inf": lambda h, w: w[5].__setitem__(1, float("inf")),
}
PATHS = [pytest.param("torch", None, "1", id="torch")] + [
    pytest.param("triton", splits, in_forward, id=f"triton-splits{splits}-in_forward{in_forward}",
                 marks=pytest.mark.skipif(not HAVE_TRITON, reason="no triton"))
    for splits in (1, 3) for in_forward in ("1", "0")]


def _inputs(heads, broken, seed):
    hidden, weight, _, labels = make_inputs((N,), D, V, num_heads=heads)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[5] = 5  # a target on the +inf weight row's column: -inf there for rows with a negative entry
    labels[2] = int(weight[:, 0].argmin())  # row 2's target at -inf beside +inf entries (inf - inf is not its own)
    BREAKS[broken](hidden, weight)
    return hidden, weight, labels


def _eager(hidden, weight, labels, heads):
    """float64 eager: per-token mixture loss [N] and log-probabilities [N, V]."""
    y = torch.einsum("nhd,vhd->nhv", hidden.double().view(N, heads, -1), weight.double().view(V, heads, -1))
    log_mix = torch.logsumexp(torch.log_softmax(y, -1), 1) - math.log(heads)
    return -log_mix.gather(1, labels[:, None])[:, 0], log_mix


def _same(ours, ref):
    """NaN where the reference is NaN, equal infinities, finite values to float32 rounding."""
    ours = ours.double()
    assert torch.equal(ours.isnan(), ref.isnan()), (ours, ref)
    assert torch.equal(ours.isinf(), ref.isinf()) and torch.equal(ours[ours.isinf()], ref[ref.isinf()]), (ours, ref)
    finite = ref.isfinite()
    assert torch.allclose(ours[finite], ref[finite], rtol=1e-5, atol=1e-5), (ours, ref)


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("broken", list(BREAKS))
@pytest.mark.parametrize("backend,splits,in_forward", PATHS)
def test_loss_like_eager(heads, broken, backend, splits, in_forward, monkeypatch):
    monkeypatch.setenv("HF_MHCE_GRAD_IN_FORWARD", in_forward)
    hidden, weight, labels = _inputs(heads, broken, seed=heads)
    ref, _ = _eager(hidden, weight, labels, heads)
    assert ref.isnan().any() and ref.isfinite().any(), ref  # the case holds broken and healthy rows
    hidden, weight, labels = (t.to(DEVICE) for t in (hidden, weight, labels))
    with override_tiles("forward", SPLITS=splits) if splits else contextlib.nullcontext():
        with torch.no_grad():  # the statistics forward
            loss = hf_mhce.multi_head_cross_entropy(hidden, weight, labels, heads, reduction="none", backend=backend)
            _same(loss.cpu(), ref)
        w = weight.clone().requires_grad_(True)  # training: mean loss and gradients (formed in the forward or not)
        loss = hf_mhce.multi_head_cross_entropy(hidden, w, labels, heads, backend=backend)
        assert loss.isnan(), loss
        loss.backward()
        assert w.grad.isnan().any(), "a NaN loss must not come with finite gradients"


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("broken", list(BREAKS))
def test_logprobs_like_eager(heads, broken):
    hidden, weight, labels = _inputs(heads, broken, seed=10 + heads)
    _, ref = _eager(hidden, weight, labels, heads)
    _same(hf_mhce.multi_head_logprobs(hidden.to(DEVICE), weight.to(DEVICE), heads).cpu(), ref)
