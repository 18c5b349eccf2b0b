"""Input validation, the all-ignored batch, NaN propagation and autocast."""

import re

import pytest
import torch
import torch.nn.functional as F

import hf_mhce  # no importorskip: a broken package must fail, not skip
from hf_mhce.losses import dispatch
import reference as R
from reference import assert_no_worse_than_eager, make_inputs, run_with_grads

lce = hf_mhce.linear_cross_entropy
mhce = hf_mhce.multi_head_cross_entropy
mhlp = hf_mhce.multi_head_logprobs

# Both loss entry points, called the same way (H=1 for linear_cross_entropy, H=2 otherwise).
LOSSES = [
    pytest.param(lambda h, w, lab, **kw: lce(h, w, lab, **kw), id="linear_ce"),
    pytest.param(lambda h, w, lab, **kw: mhce(h, w, lab, 2, **kw), id="mhce_h2"),
]


def _ok_inputs(N=6, D=8, V=13, **kw):
    return make_inputs((N,), D, V, **kw)


# ------------------------------------------------------------------------------------------------
# Argument errors
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_fn", LOSSES)
@pytest.mark.parametrize("bad", [13, 12345, -7, -101])
def test_label_out_of_range(loss_fn, bad):
    hidden, weight, _, labels = _ok_inputs()
    labels[3] = bad
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        loss_fn(hidden, weight, labels, backend="torch")


@pytest.mark.parametrize("loss_fn", LOSSES)
@pytest.mark.parametrize("bad", [2**64 - 100, 2**63 + 5])
def test_uint64_labels_past_int64_are_out_of_range(loss_fn, bad):
    """uint64 labels are read as int64: 2**64 - 100 became -100 and was silently ignored."""
    hidden, weight, _, labels = _ok_inputs()
    values = labels.clamp_min(0).tolist()
    with pytest.raises(ValueError, match=f"label {bad} is outside the vocabulary"):
        loss_fn(hidden, weight, torch.tensor(values[:3] + [bad] + values[4:], dtype=torch.uint64), backend="torch")
    torch.testing.assert_close(loss_fn(hidden, weight, torch.tensor(values, dtype=torch.uint64), backend="torch"),
                               loss_fn(hidden, weight, torch.tensor(values), backend="torch"))  # in range: as int64


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_label_equal_to_default_ignore_is_out_of_range_with_custom_ignore(loss_fn):
    hidden, weight, _, labels = _ok_inputs()
    labels[2] = -100
    with pytest.raises(ValueError, match="-100"):
        loss_fn(hidden, weight, labels, ignore_index=-1, backend="torch")


@pytest.mark.parametrize("H", [0, -1, 3, 5, 16])
def test_bad_num_heads(H):
    hidden, weight, _, labels = _ok_inputs(D=8)
    with pytest.raises(ValueError):
        mhce(hidden, weight, labels, H, backend="torch")
    with pytest.raises(ValueError):
        mhlp(hidden, weight, H)


def _names_both(msg, a, b):
    return str(a) in msg and str(b) in msg


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_hidden_weight_dim_mismatch(loss_fn):
    hidden = torch.randn(6, 22)
    weight = torch.randn(13, 26)
    labels = torch.randint(0, 13, (6,))
    with pytest.raises(ValueError) as ei:
        loss_fn(hidden, weight, labels, backend="torch")
    assert _names_both(str(ei.value), 22, 26), str(ei.value)
    with pytest.raises(ValueError) as ei:
        mhlp(hidden, weight, 2)
    assert _names_both(str(ei.value), 22, 26), str(ei.value)


@pytest.mark.parametrize("loss_fn", LOSSES)
@pytest.mark.parametrize("labels_shape", [(3, 7), (15,), (3, 5, 1), (5, 3)])
def test_labels_shape_mismatch(loss_fn, labels_shape):
    hidden = torch.randn(3, 5, 8)
    weight = torch.randn(13, 8)
    labels = torch.randint(0, 13, labels_shape)
    with pytest.raises(ValueError) as ei:
        loss_fn(hidden, weight, labels, backend="torch")
    msg = str(ei.value)
    # names the labels' shape (as torch.Size / tuple / list: the numbers separated by commas)
    pattern = r",\s*".join(str(s) for s in labels_shape)
    if len(labels_shape) == 1:
        pattern = str(labels_shape[0])
    assert re.search(pattern, msg), msg


@pytest.mark.parametrize("loss_fn", LOSSES)
@pytest.mark.parametrize("bias_shape", [(14,), (1, 13), (12,)])
def test_bias_shape_mismatch(loss_fn, bias_shape):
    hidden, weight, _, labels = _ok_inputs(V=13)
    bias = torch.randn(bias_shape)
    with pytest.raises(ValueError) as ei:
        loss_fn(hidden, weight, labels, bias=bias, backend="torch")
    msg = str(ei.value)
    assert str(bias_shape[-1]) in msg and "13" in msg, msg
    with pytest.raises(ValueError):
        mhlp(hidden, weight, 2, bias=bias)


