"""backend="triton" on CPU tensors through the Triton interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before anything imports triton or hf_mhce).

The interpreter is slow, so shapes stay small (N <= 40, V <= 100, D <= 64); V and N are chosen so
that they are not multiples of any block size (masking of partial tiles is exercised).
"""

import os

import pytest
import torch

import reference as R
from reference import (
    assert_close_scaled,
    assert_no_worse_than_eager,
    grad_out_for,
    make_inputs,
    requires_triton,
    run_with_grads,
)

pytestmark = requires_triton

import hf_mhce  # noqa: E402  (no importorskip: a broken package must fail, not skip)

mhce = hf_mhce.multi_head_cross_entropy
lce = hf_mhce.linear_cross_entropy


def test_interpreter_is_on():
    assert os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(autouse=True)
def _recompute_schedule(monkeypatch):
    """These tests check the tile forward and the recompute backward (its slabs, its padding tiles); the
    schedule that computes gradients in the forward has its own (test_forward_grad.py)."""
    monkeypatch.setenv("HF_MHCE_GRAD_IN_FORWARD", "0")


@pytest.fixture(autouse=True)
def launches(monkeypatch):
    """Counts Triton kernel launches (interpreter grid runs), so that a silent fallback to the
    torch path cannot make these tests pass vacuously."""
    from triton.runtime.interpreter import InterpretedFunction

    count = {"n": 0}
    orig = InterpretedFunction.run

    def run(self, *args, **kwargs):
        if not kwargs.get("warmup"):
            count["n"] += 1
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    yield count
    name = os.environ.get("PYTEST_CURRENT_TEST", "")
    exempt = ("test_interpreter_is_on", "errors_still_validated")
    if not any(e in name for e in exempt):
        assert count["n"] > 0, "backend='triton' launched no Triton kernel"


def _fp32_check(lead, D, V, H, reduction="mean", bias=True, ignore_frac=0.25, **opts):
    hidden, weight, b, labels = make_inputs(lead, D, V, bias=bias, num_heads=H, ignore_frac=ignore_frac,
                                            ignore_index=opts.get("ignore_index", -100), logit_std=2.5)
    g = grad_out_for(reduction, labels)
    ours = run_with_grads(mhce, hidden, weight, labels, H, bias=b, grad_out=g, reduction=reduction,
                          backend="triton", **opts)
    ref = run_with_grads(R.reference_loss, hidden, weight, labels, H, bias=b, grad_out=g.double(),
                         dtype=torch.float64, reduction=reduction, **opts)
    assert ours[0].dtype == torch.float32
    for name, o, r in zip(["loss", "d_hidden", "d_weight", "d_bias"], ours, ref):
        if r is None:
            assert o is None
            continue
        assert o.dtype == torch.float32, name
        assert_close_scaled(o, r, rtol=1e-5, atol=1e-6, name=name)
    return ours


@pytest.mark.parametrize(
    "lead,D,V,H",
    [
        pytest.param((1,), 8, 7, 1, id="N1-V7-H1"),
        pytest.param((37,), 33, 61, 1, id="N37-V61-D33-H1"),
        pytest.param((37,), 32, 61, 2, id="N37-V61-D32-H2"),
        pytest.param((2, 19), 64, 100, 4, id="B2xT19-V100-D64-H4"),
    ],
)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp32_matches_reference(lead, D, V, H, reduction):
    _fp32_check(lead, D, V, H, reduction, ignore_frac=0.0 if lead == (1,) else 0.25)


@pytest.mark.parametrize(
    "opts",
    [
        dict(reduction="sum", bias=False),
        dict(reduction="sum", num_items_in_batch=50),
        dict(reduction="none", label_smoothing=0.2, z_loss=1e-2, softcap=3.0),
        dict(reduction="mean", ignore_index=3, label_smoothing=0.1),
        # a cap far above the logits: c * tanh(z / c) must not cancel (its exp form was 1e-3 off here)
        dict(reduction="none", softcap=1e4),
    ],
    ids=["sum-nobias", "num_items", "all-options", "ignore3", "softcap-far-above-logits"],
)
@pytest.mark.parametrize("H", [1, 4])
def test_fp32_options(opts, H):
    opts = dict(opts)
    _fp32_check((29,), 32, 53, H, ignore_frac=0.3, **opts)


def test_fp32_options_linear_api():
    hidden, weight, b, labels = make_inputs((23,), 33, 47, bias=True, ignore_frac=0.2)
    g = torch.randn(23)
    kw = dict(reduction="none", label_smoothing=0.1, z_loss=1e-3, softcap=4.0)
    ours = run_with_grads(lce, hidden, weight, labels, bias=b, grad_out=g, backend="triton", **kw)
    ref = run_with_grads(R.reference_loss, hidden, weight, labels, 1, bias=b, grad_out=g.double(),
                         dtype=torch.float64, **kw)
    for name, o, r in zip(["loss", "d_hidden", "d_weight", "d_bias"], ours, ref):
        assert_close_scaled(o, r, rtol=1e-5, atol=1e-6, name=name)


