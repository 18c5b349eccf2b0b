"""Gradients computed in the forward (``hf_mhce.ops.triton_forward_grad``), Triton kernels on CPU through the
interpreter: the path is taken exactly when it should be (and the backward then only scales), its values
match the float64 torch backend and the recompute backward (HF_MHCE_GRAD_IN_FORWARD=0) over one chunk or
several, the incoming gradient's factor is applied (exactly for powers of two), non-uniform or repeated
backwards recompute, a bad HF_MHCE_GRAD_IN_FORWARD is named, and ``chunk_rows``'s arithmetic."""

from types import SimpleNamespace

import pytest
import torch

import hf_mhce
import reference as R
from hf_mhce.losses import checks, dispatch, functions
from hf_mhce.losses.functions import MultiHeadTokenLoss
from hf_mhce.ops import budget
from reference import HAVE_TRITON, assert_close_scaled, assert_no_worse_than_eager, default_atol, make_inputs, requires_triton

pytestmark = requires_triton
if HAVE_TRITON:
    from hf_mhce.ops import triton_backward, triton_forward_grad as fg

mhce = hf_mhce.multi_head_cross_entropy
BF16_EPS = torch.finfo(torch.bfloat16).eps


@pytest.fixture(autouse=True)
def spy(monkeypatch):
    """Records what forward_with_grads returned (True: gradients), the chunk sizes it chose, the factors
    the backward scaled by and the recompute backward's calls; no HF_MHCE_* from the shell."""
    monkeypatch.delenv("HF_MHCE_GRAD_IN_FORWARD", raising=False)
    monkeypatch.delenv("HF_MHCE_WORKSPACE_MB", raising=False)
    rec = SimpleNamespace(early=[], rows=[], factors=[], backward=[])

    def wrap(module, name, record, keep):
        real = getattr(module, name)

        def call(*a, **k):
            out = real(*a, **k)
            record.append(keep(a, out))
            return out
        monkeypatch.setattr(module, name, call)

    wrap(fg, "forward_with_grads", rec.early, lambda a, out: out is not None)
    wrap(fg, "chunk_rows", rec.rows, lambda a, out: out)
    wrap(functions, "_scaled", rec.factors, lambda a, out: a[1])
    wrap(triton_backward, "backward", rec.backward, lambda a, out: True)
    return rec


