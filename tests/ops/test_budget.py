"""The memory budgets: ``HF_MHCE_CHUNK_MB`` and ``HF_MHCE_WORKSPACE_MB`` are parsed by one helper
(a ValueError naming the variable unless positive and finite), and the Triton backward's scratch
for 16-bit inputs (dY slabs and float32 accumulators) stays within ``HF_MHCE_WORKSPACE_MB`` whichever
gradients are needed."""

import weakref

import pytest
import torch

import hf_mhce
from hf_mhce.ops import budget, torch_sweep
from reference import assert_close_scaled, requires_triton


def _reader(name):
    """(the function that reads ``name`` for the ops, its default in MB)."""
    if name == "HF_MHCE_CHUNK_MB":
        return torch_sweep.chunk_bytes, torch_sweep.DEFAULT_CHUNK_MB
    return budget.workspace_bytes, budget.DEFAULT_WORKSPACE_MB  # read by the Triton backward


@pytest.mark.parametrize("name", ["HF_MHCE_CHUNK_MB", "HF_MHCE_WORKSPACE_MB"])
def test_one_parser(name):
    read, _ = _reader(name)
    assert read.__globals__["megabytes_env"] is budget.megabytes_env


@pytest.mark.parametrize("raw", ["inf", "-inf", "nan", "1e308", "0", "-2", "lots"])
@pytest.mark.parametrize("name", ["HF_MHCE_CHUNK_MB", "HF_MHCE_WORKSPACE_MB"])
def test_budget_must_be_positive_and_finite(name, raw, monkeypatch):
    read, _ = _reader(name)
    monkeypatch.setenv(name, raw)  # "inf" used to pass the check, then raise an OverflowError naming nothing
    with pytest.raises(ValueError, match=name):
        read()


@pytest.mark.parametrize("name", ["HF_MHCE_CHUNK_MB", "HF_MHCE_WORKSPACE_MB"])
def test_budget_values_and_defaults(name, monkeypatch):
    read, default_mb = _reader(name)
    monkeypatch.setenv(name, "1.5")
    assert read() == 3 * 2**19
    monkeypatch.delenv(name)
    assert read() == int(default_mb * 2**20)


def test_infinite_chunk_budget_is_named_by_the_loss(monkeypatch):
    monkeypatch.setenv("HF_MHCE_CHUNK_MB", "inf")
    with pytest.raises(ValueError, match="HF_MHCE_CHUNK_MB"):
        hf_mhce.linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,)))


class _Scratch:
    """Stands in for ``torch`` inside triton_backward, recording the scratch it allocates: float32
    [rows, D] accumulators and the flat 16-bit dY slab buffers (dB is [V], dU [N, H, R], dB_low [V, R]
    with R != D, all float32, outside the bound)."""

    def __init__(self, d):
        self.d, self.rows, self.slabs, self.refs, self.live = d, [], [], [], []
        self.slab_bytes_at_accumulator = []

    def __getattr__(self, name):
        return getattr(torch, name)

    def _record(self, t):
        accumulator = t.dtype == torch.float32 and t.dim() == 2 and t.shape[1] == self.d
        slab = t.dtype in (torch.float16, torch.bfloat16) and t.dim() == 1
        if accumulator:  # slab bytes alive when an accumulator is allocated
            self.slab_bytes_at_accumulator.append(
                sum(r().numel() * r().element_size() for r in self.refs if r() is not None and r().dim() == 1))
        if accumulator or slab:
            (self.rows if accumulator else self.slabs).append(t.shape[0])
            self.refs.append(weakref.ref(t))  # bytes of such scratch alive at each allocation
            self.live.append(sum(r().numel() * r().element_size() for r in self.refs if r() is not None))
        return t

    def zeros(self, *a, **k):
        return self._record(torch.zeros(*a, **k))

    def empty(self, *a, **k):
        return self._record(torch.empty(*a, **k))


# N = 37, D = 16, 2 heads, 16-bit: "0.008" MB (8388 bytes) is under a fused pass (float32 dX 2368 bytes +
# two slabs [2, 37, 32] of 9472) and over one interpreter block of everything: a dW pass summing slabs
# [2, 16, 32] into a float32 accumulator [32, 16], then a dX pass over slabs [2, 16, 61] (the whole sum).
@requires_triton
@pytest.mark.parametrize("mask", [
    (True, False, False, False), (True, False, True, True), (True, True, True, False), (False, True, True, True),
], ids=["frozen-head", "frozen-head-lora", "full", "frozen-body-lora"])
def test_16bit_scratch_within_workspace(mask, monkeypatch):
    from hf_mhce.ops import triton_backward

    n, d, v, heads, rank = 37, 16, 61, 2, 3
    monkeypatch.setenv("HF_MHCE_WORKSPACE_MB", "0.008")
    spy = _Scratch(d)
    monkeypatch.setattr(triton_backward, "torch", spy)
    tensors = [torch.randn(n, d), torch.randn(v, d) / 3, torch.randn(n, heads, rank), torch.randn(v, rank) / 2]
    labels = torch.randint(0, v, (n,))
    labels[::4] = -100
    grads = {}
    for backend in ("torch", "triton"):
        x, w, u, b = (t.half().requires_grad_(m) for t, m in zip(tensors, mask))
        hf_mhce.multi_head_cross_entropy(x, w, labels, heads, low_rank=(u, b), label_smoothing=0.1,
                                         backend=backend).backward()
        grads[backend] = [t.grad for t in (x, w, u, b)]
    assert spy.slabs and max(spy.live) <= budget.workspace_bytes(), spy.live
    for name, m, got, want in zip(["dX", "dW", "dU", "dB_low"], mask, grads["triton"], grads["torch"]):
        assert (got is not None) == m, name
        if m:
            assert_close_scaled(got, want, rtol=4e-3, atol=4e-3, name=name)


@requires_triton
def test_16bit_passes_do_not_keep_each_others_scratch(monkeypatch):
    """Each pass allocates its float32 accumulator with no slab of an earlier pass alive: the dW pass's
    slab was kept beside the dX pass's accumulator, slabs and temporaries (1.25x HF_MHCE_WORKSPACE_MB at
    Llama-3-8B's head, H = 8, 64 MB).  N = 64, D = 32, V = 200, one head, fp16, 12058 bytes: no fused pass
    (a float32 dX of 8192 bytes beside two slabs of 4096); a dW pass over slabs of all 64 tokens, then a
    dX pass whose slabs cannot span the vocabulary (16 tokens: 6400 bytes > half the budget): an
    accumulator of 32 rows."""
    from hf_mhce.ops import triton_backward

    n, d, v = 64, 32, 200
    monkeypatch.setenv("HF_MHCE_WORKSPACE_MB", "0.0115")
    spy = _Scratch(d)
    monkeypatch.setattr(triton_backward, "torch", spy)
    x, w = torch.randn(n, d).half().requires_grad_(), (torch.randn(v, d) / 3).half().requires_grad_()
    hf_mhce.linear_cross_entropy(x, w, torch.randint(0, v, (n,)), backend="triton").backward()
    assert spy.rows == [32] and len(spy.slab_bytes_at_accumulator) == 1, (spy.rows, spy.slabs)
    assert spy.slab_bytes_at_accumulator == [0]  # the dW pass's slab is gone
    assert max(spy.live) <= budget.workspace_bytes(), spy.live