# HF_MHCE_WORKSPACE_MB bounds the 16-bit backward's slabs, float32 accumulators and temporaries.  At
# N=37, D=32 (a float32 dX of 4736 bytes) and V=61: default = one fused pass; "fused_ranges" = fused over
# 2 vocabulary ranges (0.01 MB for one head, 0.018 for two: their slabs are twice as wide); 0.003 MB =
# a dW pass (slabs of 16 tokens summed into a float32 accumulator) + a dX pass (3 token ranges).
WORKSPACES = {"fused": {1: None, 2: None}, "fused_ranges": {1: "0.01", 2: "0.018"}, "split": {1: "0.003", 2: "0.003"}}


@pytest.mark.parametrize("plan", list(WORKSPACES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("H", [1, 2])
def test_low_precision_vs_eager(dtype, H, plan, monkeypatch):
    workspace_mb = WORKSPACES[plan][H]
    if workspace_mb is not None:
        monkeypatch.setenv("HF_MHCE_WORKSPACE_MB", workspace_mb)
    hidden, weight, b, labels = make_inputs((37,), 32, 61, dtype=dtype, bias=True, num_heads=H, ignore_frac=0.2,
                                            logit_std=3.0)
    g = torch.randn(37)
    kw = dict(reduction="none", label_smoothing=0.1)
    ours = run_with_grads(mhce, hidden, weight, labels, H, bias=b, grad_out=g, backend="triton", **kw)
    eager = run_with_grads(R.eager_loss, hidden, weight, labels, H, bias=b, grad_out=g, **kw)
    ref = run_with_grads(R.reference_loss, hidden, weight, labels, H, bias=b, grad_out=g.double(),
                         dtype=torch.float64, **kw)
    assert ours[0].dtype == torch.float32
    assert ours[1].dtype == dtype and ours[2].dtype == dtype and ours[3].dtype == dtype
    for name, o, e, r in zip(["loss", "d_hidden", "d_weight", "d_bias"], ours, eager, ref):
        assert_no_worse_than_eager(o, e, r, dtype, name=name)


@pytest.mark.parametrize("plan", ["fused", "split"])
def test_bf16_bias_gradient_sums_unrounded_dy(plan, monkeypatch):
    """dB sums each tile's float32 dY before rounding (per-tile partials, no atomics): about half eager's
    error, which sums the rounded dY.  Column sums of the bf16 slab (a rejected design) gave 1.2x eager's."""
    if plan == "split":
        monkeypatch.setenv("HF_MHCE_WORKSPACE_MB", "0.003")  # dB from the first of two passes, over token ranges
    ours_err, eager_err = [], []
    for seed in range(6):
        torch.manual_seed(seed)
        hidden, weight, b, labels = make_inputs((96,), 16, 45, dtype=torch.bfloat16, bias=True, num_heads=2,
                                                ignore_frac=0.2, logit_std=3.0)
        g = torch.randn(96)
        ours = run_with_grads(mhce, hidden, weight, labels, 2, bias=b, grad_out=g, backend="triton", reduction="none")
        eager = run_with_grads(R.eager_loss, hidden, weight, labels, 2, bias=b, grad_out=g, reduction="none")
        ref = run_with_grads(R.reference_loss, hidden, weight, labels, 2, bias=b, grad_out=g.double(),
                             dtype=torch.float64, reduction="none")
        ours_err.append(float((ours[3].double() - ref[3]).norm() / ref[3].norm()))
        eager_err.append(float((eager[3].double() - ref[3]).norm() / ref[3].norm()))
    assert sum(ours_err) < 0.7 * sum(eager_err), (ours_err, eager_err)


def test_all_ignored():
    hidden, weight, b, labels = make_inputs((9,), 16, 23, bias=True, num_heads=2)
    labels.fill_(-100)
    out = run_with_grads(mhce, hidden, weight, labels, 2, bias=b, backend="triton", z_loss=1e-3)
    assert out[0].item() == 0.0
    for gr in out[1:]:
        assert not torch.isnan(gr).any() and (gr == 0).all()


def test_torch_backend_launches_no_kernel(launches):
    hidden, weight, b, labels = make_inputs((5,), 8, 13, bias=True)
    hidden.requires_grad_()
    lce(hidden, weight, labels, bias=b, backend="torch").backward()
    assert launches["n"] == 0
    lce(hidden, weight, labels, bias=b, backend="triton").backward()
    assert launches["n"] > 0


def test_triton_matches_torch_backend():
    H = 2
    hidden, weight, b, labels = make_inputs((2, 17), 32, 97, bias=True, num_heads=H, ignore_frac=0.2)
    g = torch.randn(2, 17)
    kw = dict(reduction="none", label_smoothing=0.1, z_loss=1e-3, softcap=6.0)
    tri = run_with_grads(mhce, hidden, weight, labels, H, bias=b, grad_out=g, backend="triton", **kw)
    tor = run_with_grads(mhce, hidden, weight, labels, H, bias=b, grad_out=g, backend="torch", **kw)
    for name, x, y in zip(["loss", "d_hidden", "d_weight", "d_bias"], tri, tor):
        assert x.dtype == y.dtype, name
        # both are fp32 approximations of the same quantity: each is within ~1e-6 (relative to
        # the max) of the float64 reference, so of each other to ~2x that
        assert_close_scaled(x, y, rtol=2e-5, atol=2e-6, name=name)


def test_triton_errors_still_validated():
    hidden, weight, _, labels = make_inputs((5,), 8, 13)
    labels[2] = 777
    with pytest.raises(ValueError, match="777"):
        lce(hidden, weight, labels, backend="triton")


def _masked_vocab_inputs(H):
    """A -inf bias on columns 0..39 and 64..97 of V = 101 (32-column tiles): the first tile wholly
    masked; with 2 vocabulary splits (64 columns) each split starts with a wholly masked tile, with 4
    (32) splits 0 and 2 are wholly masked.  Two targets are masked, one token is ignored."""
    hidden, weight, b, _ = make_inputs((21,), 32, 101, bias=True, num_heads=H, logit_std=2.5)
    b[:40] = float("-inf")
    b[64:98] = float("-inf")
    allowed = torch.isfinite(b).nonzero()[:, 0]
    labels = allowed[torch.randint(0, allowed.numel(), (21,))]
    labels[2], labels[3], labels[11] = 5, 70, -100
    return hidden, weight, b, labels


# The interpreter's numpy warns on log(0), the partial logsumexp of a wholly masked split (-inf, as on a GPU)
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")
@pytest.mark.parametrize("H,splits,opts", [
    (1, 1, {}), (1, 2, dict(label_smoothing=0.1, z_loss=1e-3)), (1, 4, {}),
    (2, 1, dict(z_loss=1e-3)), (2, 4, dict(label_smoothing=0.1)),
])
def test_masked_vocabulary(H, splits, opts):
    """Torch's values (inf for a masked target or with label smoothing, finite gradients), not NaN:
    the online logsumexp of a tile or split that starts wholly masked, and the merge of the splits."""
    from hf_mhce.ops.triton_tile import override_tiles

    hidden, weight, b, labels = _masked_vocab_inputs(H)
    g = torch.randn(21)
    with override_tiles("forward", SPLITS=splits):
        ours = run_with_grads(mhce, hidden, weight, labels, H, bias=b, grad_out=g, backend="triton",
                              reduction="none", **opts)
    ref = run_with_grads(R.masked_vocab_loss, hidden, weight, labels, H, bias=b, grad_out=g.double(),
                         dtype=torch.float64, **opts)
    R.assert_same_nonfinite(ours[0], ref[0], name="loss", rtol=1e-5, atol=1e-6)
    assert ours[0][2:4].isinf().all()
    for name, o, r in zip(["d_hidden", "d_weight", "d_bias"], ours[1:], ref[1:]):
        assert_close_scaled(o, r, rtol=1e-5, atol=1e-6, name=name)


@pytest.mark.parametrize("ignore_index", [-100, 3])
@pytest.mark.parametrize("heads", [1, 2])
def test_ignored_rows_with_nan_hidden_contribute_nothing(heads, ignore_index):
    """Padding rows (ignored labels) whose hidden state is NaN/inf (fully masked attention) leave every
    gradient as with finite rows there, whether their token tile is all padding (skipped) or mixed.
    Eager torch makes dW NaN here (0 * NaN); the two backends used to disagree by tile layout.
    An ignore_index inside the vocabulary (3) must not make the ignored rows' label a target column."""
    N, D, V, R_ = 40, 8, 37, 3  # interpreter tiles: BLOCK_N = 16, so rows 16-31 form one tile
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, D, generator=g)
    w, bias = torch.randn(V, D, generator=g), torch.randn(V, generator=g)
    u, b = torch.randn(N, heads, R_, generator=g), torch.randn(V, R_, generator=g) * 0.3
    labels = torch.randint(0, V, (N,), generator=g)
    labels[labels == ignore_index] = 4
    labels[16:32] = ignore_index  # a tile of padding only
    labels[5] = ignore_index  # a padding row in a tile with counted tokens
    poisoned, up = x.clone(), u.clone()
    poisoned[[5, 20]], up[[5, 20]] = float("nan"), float("inf")

    def grads(hidden, uu, backend):
        leaves = [t.clone().requires_grad_() for t in (hidden, w, bias, uu, b)]
        loss = mhce(leaves[0], leaves[1], labels, heads, bias=leaves[2], low_rank=(leaves[3], leaves[4]),
                    ignore_index=ignore_index, backend=backend)
        loss.backward()
        return [loss] + [t.grad for t in leaves]

    names = ["loss", "dX", "dW", "dB", "dU", "dB_low"]
    for backend in ("torch", "triton"):
        for name, got, want in zip(names, grads(poisoned, up, backend), grads(x, u, backend)):
            if name in ("dX", "dU"):  # the ignored rows' own gradients are zero either way
                assert (got[[5, 20]] == 0).all() and (want[[5, 20]] == 0).all()
            assert_close_scaled(got, want, rtol=1e-6, atol=1e-7, name=f"{backend} {name}")
