"""hf_mhce.linear_cross_entropy (H=1), chunked torch backend, against the float64 reference.

fp32: loss and gradients (hidden, weight, bias) to rtol 1e-5 with an absolute slack of 1e-6 times
the tensor's largest entry (see reference.assert_close_scaled).  bf16/fp16: no less accurate than
the eager transformers recipe in the same dtype (see reference.low_precision_tol).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import reference as R
from reference import (
    assert_close_scaled, assert_no_worse_than_eager, default_atol, grad_out_for, make_inputs, run_with_grads,
)

import hf_mhce  # noqa: E402  (no importorskip: a broken package must fail, not skip)

lce = hf_mhce.linear_cross_entropy

REDUCTIONS = ["mean", "sum", "none"]




def _compare_fp32(fn, ref_fn, hidden, weight, bias, labels, reduction, *args, rtol=1e-5, atol=None, **kw):
    atol = default_atol(weight.shape[0]) if atol is None else atol
    g = grad_out_for(reduction, labels)
    ours = run_with_grads(fn, hidden, weight, labels, *args, bias=bias, grad_out=g, reduction=reduction, **kw)
    kw.pop("backend", None)
    ref = run_with_grads(
        ref_fn, hidden, weight, labels, *args, bias=bias, grad_out=g.double(), dtype=torch.float64,
        reduction=reduction, **kw,
    )
    assert ours[0].dtype == torch.float32
    assert ours[0].shape == ref[0].shape
    names = ["loss", "d_hidden", "d_weight", "d_bias"]
    for name, o, r in zip(names, ours, ref):
        if r is None:
            assert o is None
            continue
        if name != "loss":
            assert o.dtype == torch.float32, name
        assert_close_scaled(o, r, rtol=rtol, atol=atol, name=name)
    return ours, ref


# ------------------------------------------------------------------------------------------------
# The reference itself, validated against torch.nn.functional.cross_entropy (H=1).
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_reference_matches_torch_cross_entropy(reduction, label_smoothing, ignore_index):
    hidden, weight, bias, labels = make_inputs((3, 11), 12, 17, dtype=torch.float64, bias=True,
                                               ignore_frac=0.3, ignore_index=ignore_index)
    if ignore_index == 3:
        labels[0, :4] = 3  # a valid class id used as the ignore index
    g = grad_out_for(reduction, labels, torch.float64)

    def torch_ce(h, w, lab, bias=None, reduction="mean"):
        logits = F.linear(h, w, bias)
        out = F.cross_entropy(logits.reshape(-1, w.shape[0]), lab.reshape(-1), ignore_index=ignore_index,
                              reduction=reduction, label_smoothing=label_smoothing)
        return out.reshape(lab.shape) if reduction == "none" else out

    expected = run_with_grads(torch_ce, hidden, weight, labels, bias=bias, grad_out=g, reduction=reduction)
    got = run_with_grads(R.reference_loss, hidden, weight, labels, 1, bias=bias, grad_out=g, reduction=reduction,
                         ignore_index=ignore_index, label_smoothing=label_smoothing)
    for name, e, o in zip(["loss", "dh", "dw", "db"], expected, got):
        torch.testing.assert_close(o, e, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_reference_z_loss_softcap_num_items_match_torch():
    hidden, weight, bias, labels = make_inputs(29, 10, 23, dtype=torch.float64, bias=True, ignore_frac=0.3)
    c, zl, n_items = 2.5, 1e-2, 41
    logits = c * torch.tanh(F.linear(hidden, weight, bias) / c)
    mask = labels != -100
    ce_sum = F.cross_entropy(logits, labels, reduction="sum", label_smoothing=0.1)
    lse = torch.logsumexp(logits, -1)
    expected_sum = ce_sum + zl * (lse[mask] ** 2).sum()
    kw = dict(bias=bias, softcap=c, z_loss=zl, label_smoothing=0.1)
    torch.testing.assert_close(R.reference_loss(hidden, weight, labels, 1, reduction="sum", **kw), expected_sum)
    torch.testing.assert_close(R.reference_loss(hidden, weight, labels, 1, reduction="mean", **kw),
                               expected_sum / mask.sum())
    torch.testing.assert_close(
        R.reference_loss(hidden, weight, labels, 1, reduction="mean", num_items_in_batch=n_items, **kw),
        expected_sum / n_items)
    torch.testing.assert_close(
        R.reference_loss(hidden, weight, labels, 1, reduction="sum", num_items_in_batch=torch.tensor(n_items), **kw),
        expected_sum / n_items)
    # log-probs reference, H=1: log_softmax of the (soft-capped) logits.
    torch.testing.assert_close(R.reference_logprobs(hidden, weight, 1, bias=bias, softcap=c),
                               torch.log_softmax(logits, -1))


# ------------------------------------------------------------------------------------------------
# fp32 against the reference
# ------------------------------------------------------------------------------------------------

SHAPES = [
    pytest.param((1,), 8, 7, id="N1-V7"),
    pytest.param((5,), 16, 7, id="N5-V7"),
    pytest.param((37,), 33, 1031, id="N37-V1031-D33"),
    pytest.param((37,), 48, 50257, id="N37-V50257-D48"),
    pytest.param((3, 13), 24, 97, id="B3xT13-V97"),
]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("lead,D,V", SHAPES)
def test_fp32_matches_reference(lead, D, V, reduction, bias):
    ignore_frac = 0.0 if lead == (1,) else 0.25
    hidden, weight, b, labels = make_inputs(lead, D, V, bias=bias, ignore_frac=ignore_frac)
    (loss, *_), _ = _compare_fp32(lce, R.reference_loss, hidden, weight, b, labels, reduction, backend="torch")
    if reduction == "none":
        assert loss.shape == labels.shape
        assert (loss[labels == -100] == 0).all()
    else:
        assert loss.dim() == 0


@pytest.mark.parametrize(
    "opts",
    [
        dict(label_smoothing=0.1),
        dict(label_smoothing=1.0),
        dict(z_loss=1e-3),
        dict(z_loss=0.5),
        dict(softcap=3.0),
        dict(softcap=30.0),
        dict(label_smoothing=0.2, z_loss=1e-2, softcap=2.0),
    ],
    ids=["ls0.1", "ls1", "z1e-3", "z0.5", "cap3", "cap30", "all"],
)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_fp32_options(opts, reduction, bias):
    hidden, weight, b, labels = make_inputs((37,), 33, 1031, bias=bias, ignore_frac=0.2, logit_std=3.0)
    _compare_fp32(lce, R.reference_loss, hidden, weight, b, labels, reduction, backend="torch", **opts)


@pytest.mark.parametrize("ignore_index", [-1, 5, 1000])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_custom_ignore_index(ignore_index, reduction):
    hidden, weight, b, labels = make_inputs((4, 9), 16, 31, bias=True, ignore_frac=0.3, ignore_index=ignore_index)
    if 0 <= ignore_index < 31:
        labels[1, :3] = ignore_index  # a valid class id that must nonetheless be skipped
    # -100 is an ordinary (out of range) label here, so it must not appear
    assert not (labels == -100).any()
    (loss, *_), _ = _compare_fp32(lce, R.reference_loss, hidden, weight, b, labels, reduction,
                                  ignore_index=ignore_index, label_smoothing=0.1, backend="torch")
    if reduction == "none":
        assert (loss[labels == ignore_index] == 0).all()


@pytest.mark.parametrize("as_tensor", [False, True], ids=["int", "tensor"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_num_items_in_batch(as_tensor, reduction):
    hidden, weight, b, labels = make_inputs((2, 19), 32, 211, bias=True, ignore_frac=0.3)
    n = 123  # deliberately different from the number of non-ignored tokens
    num_items = torch.tensor(n) if as_tensor else n
    (loss, *_), (ref, *_) = _compare_fp32(lce, R.reference_loss, hidden, weight, b, labels, reduction,
                                          num_items_in_batch=num_items, z_loss=1e-3, backend="torch")
    total = R.reference_loss(hidden.double(), weight.double(), labels, 1, bias=b.double(), reduction="sum",
                             z_loss=1e-3)
    torch.testing.assert_close(loss.double(), total / n, rtol=1e-5, atol=0)


def test_default_backend_on_cpu_is_torch_path():
    hidden, weight, b, labels = make_inputs((37,), 33, 1031, bias=True, ignore_frac=0.2)
    a = run_with_grads(lce, hidden, weight, labels, bias=b, backend="torch", label_smoothing=0.1)
    c = run_with_grads(lce, hidden, weight, labels, bias=b, label_smoothing=0.1)
    for x, y in zip(a, c):
        assert torch.equal(x, y)


def test_noncontiguous_inputs():
    """hidden[:, :-1] (the usual shift) and a transposed-storage weight."""
    B, T, D, V = 3, 12, 24, 101
    big = torch.randn(B, T + 1, D)
    hidden = big[:, :-1, :]
    assert not hidden.is_contiguous()
    weight = (torch.randn(D, V) / math.sqrt(D)).t()
    assert not weight.is_contiguous()
    labels = torch.randint(0, V, (B, T + 1))[:, 1:]  # shifted labels: non-contiguous too
    assert not labels.is_contiguous()
    labels[0, :3] = -100
    for reduction in ["mean", "none"]:
        _compare_fp32(lce, R.reference_loss, hidden, weight, None, labels, reduction, backend="torch",
                      label_smoothing=0.1)


def test_large_logits_are_stable():
    """Logits of magnitude ~100: a naive exp overflows in fp32 (exp(100) ~ 2.7e43 fits, exp(200)
    doesn't); online logsumexp must subtract the running max."""
    hidden, weight, b, labels = make_inputs((37,), 33, 1031, bias=True, ignore_frac=0.2, logit_std=40.0)
    assert R.head_logits(hidden, weight, 1, bias=b).abs().max() > 100
    # Looser than elsewhere on purpose: merely rounding logits of magnitude ~100 to fp32 moves them
    # by ~1e-5, which an exact fp32 eager computation already turns into ~1e-4 relative gradient
    # errors.  The point here is no overflow / NaN and the right values to fp32 conditioning.
    _compare_fp32(lce, R.reference_loss, hidden, weight, b, labels, "none", backend="torch", z_loss=1e-4,
                  rtol=1e-3, atol=1e-5)


def test_float64_inputs_give_float64():
    hidden, weight, b, labels = make_inputs((37,), 33, 1031, dtype=torch.float64, bias=True, ignore_frac=0.2)
    g = torch.randn(labels.shape, dtype=torch.float64)
    kw = dict(reduction="none", label_smoothing=0.1, z_loss=1e-3, softcap=5.0)
    ours = run_with_grads(lce, hidden, weight, labels, bias=b, grad_out=g, backend="torch", **kw)
    ref = run_with_grads(R.reference_loss, hidden, weight, labels, 1, bias=b, grad_out=g, **kw)
    for name, o, r in zip(["loss", "dh", "dw", "db"], ours, ref):
        assert o.dtype == torch.float64, name
        assert_close_scaled(o, r, rtol=1e-10, atol=1e-12, name=name)


# ------------------------------------------------------------------------------------------------
# Chunking: force many token and vocabulary chunks
# ------------------------------------------------------------------------------------------------


class _CountMatmuls(TorchDispatchMode):
    OPS = {"mm", "addmm", "bmm", "baddbmm"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _count_matmuls(fn):
    with _CountMatmuls() as m:
        fn()
    return m.count


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_tiny_chunks_match_reference(monkeypatch, reduction, single_thread):
    # logits would be 37 x 1031 x 4 B = 150 KB; 0.01 MB = 10 KB chunks force many token and/or
    # vocabulary chunks (hundreds of tiny blocks: one intra-op thread, see the single_thread fixture).
    hidden, weight, b, labels = make_inputs((37,), 33, 1031, bias=True, ignore_frac=0.2, logit_std=3.0)
    kw = dict(label_smoothing=0.1, z_loss=1e-3, softcap=4.0)

    def once():
        _compare_fp32(lce, R.reference_loss, hidden, weight, b, labels, reduction, backend="torch", **kw)

    n_default = _count_matmuls(once)
    monkeypatch.setenv("HF_MHCE_CHUNK_MB", "0.01")  # read on every call
    n_tiny = _count_matmuls(once)
    # The reference itself is a fixed number of matmuls; the op must have split its work further.
    assert n_tiny > n_default + 4, (n_tiny, n_default)


# ------------------------------------------------------------------------------------------------
# bf16 / fp16: no worse than eager in the same dtype
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_low_precision_vs_eager(dtype, reduction, bias):
    hidden, weight, b, labels = make_inputs((2, 29), 64, 1031, dtype=dtype, bias=bias, ignore_frac=0.2,
                                            logit_std=3.0)
    g = grad_out_for(reduction, labels)
    kw = dict(reduction=reduction, label_smoothing=0.1)
    ours = run_with_grads(lce, hidden, weight, labels, bias=b, grad_out=g, backend="torch", **kw)
    eager = run_with_grads(R.eager_loss, hidden, weight, labels, bias=b, grad_out=g, **kw)
    # ground truth: the same (already rounded) inputs, in float64
    ref = run_with_grads(R.reference_loss, hidden, weight, labels, 1, bias=b, grad_out=g.double(),
                         dtype=torch.float64, **kw)
    assert ours[0].dtype == torch.float32
    assert ours[1].dtype == dtype and ours[2].dtype == dtype
    if bias:
        assert ours[3].dtype == dtype
    for name, o, e, r in zip(["loss", "d_hidden", "d_weight", "d_bias"], ours, eager, ref):
        if r is None:
            continue
        assert_no_worse_than_eager(o, e, r, dtype, name=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_options_vs_eager(dtype):
    hidden, weight, b, labels = make_inputs((37,), 48, 50257, dtype=dtype, bias=True, ignore_frac=0.2)
    g = grad_out_for("none", labels)
    kw = dict(reduction="none", label_smoothing=0.1, z_loss=1e-3, softcap=10.0)
    ours = run_with_grads(lce, hidden, weight, labels, bias=b, grad_out=g, backend="torch", **kw)
    eager = run_with_grads(R.eager_loss, hidden, weight, labels, bias=b, grad_out=g, **kw)
    ref = run_with_grads(R.reference_loss, hidden, weight, labels, 1, bias=b, grad_out=g.double(),
                         dtype=torch.float64, **kw)
    assert ours[0].dtype == torch.float32
    for name, o, e, r in zip(["loss", "d_hidden", "d_weight", "d_bias"], ours, eager, ref):
        assert_no_worse_than_eager(o, e, r, dtype, name=name)


@pytest.mark.parametrize("which", ["hidden", "weight", "bias", "hidden+bias", "weight+bias"])
@pytest.mark.parametrize("H", [1, 4])
def test_partial_requires_grad(which, H):
    """Frozen lm_head (only hidden needs a gradient), frozen trunk, bias only, ..."""
    hidden, weight, b, labels = make_inputs((3, 11), 32, 211, bias=True, num_heads=H, ignore_frac=0.2)
    leaves = {"hidden": hidden.clone(), "weight": weight.clone(), "bias": b.clone()}
    for k in which.split("+"):
        leaves[k].requires_grad_()
    g = torch.randn(3, 11)
    kw = dict(reduction="none", label_smoothing=0.1, z_loss=1e-3, softcap=5.0)
    out = hf_mhce.multi_head_cross_entropy(leaves["hidden"], leaves["weight"], labels, H, bias=leaves["bias"],
                                           backend="torch", **kw)
    out.backward(g)
    ref = run_with_grads(R.reference_loss, hidden, weight, labels, H, bias=b, grad_out=g.double(),
                         dtype=torch.float64, **kw)
    for i, k in enumerate(["hidden", "weight", "bias"]):
        if k in which.split("+"):
            assert_close_scaled(leaves[k].grad, ref[1 + i], name=f"d_{k}")
        else:
            assert leaves[k].grad is None


def test_no_grad_forward_only():
    hidden, weight, b, labels = make_inputs((37,), 33, 1031, bias=True, ignore_frac=0.2)
    with torch.no_grad():
        loss = lce(hidden.requires_grad_(), weight.requires_grad_(), labels, bias=b, backend="torch")
    assert not loss.requires_grad
    ref = R.reference_loss(hidden.detach().double(), weight.detach().double(), labels, 1, bias=b.double())
    assert_close_scaled(loss, ref, name="loss")