@pytest.mark.parametrize("loss_fn", LOSSES)
@pytest.mark.parametrize("hdt,wdt", [(torch.float32, torch.bfloat16), (torch.float16, torch.float32),
                                     (torch.bfloat16, torch.float16)])
def test_dtype_mismatch(loss_fn, hdt, wdt):
    hidden, weight, _, labels = _ok_inputs()
    with pytest.raises(TypeError) as ei:
        loss_fn(hidden.to(hdt), weight.to(wdt), labels, backend="torch")
    msg = str(ei.value)
    for dt in (hdt, wdt):
        name = str(dt).replace("torch.", "")
        # whole word: "float16" must not be satisfied by "bfloat16"
        assert re.search(r"(?<![A-Za-z])" + name + r"\b", msg), (name, msg)
    with pytest.raises(TypeError):
        mhlp(hidden.to(hdt), weight.to(wdt), 2)


@pytest.mark.parametrize("loss_fn", LOSSES)
@pytest.mark.parametrize("ldt", [torch.float32, torch.float64, torch.bool])
def test_non_integer_labels(loss_fn, ldt):
    hidden, weight, _, labels = _ok_inputs()
    with pytest.raises(TypeError):
        loss_fn(hidden, weight, labels.to(ldt), backend="torch")


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_bad_reduction(loss_fn):
    hidden, weight, _, labels = _ok_inputs()
    for red in ["avg", "elementwise_mean", ""]:
        with pytest.raises(ValueError):
            loss_fn(hidden, weight, labels, reduction=red, backend="torch")


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_bad_softcap(loss_fn):
    hidden, weight, _, labels = _ok_inputs()
    for cap in [0.0, -1.0, 0]:
        with pytest.raises(ValueError):
            loss_fn(hidden, weight, labels, softcap=cap, backend="torch")
        with pytest.raises(ValueError):
            mhlp(hidden, weight, 2, softcap=cap)


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_bad_label_smoothing(loss_fn):
    hidden, weight, _, labels = _ok_inputs()
    for eps in [-0.1, 1.5, float("nan")]:
        with pytest.raises(ValueError):
            loss_fn(hidden, weight, labels, label_smoothing=eps, backend="torch")
    # the end points are allowed
    for eps in [0.0, 1.0]:
        assert torch.isfinite(loss_fn(hidden, weight, labels, label_smoothing=eps, backend="torch"))


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_num_items_with_reduction_none(loss_fn):
    hidden, weight, _, labels = _ok_inputs()
    with pytest.raises(ValueError):
        loss_fn(hidden, weight, labels, reduction="none", num_items_in_batch=4, backend="torch")


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_unknown_backend(loss_fn, monkeypatch):
    hidden, weight, _, labels = _ok_inputs()
    with pytest.raises(ValueError):
        loss_fn(hidden, weight, labels, backend="cuda-magic")
    monkeypatch.setenv("HF_MHCE_BACKEND", "cuda-magic")  # the default comes from the environment
    with pytest.raises(ValueError):
        loss_fn(hidden, weight, labels)


def test_backend_from_environment(monkeypatch):
    hidden, weight, b, labels = make_inputs((9,), 8, 13, bias=True)
    expected = lce(hidden, weight, labels, bias=b, backend="torch")
    for value in ["torch", "auto", ""]:  # empty: the default, as for HF_MHCE_CHUNK_MB / HF_MHCE_WORKSPACE_MB
        monkeypatch.setenv("HF_MHCE_BACKEND", value)
        assert torch.equal(lce(hidden, weight, labels, bias=b), expected), value
    cpu = torch.device("cpu")
    for value in ["Torch", "AUTO"]:  # names are case-free, as an argument and in the environment
        assert dispatch.resolve(value, cpu, torch.float32) is dispatch._TORCH_OPS, value
        assert torch.equal(lce(hidden, weight, labels, bias=b, backend=value), expected), value
        monkeypatch.setenv("HF_MHCE_BACKEND", value)
        assert dispatch.resolve(None, cpu, torch.float32) is dispatch._TORCH_OPS, value


