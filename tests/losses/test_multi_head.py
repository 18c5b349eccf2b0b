"""hf_mhce.multi_head_cross_entropy and hf_mhce.multi_head_logprobs, chunked torch backend.

Per-token MHCE loss (non-ignored token, target t, H heads, head logits y_h = softcap(x_h W_h^T + b)):
    (1-eps) * (-log mean_h softmax(y_h)_t) + eps * mean_h [lse_h - mean_j y_hj] + z * mean_h lse_h^2
"""

import math

import pytest
import torch
import torch.nn.functional as F

import hf_mhce  # no importorskip: a broken package must fail, not skip
import reference as R
from reference import (
    assert_close_scaled, assert_no_worse_than_eager, default_atol, grad_out_for, make_inputs, run_with_grads,
)

mhce = hf_mhce.multi_head_cross_entropy
mhlp = hf_mhce.multi_head_logprobs
lce = hf_mhce.linear_cross_entropy

REDUCTIONS = ["mean", "sum", "none"]




def _compare_fp32(hidden, weight, bias, labels, H, reduction, *, rtol=1e-5, atol=None, **kw):
    atol = default_atol(weight.shape[0]) if atol is None else atol
    g = grad_out_for(reduction, labels)
    ours = run_with_grads(mhce, hidden, weight, labels, H, bias=bias, grad_out=g, reduction=reduction,
                          backend="torch", **kw)
    ref = run_with_grads(R.reference_loss, hidden, weight, labels, H, bias=bias, grad_out=g.double(),
                         dtype=torch.float64, reduction=reduction, **kw)
    assert ours[0].dtype == torch.float32
    for name, o, r in zip(["loss", "d_hidden", "d_weight", "d_bias"], ours, ref):
        if r is None:
            assert o is None
            continue
        assert o.dtype == torch.float32, name
        assert_close_scaled(o, r, rtol=rtol, atol=atol, name=name)
    return ours, ref


# ------------------------------------------------------------------------------------------------
# The reference itself, validated by an independent formulation (explicit probabilities).
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("H", [1, 2, 4])
def test_reference_matches_explicit_mixture(H):
    N, D, V = 23, 16, 19
    hidden, weight, bias, labels = make_inputs(N, D, V, dtype=torch.float64, bias=True, num_heads=H,
                                               ignore_frac=0.3)
    c, eps, zl = 3.0, 0.15, 0.01
    d = D // H
    mask = labels != -100
    # head logits head by head, with F.linear on the column slices
    ys = [c * torch.tanh(F.linear(hidden[:, h * d:(h + 1) * d], weight[:, h * d:(h + 1) * d], bias) / c)
          for h in range(H)]
    pbar = torch.stack([torch.softmax(y, -1) for y in ys]).mean(0)  # [N, V]
    t = labels.clamp(min=0)
    nll = -torch.log(pbar.gather(1, t[:, None]).squeeze(1))
    # label smoothing per head = torch CE with label_smoothing=1 (uniform target), averaged
    smooth = torch.stack([F.cross_entropy(y, t, reduction="none", label_smoothing=1.0) for y in ys]).mean(0)
    zterm = torch.stack([torch.logsumexp(y, -1) ** 2 for y in ys]).mean(0)
    per_tok = torch.where(mask, (1 - eps) * nll + eps * smooth + zl * zterm, torch.zeros(()).double())
    kw = dict(bias=bias, softcap=c, label_smoothing=eps, z_loss=zl)
    torch.testing.assert_close(R.reference_loss(hidden, weight, labels, H, reduction="none", **kw), per_tok)
    torch.testing.assert_close(R.reference_loss(hidden, weight, labels, H, reduction="mean", **kw),
                               per_tok.sum() / mask.sum())
    torch.testing.assert_close(R.reference_logprobs(hidden, weight, H, bias=bias, softcap=c), torch.log(pbar))
    # brief's closed form: -log pbar_t = log H - logsumexp_h(y_ht - lse_h)
    y = torch.stack(ys, 1)
    lse = torch.logsumexp(y, -1)
    yt = y.gather(2, t[:, None, None].expand(N, H, 1)).squeeze(2)
    torch.testing.assert_close(math.log(H) - torch.logsumexp(yt - lse, 1), nll)


