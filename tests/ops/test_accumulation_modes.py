"""The slab backward's ways of adding 16-bit products into float32 (``triton_backward._matmul_into``):
"addmm" (cuBLAS adds in place), "mm" (a float32 product, then added) and "" (upcast copies, CPU).
The first two run only on a GPU whose torch has ``out_dtype``; here a stand-in torch gives mm / addmm
that argument (float32 products of the upcast operands), so that their branches, and the budget shares
that follow from the mode (no temporaries with "addmm" and one head), are checked under the interpreter
against the CPU mode, which the rest of the suite checks against float64."""

import pytest
import torch

import hf_mhce
from reference import assert_close_scaled, make_inputs, requires_triton


class _TorchWithOutDtype:
    """``torch`` with mm / addmm taking ``out_dtype=torch.float32`` for 16-bit operands, as on CUDA."""

    def __init__(self):
        self.calls = {"mm": 0, "addmm": 0}

    def __getattr__(self, name):
        return getattr(torch, name)

    def mm(self, a, b, out=None, out_dtype=None):
        if out_dtype is None:
            return torch.mm(a, b, out=out)
        self.calls["mm"] += 1
        return a.float() @ b.float()

    def addmm(self, c, a, b, out_dtype=None, out=None):
        assert out_dtype == torch.float32 and out is c and c.is_contiguous()
        self.calls["addmm"] += 1
        return c.add_(a.float() @ b.float())


def _grads(hidden, weight, bias, labels, heads):
    x, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    hf_mhce.multi_head_cross_entropy(x, w, labels, heads, bias=b, label_smoothing=0.1, backend="triton").backward()
    return x.grad, w.grad, b.grad


def _assert_within_an_ulp(got, want):
    for name, g, r in zip(["dX", "dW", "dB"], got, want):
        # float32 sums in another order, then one bf16 rounding: equal up to an ulp here and there
        assert_close_scaled(g, r, rtol=1e-2, atol=1e-2, name=name)
        assert (g.float() - r.float()).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * r.float().abs().max()


@requires_triton
@pytest.mark.parametrize("mode", ["addmm", "mm"])
@pytest.mark.parametrize("workspace_mb", [None, "0.001"], ids=["fused", "split"])  # split: both passes accumulate
@pytest.mark.parametrize("heads", [1, 2])
def test_modes_match_the_cpu_mode(mode, workspace_mb, heads, monkeypatch):
    from hf_mhce.ops import triton_backward

    monkeypatch.setenv("HF_MHCE_GRAD_IN_FORWARD", "0")  # this file checks the backward's slabs
    if workspace_mb is not None:
        monkeypatch.setenv("HF_MHCE_WORKSPACE_MB", workspace_mb)
    hidden, weight, bias, labels = make_inputs((37,), 32, 61, dtype=torch.bfloat16, bias=True, num_heads=heads,
                                               ignore_frac=0.2, logit_std=3.0)

    def grads():
        return _grads(hidden, weight, bias, labels, heads)

    want = grads()
    stand_in = _TorchWithOutDtype()
    monkeypatch.setattr(triton_backward, "torch", stand_in)
    monkeypatch.setattr(triton_backward, "accumulation_mode", lambda t: mode)
    got = grads()
    assert stand_in.calls["addmm" if mode == "addmm" and heads == 1 else "mm"] > 0, stand_in.calls
    _assert_within_an_ulp(got, want)


class _TorchWithOutDtypeOut(_TorchWithOutDtype):
    """The stand-in, with mm also writing a float32 product into a (row-strided) out, as on CUDA."""

    def __init__(self):
        super().__init__()
        self.calls["mm_out"] = 0

    def mm(self, a, b, out=None, out_dtype=None):
        if out_dtype is None or out is None:
            return super().mm(a, b, out=out, out_dtype=out_dtype)
        assert out.dtype == torch.float32 and out.stride(1) == 1
        self.calls["mm_out"] += 1
        return out.copy_(a.float() @ b.float())


@requires_triton
@pytest.mark.parametrize("mode", ["addmm", "mm"])
@pytest.mark.parametrize("chunks", ["one", "several"])
@pytest.mark.parametrize("heads", [1, 2])
def test_gradients_in_the_forward_match_the_cpu_mode(mode, chunks, heads, monkeypatch):
    """The same for the gradients-in-forward schedule: float32 logits written into the slab (mm with out=,
    or row blocks copied in with "mm"), and the float32 dW summed over chunks."""
    from hf_mhce.ops import triton_backward, triton_forward_grad

    monkeypatch.delenv("HF_MHCE_GRAD_IN_FORWARD", raising=False)
    if chunks == "several":  # room for the float32 dW (61 x 32 x 4 bytes) and 6 tokens a chunk
        monkeypatch.setattr(triton_forward_grad, "MIN_ROWS", 4)
        room = 61 * 32 * 4 + 6 * heads * 64 * 4
        monkeypatch.setenv("HF_MHCE_WORKSPACE_MB", repr((room * 8 // 7 + 8) / 2**20))
        assert triton_forward_grad.chunk_rows(37, 61, 32, heads, torch.bfloat16, True,
                                              triton_forward_grad.workspace_bytes()) == 6
    hidden, weight, bias, labels = make_inputs((37,), 32, 61, dtype=torch.bfloat16, bias=True, num_heads=heads,
                                               ignore_frac=0.2, logit_std=3.0)
    taken = []
    real = triton_forward_grad.forward_with_grads
    monkeypatch.setattr(triton_forward_grad, "forward_with_grads",
                        lambda *a, **k: taken.append(real(*a, **k)) or taken[-1])

    def grads():
        return _grads(hidden, weight, bias, labels, heads)

    want = grads()
    stand_in = _TorchWithOutDtypeOut()
    for module in (triton_backward, triton_forward_grad):
        monkeypatch.setattr(module, "torch", stand_in)
        monkeypatch.setattr(module, "accumulation_mode", lambda t: mode)
    # "mm" stands for a torch whose mm cannot write into the slab's padded rows: row blocks copied in
    monkeypatch.setattr(triton_forward_grad, "writes_strided_float32", lambda t: mode == "addmm")
    got = grads()
    assert all(t is not None for t in taken) and len(taken) == 2, "the schedule must run both times"
    assert stand_in.calls["mm_out" if mode == "addmm" else "mm"] > 0, stand_in.calls
    if chunks == "several":
        assert stand_in.calls["addmm" if mode == "addmm" else "mm"] > 0, stand_in.calls
    _assert_within_an_ulp(got, want)