# ------------------------------------------------------------------------------------------------
# All labels ignored
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("H", [1, 2])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_all_ignored(H, reduction, dtype):
    hidden, weight, b, labels = make_inputs((2, 5), 8, 13, dtype=dtype, bias=True)
    labels.fill_(-100)
    g = torch.randn(2, 5) if reduction == "none" else torch.tensor(1.0)
    ours = run_with_grads(mhce, hidden, weight, labels, H, bias=b, grad_out=g, reduction=reduction,
                          label_smoothing=0.1, z_loss=1e-3, backend="torch")
    loss = ours[0]
    assert loss.dtype == torch.float32
    assert not torch.isnan(loss).any()
    assert (loss == 0).all()
    for gr in ours[1:]:
        assert gr is not None and not torch.isnan(gr).any() and (gr == 0).all()
    if reduction == "mean":
        # documents the difference: torch returns NaN (0/0) for an all-ignored mean
        logits = F.linear(hidden.float(), weight.float(), b.float())
        assert torch.isnan(F.cross_entropy(logits.reshape(-1, 13), labels.reshape(-1)))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("num_items", [0, torch.tensor(0)], ids=["int0", "tensor0"])
def test_all_ignored_num_items_zero(reduction, num_items):
    hidden, weight, b, labels = make_inputs((7,), 8, 13, bias=True)
    labels.fill_(-100)
    out = run_with_grads(lce, hidden, weight, labels, bias=b, reduction=reduction, num_items_in_batch=num_items,
                         backend="torch")
    assert out[0].item() == 0.0
    for gr in out[1:]:
        assert not torch.isnan(gr).any() and (gr == 0).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch(reduction):
    """Zero tokens: no label is a target, so like the all-ignored case (0, zero grads, no NaN)."""
    hidden = torch.randn(2, 0, 8, requires_grad=True)
    weight = torch.randn(13, 8, requires_grad=True)
    labels = torch.zeros(2, 0, dtype=torch.long)
    loss = lce(hidden, weight, labels, reduction=reduction, backend="torch")
    if reduction == "none":
        assert loss.shape == (2, 0)
        loss.sum().backward()
    else:
        assert loss.item() == 0.0
        loss.backward()
    assert weight.grad is not None and (weight.grad == 0).all()


def test_all_ignored_custom_index():
    hidden, weight, _, labels = make_inputs((7,), 8, 13)
    labels.fill_(4)
    out = run_with_grads(lce, hidden, weight, labels, ignore_index=4, backend="torch")
    assert out[0].item() == 0.0 and (out[1] == 0).all() and (out[2] == 0).all()


# ------------------------------------------------------------------------------------------------
# NaN propagation
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("H", [1, 2])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nan_in_hidden_propagates(H, reduction):
    hidden, weight, _, labels = make_inputs((6,), 8, 13)
    labels[3] = 5  # not ignored
    hidden[3, 1] = float("nan")
    loss = mhce(hidden, weight, labels, H, reduction=reduction, backend="torch")
    if reduction == "none":
        assert torch.isnan(loss[3])
        others = torch.ones(6, dtype=torch.bool)
        others[3] = False
        assert torch.isfinite(loss[others]).all()
    else:
        assert torch.isnan(loss)


def test_nan_in_weight_propagates():
    hidden, weight, _, labels = make_inputs((6,), 8, 13)
    weight[7, 0] = float("nan")  # every token's logsumexp sees it
    assert torch.isnan(lce(hidden, weight, labels, backend="torch"))


# ------------------------------------------------------------------------------------------------
# Autocast
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("H", [1, 2])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_autocast_bf16(H, reduction):
    """fp32 leaves, autocast to bf16: computed like nn.Linear under autocast (inputs cast to bf16),
    float32 loss, fp32 gradients on the fp32 leaves, no less accurate than eager autocast."""
    hidden, weight, b, labels = make_inputs((2, 17), 32, 211, bias=True, num_heads=H, ignore_frac=0.2)
    g = torch.randn(labels.shape) if reduction == "none" else torch.tensor(1.3)
    kw = dict(reduction=reduction, label_smoothing=0.1)

    def ours_fn(h, w, lab, bias=None, **k):
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            out = mhce(h, w, lab, H, bias=bias, backend="torch", **k)
        return out

    def eager_fn(h, w, lab, bias=None, **k):
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            if H == 1:
                logits = F.linear(h, w, bias)  # bf16 under autocast
                assert logits.dtype == torch.bfloat16
            else:
                logits = None
        if H == 1:
            flat = F.cross_entropy(logits.float().reshape(-1, w.shape[0]), lab.reshape(-1), reduction="none",
                                   label_smoothing=k["label_smoothing"])
            mask = lab.reshape(-1) != -100
            return R.reduce_loss(flat, mask, lab.shape, k["reduction"])
        return R.eager_loss(h.bfloat16(), w.bfloat16(), lab, H, bias=bias.bfloat16(), **k)

    ours = run_with_grads(ours_fn, hidden, weight, labels, bias=b, grad_out=g, **kw)
    eager = run_with_grads(eager_fn, hidden, weight, labels, bias=b, grad_out=g, **kw)
    # ground truth: the bf16-rounded inputs (what autocast feeds the matmul), in float64
    rounded = [t.bfloat16().double() for t in (hidden, weight, b)]
    ref = run_with_grads(R.reference_loss, rounded[0], rounded[1], labels, H, bias=rounded[2],
                         grad_out=g.double(), **kw)
    assert ours[0].dtype == torch.float32
    for name, o, e, r in zip(["loss", "d_hidden", "d_weight", "d_bias"], ours, eager, ref):
        if name != "loss":
            assert o.dtype == torch.float32, name  # fp32 leaves get fp32 grads
        assert_no_worse_than_eager(o, e, r, torch.bfloat16, name=name)