def test_reference_gradient_matches_responsibility_formula():
    """dL/dy_hj = r_h (p_hj - [j = t]), r_h = p_ht / sum_h' p_h't (BRIEF section 2)."""
    N, H, V = 6, 4, 11
    y = torch.randn(N, H, V, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, V, (N,))
    p = torch.softmax(y, -1)
    loss = -torch.log(p.gather(2, t[:, None, None].expand(N, H, 1)).squeeze(2).mean(1)).sum()
    (gy,) = torch.autograd.grad(loss, y)
    pt = p.gather(2, t[:, None, None].expand(N, H, 1)).squeeze(2)
    r = pt / pt.sum(1, keepdim=True)
    onehot = F.one_hot(t, V).double()[:, None, :]
    torch.testing.assert_close(gy, r[..., None] * (p - onehot))
    # and the reference's per-token loss equals that same expression
    lse = torch.logsumexp(y, -1)
    yt = y.gather(2, t[:, None, None].expand(N, H, 1)).squeeze(2)
    torch.testing.assert_close(-(torch.logsumexp(yt - lse, 1) - math.log(H)).sum(), loss)


# ------------------------------------------------------------------------------------------------
# H = 1 is exactly linear_cross_entropy
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_one_head_is_exactly_linear_cross_entropy(reduction):
    hidden, weight, b, labels = make_inputs((3, 11), 33, 211, bias=True, ignore_frac=0.2)
    g = grad_out_for(reduction, labels)
    kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3, softcap=5.0, backend="torch")
    a = run_with_grads(mhce, hidden, weight, labels, 1, bias=b, grad_out=g, **kw)
    c = run_with_grads(lce, hidden, weight, labels, bias=b, grad_out=g, **kw)
    for name, x, y in zip(["loss", "dh", "dw", "db"], a, c):
        assert torch.equal(x, y), name


# ------------------------------------------------------------------------------------------------
# fp32 against the reference
# ------------------------------------------------------------------------------------------------

SHAPES = [
    pytest.param((1,), 16, 7, id="N1-V7"),
    pytest.param((37,), 64, 1031, id="N37-V1031-D64"),
    pytest.param((3, 13), 32, 97, id="B3xT13-V97"),
]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("H", [2, 4, 8])
@pytest.mark.parametrize("lead,D,V", SHAPES)
def test_fp32_matches_reference(lead, D, V, H, reduction, bias):
    hidden, weight, b, labels = make_inputs(lead, D, V, bias=bias, num_heads=H,
                                            ignore_frac=0.0 if lead == (1,) else 0.25)
    (loss, *_), _ = _compare_fp32(hidden, weight, b, labels, H, reduction)
    if reduction == "none":
        assert loss.shape == labels.shape
        assert (loss[labels == -100] == 0).all()


@pytest.mark.parametrize("H", [2, 4, 8])
def test_fp32_large_vocab(H):
    hidden, weight, b, labels = make_inputs((37,), 48, 50257, bias=True, num_heads=H, ignore_frac=0.2)
    _compare_fp32(hidden, weight, b, labels, H, "none", label_smoothing=0.1, z_loss=1e-4)


@pytest.mark.parametrize("D,H", [(33, 3), (30, 5), (36, 6)], ids=["D33H3", "D30H5", "D36H6"])
def test_fp32_odd_head_sizes(D, H):
    hidden, weight, b, labels = make_inputs((37,), D, 1031, bias=True, num_heads=H, ignore_frac=0.2)
    _compare_fp32(hidden, weight, b, labels, H, "mean", label_smoothing=0.1)


@pytest.mark.parametrize(
    "opts",
    [
        dict(label_smoothing=0.1),
        dict(label_smoothing=1.0),
        dict(z_loss=1e-3),
        dict(z_loss=0.5),
        dict(softcap=3.0),
        dict(label_smoothing=0.2, z_loss=1e-2, softcap=2.0),
    ],
    ids=["ls0.1", "ls1", "z1e-3", "z0.5", "cap3", "all"],
)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("H", [2, 4])
def test_fp32_options(opts, reduction, H):
    hidden, weight, b, labels = make_inputs((37,), 64, 1031, bias=True, num_heads=H, ignore_frac=0.2,
                                            logit_std=3.0)
    _compare_fp32(hidden, weight, b, labels, H, reduction, **opts)


@pytest.mark.parametrize("ignore_index", [-1, 5])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_custom_ignore_index(ignore_index, reduction):
    hidden, weight, b, labels = make_inputs((4, 9), 32, 31, bias=True, num_heads=4, ignore_frac=0.3,
                                            ignore_index=ignore_index)
    if ignore_index == 5:
        labels[1, :3] = 5
    (loss, *_), _ = _compare_fp32(hidden, weight, b, labels, 4, reduction, ignore_index=ignore_index,
                                  label_smoothing=0.1, z_loss=1e-3)
    if reduction == "none":
        assert (loss[labels == ignore_index] == 0).all()


