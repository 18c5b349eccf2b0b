"""The ``low_rank`` pair (U [..., H, R], B [V, R]): head h's logits gain U_h B^T.

The ground truth is the float64 reference on the widened operands it stands for: head h of the
widened input is [x_h, U_h] and of the widened weight [W_h, B], the fold a LoRA adapter on the head
used to need.  Both backends, odd sizes (N = 1, V and D not multiples of any block, R = 1 and R
above one K block), every gradient (dX, dW, dB, dU, dB_low) and the needs-grad combinations of a
frozen base weight; and ``multi_head_logprobs`` with the pair (the mixture logits of a LoRA head).
"""

import pytest
import torch

import hf_mhce
from hf_mhce.losses import collect_ranks
import reference as R
from reference import HAVE_TRITON, assert_close_scaled, assert_no_worse_than_eager, default_atol

mhce = hf_mhce.multi_head_cross_entropy
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAVE_TRITON, reason="no triton"))]


def _widen(x, w, u, b, heads):
    """(x', w') with x' w'^T per head = x_h W_h^T + U_h B^T."""
    v, d = w.shape
    xs = torch.cat([x.unflatten(-1, (heads, d // heads)), u], dim=-1).flatten(-2)
    bs = b.unsqueeze(1).expand(v, heads, b.shape[1])
    ws = torch.cat([w.unflatten(-1, (heads, d // heads)), bs], dim=-1).flatten(-2)
    return xs, ws


def _inputs(lead, d, v, heads, rank, dtype=torch.float32, ignore=True):
    x = torch.randn(*lead, d)
    w = torch.randn(v, d) / (d // heads) ** 0.5
    u = torch.randn(*lead, heads, rank)
    b = torch.randn(v, rank) / rank ** 0.5
    bias = torch.randn(v) * 0.5
    labels = torch.randint(0, v, lead)
    if ignore:
        labels.view(-1)[1::3] = -100
    labels.view(-1)[0] = v - 1  # the last (partial) vocabulary block holds a target
    return [t.to(dtype) for t in (x, w, u, b, bias)] + [labels]


def _grads(fn, tensors, grad_mask, **kw):
    leaves = [t.detach().clone().requires_grad_(m) for t, m in zip(tensors, grad_mask)]
    loss = fn(*leaves, **kw)
    (loss * 1.7).backward()
    return loss.detach(), [t.grad for t in leaves]


def _ours(backend, heads, labels, **kw):
    def fn(x, w, u, b, bias):
        return mhce(x, w, labels, heads, bias=bias, low_rank=(u, b), backend=backend, **kw)
    return fn


def _reference(heads, labels, **kw):
    def fn(x, w, u, b, bias):
        xs, ws = _widen(x, w, u, b, heads)
        return R.reference_loss(xs, ws, labels, heads, bias=bias, **kw)
    return fn


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads,rank,lead,d,v", [
    (1, 1, (1,), 7, 37),
    (1, 5, (2, 9), 13, 53),
    (2, 3, (13,), 18, 67),
    (4, 20, (3, 5), 20, 41),  # R above the interpreter's K block (16)
])
@pytest.mark.parametrize("kw", [{}, {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 4.0}], ids=["plain", "options"])
def test_matches_widened_reference(backend, heads, rank, lead, d, v, kw):
    *tensors, labels = _inputs(lead, d, v, heads, rank)
    mask = [True] * 5
    loss, got = _grads(_ours(backend, heads, labels, **kw), tensors, mask)
    ref_loss, want = _grads(_reference(heads, labels, **kw), [t.double() for t in tensors], mask)
    assert_close_scaled(loss, ref_loss, rtol=1e-5, name="loss")
    for name, g, r in zip(["dX", "dW", "dU", "dB_low", "d_bias"], got, want):
        assert g.dtype == torch.float32, name
        assert_close_scaled(g, r, rtol=1e-5, atol=default_atol(v), name=name)


@pytest.mark.parametrize("backend,grad_in_forward", [  # the torch backend has only the backward
    pytest.param("torch", "1", id="torch"),
    *(pytest.param("triton", g, id=f"triton-{name}", marks=pytest.mark.skipif(not HAVE_TRITON, reason="no triton"))
      for g, name in (("1", "grads-in-forward"), ("0", "grads-in-backward")))])
@pytest.mark.parametrize("mask", [
    (True, False, True, True, False),  # LoRA on the head of a trained body: base weight frozen
    (False, False, True, True, False),  # only the adapter trains (hidden from a frozen body)
    (False, False, False, True, False),
    (True, True, False, False, True),
])
def test_needs_grad_combinations(backend, grad_in_forward, mask, monkeypatch):
    monkeypatch.setenv("HF_MHCE_GRAD_IN_FORWARD", grad_in_forward)
    heads, rank = 2, 3
    *tensors, labels = _inputs((11,), 10, 45, heads, rank)
    requested = []
    ops = __import__("hf_mhce.losses.dispatch", fromlist=["resolve"])
    real = ops.resolve

    needs_at = {"backward": 11, "forward_with_grads": 10}  # where each entry point takes ``needs``

    def spy(*a, **k):
        ns = real(*a, **k)
        wrapped = {}
        for name in ("backward", "forward_with_grads"):
            if hasattr(ns, name):
                def entry(*args, _inner=getattr(ns, name), _name=name, **kwargs):
                    result = _inner(*args, **kwargs)
                    if _name == "backward" or result is not None:  # None: the backward will be asked
                        requested.append(args[needs_at[_name]])
                    return result
                wrapped[name] = entry
        return type(ns)(**{**vars(ns), **wrapped})

    monkeypatch.setattr(ops, "resolve", spy)
    _, got = _grads(_ours(backend, heads, labels), tensors, mask)
    _, want = _grads(_reference(heads, labels), [t.double() for t in tensors], mask)
    ops_order = (mask[0], mask[1], mask[4], mask[2], mask[3])  # (dX, dW, d_bias, dU, dB_low)
    assert requested == [ops_order], "the ops must be asked for exactly the gradients autograd needs"
    for name, m, g, r in zip(["dX", "dW", "dU", "dB_low", "d_bias"], mask, got, want):
        if not m:
            assert g is None, name
        else:
            assert_close_scaled(g, r, rtol=1e-5, atol=default_atol(45), name=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_and_bf16(backend):
    """RBE ranks see the low-rank term, and bf16 inputs stay within eager's error."""
    heads, rank = 2, 4
    *tensors, labels = _inputs((19,), 16, 70, heads, rank, ignore=False)
    x, w, u, b, bias = tensors
    xs, ws = _widen(x, w, u, b, heads)
    got, want = [], []
    with torch.no_grad(), collect_ranks(lambda r, nll: got.append((r, nll))):
        mhce(x, w, labels, heads, bias=bias, low_rank=(u, b), backend=backend)
    with torch.no_grad(), collect_ranks(lambda r, nll: want.append((r, nll))):
        mhce(xs, ws, labels, heads, bias=bias, backend=backend)
    assert len(got) == len(want) == 1 and got[0][0].sum() > 0
    assert torch.equal(got[0][0], want[0][0])
    torch.testing.assert_close(got[0][1], want[0][1])
    low = [t.bfloat16() for t in tensors]
    ours = mhce(*low[:2], labels, heads, bias=low[4], low_rank=(low[2], low[3]), backend=backend)
    xs16, ws16 = _widen(*low[:4], heads)
    eager = R.eager_loss(xs16, ws16, labels, heads, bias=low[4])
    ref = R.reference_loss(xs.double(), ws.double(), labels, heads, bias=bias.double())
    assert abs(ours.double() - ref) <= abs(eager.double() - ref) + 4e-3 * ref.abs()


def test_bad_low_rank_is_named():
    x, w, u, b, bias, labels = _inputs((4,), 8, 20, 2, 3)
    with pytest.raises(ValueError, match=r"low_rank U must be \[..., num_heads, R\]"):
        mhce(x, w, labels, 2, low_rank=(u[..., 0, :], b))
    with pytest.raises(ValueError, match=r"low_rank B must be \[V, R\]"):
        mhce(x, w, labels, 2, low_rank=(u, b[:-1]))
    with pytest.raises(ValueError, match=r"low_rank U must be"):
        mhce(x, w, labels, 2, low_rank=(u, b[:, :2]))
    with pytest.raises(TypeError, match="low_rank B has dtype"):
        mhce(x, w, labels, 2, low_rank=(u, b.double()))
    with pytest.raises(TypeError, match="pair"):
        mhce(x, w, labels, 2, low_rank=u)
    with pytest.raises(ValueError, match=r"R >= 1"):  # a rank-0 adapter is named, not silently dropped
        mhce(x, w, labels, 2, low_rank=(u[..., :0], b[:, :0]))


def test_autocast_casts_the_pair():
    """Under torch.autocast the pair is cast with the head, as nn.Linear casts its operands: float32
    factors with a bf16 autocast give the all-bf16 loss and log-probabilities (and float32 gradients)."""
    heads = 2
    *tensors, labels = _inputs((7,), 8, 29, heads, 3)
    x, w, u, b, bias = tensors
    low = [t.bfloat16() for t in tensors]
    want = mhce(*low[:2], labels, heads, bias=low[4], low_rank=(low[2], low[3]), backend="torch")
    want_lp = hf_mhce.multi_head_logprobs(*low[:2], heads, bias=low[4], low_rank=(low[2], low[3]))
    leaves = [t.clone().requires_grad_() for t in tensors]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = mhce(*leaves[:2], labels, heads, bias=leaves[4], low_rank=(leaves[2], leaves[3]), backend="torch")
        got_lp = hf_mhce.multi_head_logprobs(x, w, heads, bias=bias, low_rank=(u, b))
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert got_lp.dtype == want_lp.dtype and torch.equal(got_lp, want_lp)
    got.backward()
    assert all(t.grad.dtype == torch.float32 and torch.isfinite(t.grad).all() for t in leaves)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("workspace_mb", [None, "0.002"], ids=["fused", "split"])
def test_bf16_gradients_no_worse_than_eager(backend, workspace_mb, monkeypatch):
    """16-bit inputs: the Triton backward's fused pass and its bounded-memory split (a dW pass,
    then a dX pass) both accumulate dU and dB_low in float32."""
    if workspace_mb is not None:
        monkeypatch.setenv("HF_MHCE_WORKSPACE_MB", workspace_mb)
    heads, rank, v = 2, 5, 83
    *tensors, labels = _inputs((2, 17), 24, v, heads, rank)
    low = [t.bfloat16() for t in tensors]
    mask = [True] * 5
    _, got = _grads(_ours(backend, heads, labels), low, mask)

    def eager(x, w, u, b, bias):
        xs, ws = _widen(x, w, u, b, heads)
        return R.eager_loss(xs, ws, labels, heads, bias=bias)

    _, base = _grads(eager, low, mask)
    _, want = _grads(_reference(heads, labels), [t.double() for t in low], mask)
    for name, g, e, r in zip(["dX", "dW", "dU", "dB_low", "d_bias"], got, base, want):
        assert g.dtype == torch.bfloat16, name
        assert_no_worse_than_eager(g, e, r, torch.bfloat16, name=name)


@pytest.mark.parametrize("heads,rank,lead", [(1, 1, (1,)), (2, 3, (2, 7)), (4, 17, (9,))])
def test_logprobs_match_widened_reference(heads, rank, lead):
    """multi_head_logprobs with the pair (generation and eval logits of a LoRA head): values and
    every gradient, against float64 on the widened operands."""
    *tensors, _ = _inputs(lead, 20, 57, heads, rank)
    probe = torch.randn(*lead, 57)  # a random cotangent: every entry of log pbar matters

    def ours(x, w, u, b, bias):
        out = hf_mhce.multi_head_logprobs(x, w, heads, bias=bias, softcap=5.0, low_rank=(u, b))
        return (out * probe.to(out.dtype)).sum()

    def ref(x, w, u, b, bias):
        xs, ws = _widen(x, w, u, b, heads)
        return (R.reference_logprobs(xs, ws, heads, bias=bias, softcap=5.0) * probe.double()).sum()

    x, w, u, b, bias = tensors
    out = hf_mhce.multi_head_logprobs(x, w, heads, bias=bias, softcap=5.0, low_rank=(u, b))
    xs, ws = _widen(*(t.double() for t in (x, w, u, b)), heads)
    assert_close_scaled(out, R.reference_logprobs(xs, ws, heads, bias=bias.double(), softcap=5.0), rtol=1e-5,
                        name="log pbar")
    mask = [True] * 5
    _, got = _grads(ours, tensors, mask)
    _, want = _grads(ref, [t.double() for t in tensors], mask)
    for name, g, r in zip(["dX", "dW", "dU", "dB_low", "d_bias"], got, want):
        assert_close_scaled(g, r, rtol=1e-5, atol=1e-6, name=name)
    _, frozen = _grads(ours, tensors, [False, False, True, True, False])  # LoRA only: no dX, dW
    for name, g, r in zip(["dU", "dB_low"], frozen[2:4], want[2:4]):
        assert_close_scaled(g, r, rtol=1e-5, atol=1e-6, name=name)
