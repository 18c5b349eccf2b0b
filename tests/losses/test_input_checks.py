"""Inputs that used to reach the sweeps or give a silent number: meta tensors, sparse tensors, 8-bit floats, empty matrices,
non-finite or mistyped options, a bias of another dtype, integer types other than int, float64
under autocast, and a double backward."""

import numpy as np
import pytest
import torch

import hf_mhce
import reference as R
from reference import make_inputs, run_with_grads

lce = hf_mhce.linear_cross_entropy
mhce = hf_mhce.multi_head_cross_entropy
mhlp = hf_mhce.multi_head_logprobs


def _inputs(**kw):
    return make_inputs((6,), 8, 13, **kw)


@pytest.mark.parametrize("which", ["hidden", "weight", "labels", "all"])
def test_meta_tensors_are_named(which):
    hidden, weight, _, labels = _inputs()
    meta = {"hidden": hidden, "weight": weight, "labels": labels}
    for name in meta:
        if which in (name, "all"):
            meta[name] = meta[name].to("meta")
    with pytest.raises(ValueError, match=f"{'hidden' if which == 'all' else which} is on the meta device"):
        lce(meta["hidden"], meta["weight"], meta["labels"], backend="torch")
    if which in ("hidden", "weight"):
        with pytest.raises(ValueError, match="meta device"):
            mhlp(meta["hidden"], meta["weight"], 2)