def _inputs(n, d, v, heads, dtype=torch.float32, rank=0, bias=True, neginf=False):
    """[x, w, bias, U, B_low] (None where absent) and labels: every 4th token from the second ignored, the
    first token targets the last (partial) vocabulary block; ``neginf``: a -inf bias on the second quarter
    of the vocabulary, no target there (nor 0, eager's stand-in target of ignored tokens)."""
    x, w, b, labels = make_inputs((n,), d, v, bias=bias, num_heads=heads, logit_std=2.5)
    u = torch.randn(n, heads, rank) if rank else None
    lb = torch.randn(v, rank) / rank ** 0.5 if rank else None
    labels[0] = v - 1
    labels[1::4] = -100
    if neginf:
        b[v // 4: v // 2] = float("-inf")
        labels[(labels >= v // 4) & (labels < v // 2)] -= v // 4
    return [None if t is None else t.to(dtype) for t in (x, w, b, u, lb)], labels


def _widen(x, w, u, lb, heads):
    """(x', w') whose head h's logits are x_h W_h^T + U_h B^T (for the eager baseline)."""
    split = (heads, w.shape[1] // heads)
    return (torch.cat([x.unflatten(-1, split), u], -1).flatten(-2),
            torch.cat([w.unflatten(-1, split), lb.unsqueeze(1).expand(-1, heads, -1)], -1).flatten(-2))


def _ours(labels, heads, backend="triton", **kw):
    def fn(x, w, b, u, lb):
        return mhce(x, w, labels, heads, bias=b, low_rank=None if u is None else (u, lb), backend=backend, **kw)
    return fn


def _eager(labels, heads, **kw):
    def fn(x, w, b, u, lb):
        if u is not None:
            x, w = _widen(x, w, u, lb, heads)
        return R.eager_loss(x, w, labels, heads, bias=b, **kw)
    return fn


def _grads(fn, tensors, dtype=None, scale=1.0, frozen=()):
    """(loss, gradients) of ``scale * fn`` on fresh leaves (cast to ``dtype``; the indices in ``frozen``
    need no gradient); a per-token loss gets ones."""
    leaves = [None if t is None else t.detach().to(dtype or t.dtype).clone().requires_grad_(i not in frozen)
              for i, t in enumerate(tensors)]
    loss = fn(*leaves)
    (loss * scale).backward(torch.ones_like(loss))
    return loss.detach(), [None if t is None else t.grad for t in leaves]


def _reference(labels, heads, tensors, scale=1.0, frozen=(), **kw):
    return _grads(_ours(labels, heads, backend="torch", **kw), tensors, torch.float64, scale, frozen)


def _force_rows(monkeypatch, n, v, d, heads, dtype, rows, need_dw=True):
    """An HF_MHCE_WORKSPACE_MB (under a MIN_ROWS of 4) whose chunks hold ``rows`` of the ``n`` tokens."""
    monkeypatch.setattr(fg, "MIN_ROWS", 4)
    row_bytes = heads * -(-v // 8) * 8 * 4
    dw_acc = 4 * v * d if need_dw and dtype != torch.float32 else 0
    monkeypatch.setenv("HF_MHCE_WORKSPACE_MB", repr((rows * row_bytes + row_bytes // 2 + dw_acc) * 8 / 7 / 2**20))
    assert fg.chunk_rows(n, v, d, heads, dtype, need_dw, budget.workspace_bytes()) == rows < n and n % rows


def _compare(got, want, dtype, v, name, eager=None):
    if dtype == torch.float32:
        assert_close_scaled(got, want, rtol=1e-5, atol=default_atol(v), name=name)
    else:
        assert got.dtype == dtype or name == "loss", name
        assert_no_worse_than_eager(got, eager, want, dtype, name=name)


NAMES = ["loss", "dX", "dW", "d_bias", "dU", "dB_low"]
FP32, BF16 = torch.float32, torch.bfloat16
OPTIONS = dict(softcap=4.0, label_smoothing=0.1, z_loss=1e-3)
TIGHT = {FP32: dict(rtol=1e-5, atol=1e-6), BF16: dict(rtol=0, atol=2 * BF16_EPS)}  # two ways of one computation
CASES = [  # (n, d, v, heads, dtype, rank, flags, options, rows per chunk (None: one chunk))
    pytest.param(1, 7, 37, 1, FP32, 0, "", {}, None, id="N1-fp32"),
    pytest.param(37, 33, 61, 1, FP32, 0, "bias", dict(reduction="sum"), None, id="D33-sum"),
    pytest.param(37, 18, 67, 2, FP32, 0, "neginf", dict(z_loss=1e-3), 8, id="H2-neginf-chunks"),
    pytest.param(37, 21, 53, 3, FP32, 0, "bias nan", OPTIONS, 16, id="H3-D21-options-chunks-nan"),
    pytest.param(29, 18, 45, 2, FP32, 3, "bias nan", dict(OPTIONS, num_items_in_batch=40), 8, id="H2-lowrank-chunks-nan"),
    pytest.param(13, 21, 41, 3, FP32, 2, "", OPTIONS, None, id="H3-lowrank-nobias"),
    pytest.param(1, 18, 29, 2, BF16, 0, "bias", OPTIONS, None, id="N1-bf16"),
    pytest.param(23, 16, 1500, 1, BF16, 0, "bias", dict(label_smoothing=0.1), None, id="bf16-V1500"),
    pytest.param(37, 18, 67, 2, BF16, 0, "bias nan", OPTIONS, 8, id="bf16-H2-options-chunks-nan"),
    pytest.param(37, 21, 67, 3, BF16, 3, "neginf", dict(z_loss=1e-3), 16, id="bf16-H3-lowrank-neginf-chunks"),
    pytest.param(37, 18, 67, 2, BF16, 0, "bias frozen", OPTIONS, 16, id="bf16-H2-frozen-weight-chunks"),
]


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # the interpreter on the NaN row
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("n,d,v,heads,dtype,rank,flags,opts,rows", CASES)
def test_matches_reference_and_recompute(n, d, v, heads, dtype, rank, flags, opts, rows, spy, monkeypatch):
    tensors, labels = _inputs(n, d, v, heads, dtype, rank, bias=flags != "", neginf="neginf" in flags)
    frozen = (1,) if "frozen" in flags else ()  # a frozen weight: no dW, so no float32 dW accumulator
    if rows is not None:
        _force_rows(monkeypatch, n, v, d, heads, dtype, rows, need_dw=not frozen)
    poisoned = list(tensors)
    if "nan" in flags:  # an ignored row in the last chunk: NaN hidden (inf U)
        bad = 33 if n > 33 else 25
        assert labels[bad] == -100
        poisoned[0] = tensors[0].index_fill(0, torch.tensor([bad]), float("nan"))
        if rank:
            poisoned[3] = tensors[3].index_fill(0, torch.tensor([bad]), float("inf"))
    ours = _ours(labels, heads, **opts)
    loss, got = _grads(ours, poisoned, frozen=frozen)
    assert spy.early == [True] and not spy.backward, "gradients in the forward, the backward only scales"
    assert spy.rows[-1] == (rows or n)
    monkeypatch.setenv("HF_MHCE_GRAD_IN_FORWARD", "0")
    old_loss, old = _grads(ours, poisoned, frozen=frozen)
    assert spy.early == [True, False] and len(spy.backward) == 1
    ref_loss, want = _reference(labels, heads, tensors, frozen=frozen, **opts)  # on the finite rows
    eager = _grads(_eager(labels, heads, **opts), tensors, frozen=frozen) if dtype != FP32 else (None, [None] * 5)
    _compare(loss, ref_loss, dtype, v, "loss", eager[0])
    torch.testing.assert_close(loss, old_loss, rtol=1e-6, atol=0)
    for name, g, o, r, e in zip(NAMES[1:], got, old, want, eager[1]):
        if r is None:
            assert g is None and o is None, name
            continue
        _compare(g, r, dtype, v, name, e)
        assert_close_scaled(g, o, name=f"{name} vs recompute", **TIGHT[dtype])
        if "nan" in flags and name in ("dX", "dU"):
            assert (g[bad] == 0).all(), name


@pytest.mark.parametrize("case", ["grad-in-forward-0", "reduction-none", "no-grad", "workspace-under-min-rows"])
def test_fallbacks_give_equal_results(case, spy, monkeypatch):
    tensors, labels = _inputs(37, 21, 67, 3)
    want_loss, want = _grads(_ours(labels, 3, reduction="sum"), tensors)
    assert spy.early == [True] and not spy.backward
    # 0.02 MB: 37 rows of 3 x 72 float32 logits do not fit, 20 rows do, under MIN_ROWS (256)
    env = {"grad-in-forward-0": ("HF_MHCE_GRAD_IN_FORWARD", "0"), "workspace-under-min-rows": ("HF_MHCE_WORKSPACE_MB", "0.02")}
    if case in env:
        monkeypatch.setenv(*env[case])
    if case == "no-grad":
        with torch.no_grad():
            loss = _ours(labels, 3, reduction="sum")(*(None if t is None else t.requires_grad_() for t in tensors))
        assert spy.early == [True], "not called under no_grad"
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
        return
    loss, got = _grads(_ours(labels, 3, reduction="none" if case == "reduction-none" else "sum"), tensors)
    assert spy.early == ([True] if case == "reduction-none" else [True, False]) and len(spy.backward) == 1
    if case == "workspace-under-min-rows":
        assert spy.rows[-1] == 0
    torch.testing.assert_close(loss.sum(), want_loss, rtol=1e-6, atol=0)
    for name, g, w in zip(NAMES[1:], got, want):
        if w is not None:
            assert_close_scaled(g, w, rtol=1e-5, atol=1e-6, name=name)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_scaling_by_incoming_gradient(dtype, spy, monkeypatch):
    """c = 2 (a loss scaler, accumulation): exactly twice; c = 3: one more rounding."""
    _force_rows(monkeypatch, 37, 67, 18, 2, dtype, 16)
    tensors, labels = _inputs(37, 18, 67, 2, dtype, rank=2)
    fn = _ours(labels, 2, **OPTIONS)
    one, two, three = (_grads(fn, tensors, scale=c)[1] for c in (1, 2, 3))
    assert spy.early == [True] * 3 and not spy.backward
    assert spy.factors[:2] == [1.0, 2.0], "the assumed gradient is DivBackward's own 1 / count, bit for bit"
    eps = 1e-6 if dtype == FP32 else BF16_EPS
    for name, g1, g2, g3 in zip(NAMES[1:], one, two, three):
        assert torch.equal(g2, 2 * g1), name
        assert_close_scaled(g3, 3 * g1, rtol=eps, atol=eps / 4, name=name)


@pytest.mark.parametrize("kw", [dict(reduction="sum"), dict(num_items_in_batch=50), dict(num_items_in_batch=torch.tensor(7)),
                                dict(reduction="mean")], ids=["sum", "num_items", "num_items_tensor", "mean"])
def test_sum_and_num_items_with_scale(kw, spy, monkeypatch):
    _force_rows(monkeypatch, 29, 45, 18, 2, FP32, 8)
    tensors, labels = _inputs(29, 18, 45, 2, rank=3)
    loss, got = _grads(_ours(labels, 2, **kw), tensors, scale=3.0)
    assert spy.early == [True] and not spy.backward
    ref_loss, want = _reference(labels, 2, tensors, scale=3.0, **kw)
    for name, g, w in zip(NAMES, [loss] + got, [ref_loss] + want):
        _compare(g, w, FP32, 45, name)


def test_gradient_accumulation(spy, monkeypatch):
    """Two micro-batches, each (loss / 2).backward() into the same .grad (the first one may be ours)."""
    _force_rows(monkeypatch, 31, 53, 18, 2, FP32, 8)
    tensors, labels = _inputs(31, 18, 53, 2, bias=True)
    second = labels.roll(5)
    results = []
    for backend, dtype in (("triton", None), ("torch", torch.float64)):
        leaves = [None if t is None else t.detach().to(dtype or t.dtype).clone().requires_grad_() for t in tensors]
        for lab in (labels, second):
            (_ours(lab, 2, backend=backend, num_items_in_batch=40)(*leaves) / 2).backward()
        results.append([t.grad for t in leaves[:3]])
    assert spy.early == [True, True] and not spy.backward
    for name, g, w in zip(NAMES[1:], *results):
        _compare(g, w, FP32, 53, name)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_retain_graph_second_backward_recomputes(dtype, spy, monkeypatch):
    _force_rows(monkeypatch, 37, 67, 18, 2, dtype, 16)
    tensors, labels = _inputs(37, 18, 67, 2, dtype, rank=2)
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    loss = _ours(labels, 2, **OPTIONS)(*leaves)
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in leaves]
    assert spy.early == [True] and not spy.backward
    for t in leaves:
        t.grad = None
    (loss * 2).backward()
    assert len(spy.backward) == 1, "the stored gradients were handed over once"
    for name, f, t in zip(NAMES[1:], first, leaves):  # the recomputed gradients, at twice the factor
        assert_close_scaled(t.grad, 2 * f, name=name, **TIGHT[dtype])


@pytest.mark.parametrize("grad", ["random", "uniform-over-valid"])
def test_direct_apply_with_per_token_gradients(grad, spy):
    """grad_scale promised a uniform gradient of 0.5; random per-token gradients must recompute (a
    uniform 0.75 over the valid tokens, random on ignored ones, only scales by 1.5)."""
    heads = 2
    (x, w, b, _, _), labels = _inputs(29, 18, 45, heads)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    inputs = checks.prepare(*leaves, labels, -100)
    ops = dispatch.resolve("triton", x.device, x.dtype)
    losses = MultiHeadTokenLoss.apply(inputs.hidden, inputs.weight, inputs.bias, None, None, inputs.labels,
                                      inputs.valid, heads, 4.0, 0.1, 1e-3, ops, None, torch.tensor(0.5))
    g = torch.randn(29) * 2
    if grad == "uniform-over-valid":
        g[labels != -100] = 0.75
    torch.autograd.backward(losses, grad_tensors=g)
    assert spy.early == [True] and len(spy.backward) == (grad == "random")
    ref = R.run_with_grads(R.reference_loss, x, w, labels, heads, bias=b, grad_out=g.double(), dtype=torch.float64,
                           reduction="none", softcap=4.0, label_smoothing=0.1, z_loss=1e-3)
    _compare(losses, ref[0], FP32, 45, "losses")
    for name, t, r in zip(NAMES[1:], leaves, ref[1:]):
        _compare(t.grad, r, FP32, 45, name)


def test_stored_gradients_are_freed_before_a_recompute(monkeypatch):
    """A non-uniform incoming gradient recomputes: the stored dX / dW no longer apply, and holding them
    while the recompute builds its own (and its slabs) raised the backward's peak by a dX and a dW."""
    import weakref

    stored, alive = [], []
    forward_with_grads, backward = fg.forward_with_grads, triton_backward.backward

    def keep_refs(*a, **k):
        out = forward_with_grads(*a, **k)
        stored.extend(weakref.ref(t) for t in out[1] if t is not None)
        return out

    def count_alive(*a, **k):
        alive.append(sum(ref() is not None for ref in stored))
        return backward(*a, **k)

    monkeypatch.setattr(fg, "forward_with_grads", keep_refs)
    monkeypatch.setattr(triton_backward, "backward", count_alive)
    (x, w, _, _, _), labels = _inputs(21, 16, 40, 1, bias=False)
    leaves = [t.clone().requires_grad_() for t in (x, w)]
    inputs = checks.prepare(*leaves, None, labels, -100)
    ops = dispatch.resolve("triton", x.device, x.dtype)
    losses = MultiHeadTokenLoss.apply(inputs.hidden, inputs.weight, None, None, None, inputs.labels, inputs.valid, 1,
                                      None, 0.0, 0.0, ops, None, torch.tensor(1 / 21))
    torch.autograd.backward(losses, grad_tensors=torch.rand(21) + 0.5)
    assert len(stored) == 2 and alive == [0]


def test_bad_setting_is_named(monkeypatch):
    tensors, labels = _inputs(9, 16, 23, 2)
    for raw in ("", "0", "1"):
        monkeypatch.setenv("HF_MHCE_GRAD_IN_FORWARD", raw)
        dispatch.check_environment()
    monkeypatch.setenv("HF_MHCE_GRAD_IN_FORWARD", "2")
    with pytest.raises(budget.SettingError, match="HF_MHCE_GRAD_IN_FORWARD"):
        dispatch.check_environment()
    with pytest.raises(ValueError, match="HF_MHCE_GRAD_IN_FORWARD"):
        _grads(_ours(labels, 2), tensors)
    # whichever schedule the call would take: per-token losses, no gradients, a workspace too small, torch
    monkeypatch.setenv("HF_MHCE_WORKSPACE_MB", "0.0005")
    for call in (lambda: mhce(*tensors[:2], labels, 2, reduction="none", backend="triton"),
                 lambda: mhce(*tensors[:2], labels, 2, backend="triton"),
                 lambda: mhce(*tensors[:2], labels, 2, backend="torch")):
        with pytest.raises(ValueError, match="HF_MHCE_GRAD_IN_FORWARD"):
            call()


def test_chunk_rows_arithmetic(monkeypatch):
    """V = 61 (rows of 64 float32 logits), two heads: 512 bytes a token; 7/8 of the budget for them."""
    rows = fg.chunk_rows
    n, v, d, h = 1000, 61, 32, 2
    exact = next(b for b in range(51200, 60000) if b - b // 8 >= 100 * 512)  # 100 tokens in 7/8 of it
    for dtype in (FP32, BF16, torch.float16):  # one chunk: no dW accumulator, even under MIN_ROWS
        assert rows(100, v, d, h, dtype, True, exact) == 100
        assert rows(100, v, d, h, dtype, True, exact - 1) == 0  # 99 rows < MIN_ROWS (256)
    monkeypatch.setattr(fg, "MIN_ROWS", 64)
    # 2**16 bytes: 57344 for the slab, 112 tokens; 16-bit with dW: 57344 - 4 * 61 * 32 = 49536, 96 tokens
    assert rows(n, v, d, h, FP32, True, 2**16) == 112
    assert rows(n, v, d, h, BF16, False, 2**16) == 112
    assert rows(n, v, d, h, BF16, True, 2**16) == 96
    assert rows(n, v, d, h, torch.float16, True, 2**16) == 96
    monkeypatch.setattr(fg, "MIN_ROWS", 100)
    assert rows(n, v, d, h, FP32, True, 2**16) == 112 and rows(n, v, d, h, BF16, True, 2**16) == 0
    assert rows(n, v, d, h, BF16, True, 4 * v * d) == 0  # the accumulator alone exceeds the room


def test_fp16_keeps_the_recompute_schedule_under_loss_scaling(spy):
    """fp16 dY formed in the forward at the assumed gradient 1 / num_items underflowed (dX 2.2e-1 off here):
    a GradScaler's factor arrives only in the backward, which forms dY at the scaled gradient."""
    tensors, labels = _inputs(37, 32, 1000, 1, torch.float16, bias=False)
    kw = dict(num_items_in_batch=2**20)  # 2**20 tokens per optimizer step, GradScaler's initial 2**16
    got = _grads(_ours(labels, 1, **kw), tensors, scale=2.0**16)[1]
    assert spy.early == [False] and spy.backward == [True]
    want = _reference(labels, 1, tensors, scale=2.0**16, **kw)[1]
    eager = _grads(_eager(labels, 1, **kw), tensors, scale=2.0**16)[1]
    for name, g, r, e in zip(NAMES[1:], got, want, eager):
        if r is not None:
            assert_no_worse_than_eager(g, e, r, torch.float16, name=name)