@pytest.mark.parametrize("as_tensor", [False, True], ids=["int", "tensor"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_num_items_in_batch(as_tensor, reduction):
    hidden, weight, b, labels = make_inputs((2, 19), 32, 211, bias=True, num_heads=4, ignore_frac=0.3)
    n = 77
    (loss, *_), _ = _compare_fp32(hidden, weight, b, labels, 4, reduction,
                                  num_items_in_batch=torch.tensor(n) if as_tensor else n, label_smoothing=0.1)
    total = R.reference_loss(hidden.double(), weight.double(), labels, 4, bias=b.double(), reduction="sum",
                             label_smoothing=0.1)
    torch.testing.assert_close(loss.double(), total / n, rtol=1e-5, atol=0)


def test_float64_inputs_give_float64():
    hidden, weight, b, labels = make_inputs((37,), 64, 1031, dtype=torch.float64, bias=True, num_heads=4,
                                            ignore_frac=0.2)
    g = torch.randn(labels.shape, dtype=torch.float64)
    kw = dict(reduction="none", label_smoothing=0.1, z_loss=1e-3, softcap=5.0)
    ours = run_with_grads(mhce, hidden, weight, labels, 4, bias=b, grad_out=g, backend="torch", **kw)
    ref = run_with_grads(R.reference_loss, hidden, weight, labels, 4, bias=b, grad_out=g, **kw)
    for name, o, r in zip(["loss", "dh", "dw", "db"], ours, ref):
        assert o.dtype == torch.float64, name
        assert_close_scaled(o, r, rtol=1e-10, atol=1e-12, name=name)


def test_heads_far_apart_stay_stable():
    """One head much more confident than the others (log p_ht differ by ~100s): the two-level
    logsumexp must not underflow to log(0)."""
    H, D, V = 4, 32, 257
    hidden, weight, b, labels = make_inputs((37,), D, V, bias=False, num_heads=H)
    weight = weight.clone()
    weight[:, :8] *= 25.0  # head 0 logits std ~40; others ~1.5
    y = R.head_logits(hidden.double(), weight.double(), H)
    logp_t = torch.log_softmax(y, -1).gather(2, labels[:, None, None].expand(-1, H, 1)).squeeze(2)
    # some targets are hopeless under head 0 (log p < -100) but ordinary under the others
    assert logp_t[:, 0].min() < -100 and logp_t[:, 1:].min() > -30
    _compare_fp32(hidden, weight, None, labels, H, "none", rtol=1e-4, atol=1e-5)


def test_tiny_chunks_match_reference(monkeypatch):
    hidden, weight, b, labels = make_inputs((37,), 64, 1031, bias=True, num_heads=4, ignore_frac=0.2,
                                            logit_std=3.0)
    monkeypatch.setenv("HF_MHCE_CHUNK_MB", "0.01")
    for reduction in ["mean", "none"]:
        _compare_fp32(hidden, weight, b, labels, 4, reduction, label_smoothing=0.1, z_loss=1e-3, softcap=4.0)


# ------------------------------------------------------------------------------------------------
# bf16 / fp16
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("H", [2, 4])
def test_low_precision_vs_eager(dtype, reduction, H):
    hidden, weight, b, labels = make_inputs((2, 29), 64, 1031, dtype=dtype, bias=True, num_heads=H,
                                            ignore_frac=0.2, logit_std=3.0)
    g = grad_out_for(reduction, labels)
    kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    ours = run_with_grads(mhce, hidden, weight, labels, H, bias=b, grad_out=g, backend="torch", **kw)
    eager = run_with_grads(R.eager_loss, hidden, weight, labels, H, bias=b, grad_out=g, **kw)
    ref = run_with_grads(R.reference_loss, hidden, weight, labels, H, bias=b, grad_out=g.double(),
                         dtype=torch.float64, **kw)
    assert ours[0].dtype == torch.float32
    assert ours[1].dtype == dtype and ours[2].dtype == dtype and ours[3].dtype == dtype
    for name, o, e, r in zip(["loss", "d_hidden", "d_weight", "d_bias"], ours, eager, ref):
        assert_no_worse_than_eager(o, e, r, dtype, name=name)


# ------------------------------------------------------------------------------------------------
# multi_head_logprobs
# ------------------------------------------------------------------------------------------------


def _lp_compare(hidden, weight, b, H, *, softcap=None, rtol=1e-5, atol=1e-6):
    V = weight.shape[0]
    g = torch.randn(*hidden.shape[:-1], V)

    def f(h, w, _labels, H, bias=None):
        return mhlp(h, w, H, bias=bias, softcap=softcap)

    def fr(h, w, _labels, H, bias=None):
        return R.reference_logprobs(h, w, H, bias=bias, softcap=softcap)

    ours = run_with_grads(f, hidden, weight, None, H, bias=b, grad_out=g)
    ref = run_with_grads(fr, hidden, weight, None, H, bias=b, grad_out=g.double(), dtype=torch.float64)
    assert ours[0].shape == (*hidden.shape[:-1], V)
    for name, o, r in zip(["logprobs", "d_hidden", "d_weight", "d_bias"], ours, ref):
        if r is None:
            continue
        assert o.dtype == torch.float32, name
        assert_close_scaled(o, r, rtol=rtol, atol=atol, name=name)
    return ours


@pytest.mark.parametrize("softcap", [None, 4.0], ids=["nocap", "cap4"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_logprobs_one_head_is_log_softmax(bias, softcap):
    hidden, weight, b, _ = make_inputs((37,), 33, 1031, bias=bias)
    out = mhlp(hidden, weight, 1, bias=b, softcap=softcap)
    z = F.linear(hidden.double(), weight.double(), None if b is None else b.double())
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    assert out.dtype == torch.float32
    assert_close_scaled(out, torch.log_softmax(z, -1), name="logprobs")
    _lp_compare(hidden, weight, b, 1, softcap=softcap)


@pytest.mark.parametrize("H", [2, 4, 8])
@pytest.mark.parametrize("lead", [(37,), (3, 13), (1,)], ids=["N37", "B3xT13", "N1"])
def test_logprobs_match_reference(H, lead):
    hidden, weight, b, _ = make_inputs(lead, 64, 523, bias=True, num_heads=H)
    out, *_ = _lp_compare(hidden, weight, b, H, softcap=6.0)
    # a proper distribution over V
    torch.testing.assert_close(torch.logsumexp(out.double(), -1), torch.zeros(lead, dtype=torch.float64),
                               atol=1e-5, rtol=0)


def test_logprobs_consistent_with_loss():
    """loss(reduction='none') == -logprobs[target] without smoothing / z-loss."""
    H = 4
    hidden, weight, b, labels = make_inputs((3, 13), 64, 523, bias=True, num_heads=H, ignore_frac=0.2)
    lp = mhlp(hidden, weight, H, bias=b, softcap=6.0)
    loss = mhce(hidden, weight, labels, H, bias=b, softcap=6.0, reduction="none", backend="torch")
    mask = labels != -100
    picked = -lp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    torch.testing.assert_close(loss[mask], picked[mask], rtol=1e-5, atol=1e-5)


def test_logprobs_float64():
    hidden, weight, b, _ = make_inputs((11,), 16, 97, dtype=torch.float64, bias=True, num_heads=2)
    out = mhlp(hidden, weight, 2, bias=b)
    assert out.dtype == torch.float64
    assert_close_scaled(out, R.reference_logprobs(hidden, weight, 2, bias=b), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_logprobs_low_precision(dtype):
    H = 4
    hidden, weight, b, _ = make_inputs((2, 9), 64, 523, dtype=dtype, bias=True, num_heads=H)
    g = torch.randn(2, 9, 523)

    def f(h, w, _l, bias=None):
        return mhlp(h, w, H, bias=bias)

    def fe(h, w, _l, bias=None):
        return R.eager_logprobs(h, w, H, bias=bias)

    ours = run_with_grads(f, hidden, weight, None, bias=b, grad_out=g)
    eager = run_with_grads(fe, hidden, weight, None, bias=b, grad_out=g)
    ref = run_with_grads(fe, hidden, weight, None, bias=b, grad_out=g.double(), dtype=torch.float64)
    assert ours[0].dtype == torch.float32
    assert ours[1].dtype == dtype and ours[2].dtype == dtype
    for name, o, e, r in zip(["logprobs", "d_hidden", "d_weight", "d_bias"], ours, eager, ref):
        assert_no_worse_than_eager(o, e, r, dtype, name=name)