def test_autocast_bf16_hidden_fp32_weight():
    """A bf16 activation with an fp32 parameter is fine under autocast (as for nn.Linear)."""
    hidden, weight, b, labels = make_inputs((9,), 16, 37, bias=True)
    h = hidden.bfloat16().requires_grad_()
    w = weight.clone().requires_grad_()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        loss = lce(h, w, labels, bias=b, backend="torch")
        lp = mhlp(h, w, 2, bias=b)
    assert loss.dtype == torch.float32 and lp.dtype == torch.float32
    loss.backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    ref = R.reference_loss(h.detach().double(), weight.bfloat16().double(), labels, 1, bias=b.bfloat16().double())
    torch.testing.assert_close(loss.double(), ref, rtol=1e-2, atol=0)
    assert torch.isfinite(lp).all()
    torch.testing.assert_close(torch.logsumexp(lp, -1), torch.zeros(9), atol=1e-4, rtol=0)


@pytest.mark.parametrize("H", [1, 4])
def test_autocast_bf16_logprobs(H):
    hidden, weight, b, _ = make_inputs((2, 7), 32, 101, bias=True, num_heads=H)
    g = torch.randn(2, 7, 101)

    def ours_fn(h, w, _l, bias=None):
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            return mhlp(h, w, H, bias=bias)

    def eager_fn(h, w, _l, bias=None):
        return R.eager_logprobs(h.bfloat16(), w.bfloat16(), H, bias=bias.bfloat16())

    ours = run_with_grads(ours_fn, hidden, weight, None, bias=b, grad_out=g)
    eager = run_with_grads(eager_fn, hidden, weight, None, bias=b, grad_out=g)
    rounded = [t.bfloat16().double() for t in (hidden, weight, b)]
    ref = run_with_grads(lambda h, w, _l, bias=None: R.reference_logprobs(h, w, H, bias=bias),
                         rounded[0], rounded[1], None, bias=rounded[2], grad_out=g.double())
    assert ours[0].dtype == torch.float32
    for name, o, e, r in zip(["logprobs", "d_hidden", "d_weight", "d_bias"], ours, eager, ref):
        if name != "logprobs":
            assert o.dtype == torch.float32, name
        assert_no_worse_than_eager(o, e, r, torch.bfloat16, name=name)


# ------------------------------------------------------------------------------------------------
# backend="triton" on CPU tensors, torch.compile(fullgraph=True)
# ------------------------------------------------------------------------------------------------


@R.requires_triton
@pytest.mark.parametrize("kernels,env,why", [(False, "1", "set after"), (True, "0", "not set now"),
                                             (False, "0", "first imported$")])
def test_triton_on_cpu_needs_the_interpreter_from_import(kernels, env, why, monkeypatch):
    """triton.jit picks interpreted or compiled kernels when they are defined: TRITON_INTERPRET set
    later must give the library's message, not Triton's "0 active drivers" from a compiled kernel."""
    from hf_mhce.ops import triton_tile

    monkeypatch.setattr(triton_tile, "KERNELS_INTERPRETED", kernels)
    monkeypatch.setenv("TRITON_INTERPRET", env)
    hidden, weight, _, labels = _ok_inputs()
    with pytest.raises(ValueError, match=f"needs CUDA tensors.*TRITON_INTERPRET=1 before.*{why}"):
        lce(hidden, weight, labels, backend="triton")


def test_compile_fullgraph_says_why():
    """The loss is opaque to torch.compile (its sweeps run as they are): fullgraph=True cannot hold
    it, and dynamo's error carries the library's reason where torch accepts one."""
    import inspect

    hidden, weight, _, labels = _ok_inputs()
    f = torch.compile(lambda h: lce(torch.relu(h), weight, labels, backend="torch"), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="torch.compiler.disable") as err:
        f(hidden)
    if "reason" in inspect.signature(torch.compiler.disable).parameters:
        assert "outside torch.compile's graph" in str(err.value) and "fullgraph=False" in str(err.value)