@pytest.mark.parametrize("which", ["hidden", "weight", "labels"])
def test_sparse_tensors_are_named(which):
    hidden, weight, _, labels = _inputs()
    given = {"hidden": hidden, "weight": weight, "labels": labels}
    given[which] = given[which].to_sparse()
    with pytest.raises(ValueError, match=f"{which} has layout torch.sparse_coo: the fused losses take dense"):
        lce(given["hidden"], given["weight"], given["labels"], backend="torch")
    if which != "labels":
        with pytest.raises(ValueError, match=f"{which} has layout torch.sparse_coo"):
            mhlp(given["hidden"], given["weight"], 2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_eight_bit_floats_are_refused(dtype, backend):
    """torch's float8 matmul runs on the CPU, but its dX and dW in float8 lose a tenth of their value: refused by name."""
    hidden, weight, _, labels = _inputs()
    with pytest.raises(TypeError, match=f"hidden must be a float32, bfloat16, float16 or float64 tensor, got dtype {dtype}"):
        lce(hidden.to(dtype), weight.to(dtype), labels, backend=backend)
    with pytest.raises(TypeError, match="weight must be a float32"):
        mhlp(hidden, weight.to(dtype), 2)


@pytest.mark.parametrize("shape", [(0, 8), (13, 0)])
def test_empty_vocabulary_or_hidden_size(shape):
    hidden = torch.randn(6, shape[1])
    labels = torch.full((6,), -100)
    with pytest.raises(ValueError, match=r"vocabulary and a hidden size, got shape"):
        lce(hidden, torch.randn(*shape), labels, backend="torch")


@pytest.mark.parametrize("option,value,error,match", [
    ("softcap", float("inf"), ValueError, "finite positive"),
    ("z_loss", float("inf"), ValueError, "finite number >= 0"),
    ("z_loss", "0.1", TypeError, "z_loss must be a number"),
    ("label_smoothing", True, TypeError, "label_smoothing must be a number"),
    ("ignore_index", None, TypeError, "ignore_index must be an int"),
    ("ignore_index", 1.5, TypeError, "ignore_index must be an int"),
    ("ignore_index", 2**70, ValueError, "ignore_index must fit in int64"),
    ("ignore_index", 2**63, ValueError, "ignore_index must fit in int64"),  # the first value past int64
    ("num_items_in_batch", 2**70, ValueError, "count >= 0 that fits in int64, got 1180591620717411303424"),
    ("num_items_in_batch", 2**63, ValueError, "count >= 0 that fits in int64, got 9223372036854775808"),
    ("num_items_in_batch", 1e-300, ValueError, r"is 0 \(1e-300 given, as torch.float32\) but some labels"),
    ("num_items_in_batch", -3, ValueError, "count >= 0"),
    ("num_items_in_batch", torch.tensor(-3), ValueError, "count >= 0"),
    ("num_items_in_batch", float("nan"), ValueError, "count >= 0"),
    ("num_items_in_batch", float("inf"), ValueError, "finite count >= 0"),
    ("num_items_in_batch", torch.tensor(float("inf")), ValueError, "finite count >= 0"),
    ("num_items_in_batch", "5", TypeError, "number or a one-element tensor"),
    ("num_items_in_batch", torch.tensor([2, 3]), TypeError, "one-element real tensor"),
    ("num_items_in_batch", True, TypeError, "number or a one-element tensor"),
    ("backend", 1, ValueError, "backend must be one of"),
])
@pytest.mark.parametrize("heads", [1, 2])
def test_bad_options_are_named(option, value, error, match, heads):
    hidden, weight, _, labels = _inputs()
    with pytest.raises(error, match=match):
        mhce(hidden, weight, labels, heads, backend="torch", **{option: value}) if option != "backend" else \
            mhce(hidden, weight, labels, heads, backend=value)


@pytest.mark.parametrize("count", [4, 4.0, torch.tensor(4), torch.tensor([4.0]), np.int64(4)])
def test_item_counts_of_every_type(count):
    hidden, weight, _, labels = _inputs()
    got = lce(hidden, weight, labels, num_items_in_batch=count, backend="torch")
    torch.testing.assert_close(got, lce(hidden, weight, labels, reduction="sum", backend="torch") / 4)


def test_bias_of_another_dtype_is_refused():
    hidden, weight, b, labels = _inputs(bias=True)
    with pytest.raises(TypeError, match="bias has dtype torch.float64 but weight has torch.float32"):
        lce(hidden, weight, labels, bias=b.double(), backend="torch")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts all three (float64 excepted), as for nn.Linear
        assert torch.isfinite(lce(hidden, weight, labels, bias=b.half(), backend="torch"))


@pytest.mark.parametrize("heads", [np.int64(2), np.int32(2), torch.tensor(2)])
def test_integer_types_for_num_heads(heads):
    hidden, weight, _, labels = _inputs()
    torch.testing.assert_close(mhce(hidden, weight, labels, heads, backend="torch"),
                               mhce(hidden, weight, labels, 2, backend="torch"))
    assert mhlp(hidden, weight, heads).shape == (6, 13)
    with pytest.raises(ValueError, match="positive int"):
        mhce(hidden, weight, labels, torch.tensor(2.0), backend="torch")


@pytest.mark.parametrize("heads", [torch.tensor(True), torch.tensor([2]), np.bool_(True)])
def test_bool_and_non_scalar_num_heads_are_refused(heads):
    """operator.index took a bool tensor as 1 (a one-head 'MHCE', plain CE) and a one-element tensor as
    its value: neither is an integer count."""
    hidden, weight, _, labels = _inputs()
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        mhce(hidden, weight, labels, heads, backend="torch")


@pytest.mark.parametrize("heads", [1, 2])
def test_float64_untouched_by_autocast(heads):
    """autocast leaves float64 alone (nn.Linear's rule): the float64 result, not a bf16 one."""
    hidden, weight, b, labels = make_inputs((7,), 8, 29, bias=True, dtype=torch.float64, num_heads=heads)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = run_with_grads(mhce, hidden, weight, labels, heads, bias=b, backend="torch")
        logp = mhlp(hidden, weight, heads, bias=b)
    ref = run_with_grads(R.reference_loss, hidden, weight, labels, heads, bias=b)
    assert ours[0].dtype == logp.dtype == torch.float64
    for name, o, r in zip(["loss", "d_hidden", "d_weight", "d_bias"], ours, ref):
        torch.testing.assert_close(o, r, rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(logp, R.reference_logprobs(hidden, weight, heads, bias=b), rtol=1e-10, atol=1e-12)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            TypeError, match=r"got hidden torch.float64 and weight torch.bfloat16 under torch.autocast \(torch.autocast "
                             r"cast the other and leaves float64 alone: cast that one\)"):
        mhce(hidden, weight.float(), labels, heads, backend="torch")  # float32 as passed: autocast made it bf16


@pytest.mark.parametrize("fn", ["loss", "logprobs"])
def test_double_backward_is_refused(fn):
    """once_differentiable alone let create_graph=True through after a reduction, silently
    without the second-order terms; a single backward (retain_graph too) is unaffected."""
    hidden, weight, _, labels = _inputs()
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = lce(x, w, labels, backend="torch") if fn == "loss" else mhlp(x, w, 2)[:, 0].sum()
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(out, x, create_graph=True)
    (gx,) = torch.autograd.grad(out, x, retain_graph=True)
    assert torch.isfinite(gx).all() and gx.abs().sum() > 0


@pytest.mark.parametrize("fn", ["loss", "logprobs"])
def test_batched_gradients_are_refused_by_name(fn):
    """autograd.grad(..., is_grads_batched=True) failed deep inside: an in-place op of the torch sweep
    under vmap, a data pointer in the Triton path. One error now says what is not supported."""
    hidden, weight, _, labels = _inputs()
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = lce(x, w, labels, backend="torch") if fn == "loss" else mhlp(x, w, 2)[:, 0].sum()
    with pytest.raises(NotImplementedError, match="no batched backward.*is_grads_batched"):
        torch.autograd.grad(out, [x, w], grad_outputs=torch.tensor([1.0, 2.0]), is_grads_batched=True, retain_graph=True)
    (gx,) = torch.autograd.grad(out, x)  # the graph is intact: one gradient at a time works
    assert torch.isfinite(gx).all() and gx.abs().sum() > 0
