"""The chunked torch sweeps reuse their block-sized buffers instead of allocating per block.

A fresh [H, rows, cols] temporary per block is large enough that glibc maps and unmaps it every time:
on a CPU those page faults took a third of an MHCE step (V = 128256, D = 256).  Counted here with a
dispatch mode: every aten op that returns a new block-sized tensor (not in place, not ``out=``) is an
allocation; their number must not grow with the number of blocks.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_mhce import multi_head_cross_entropy, multi_head_logprobs
from hf_mhce.losses import collect_ranks
from reference import LargestOutput


class _BlockAllocations(TorchDispatchMode):
    def __init__(self, threshold):
        super().__init__()
        self.threshold, self.count = threshold, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = not (func._schema.name.endswith("_") or func._overloadpacket.__name__.endswith("_")
                     or func._overloadname.startswith("out") or func._schema.is_mutable)
        if fresh and func._overloadpacket.__name__ not in ("view", "_unsafe_view", "slice", "select", "t", "transpose",
                                                           "permute", "expand", "unsqueeze", "alias", "as_strided"):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.numel() >= self.threshold and t._base is None:
                    self.count += 1
        return out


def _allocations(fn, threshold):
    with _BlockAllocations(threshold) as mode:
        fn()
    return mode.count


@pytest.mark.parametrize("heads,softcap", [(1, None), (4, None), (4, 3.0)])
def test_block_temporaries_do_not_grow_with_blocks(monkeypatch, heads, softcap, single_thread):
    # single_thread: hundreds of tiny blocks, each op run through the dispatch mode; the count of
    # allocations is the same with any number of intra-op threads
    n, d, v = 96, 16, 2053
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g, dtype=torch.float32).requires_grad_()
    w = (torch.randn(v, d, generator=g) / 2).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -100
    threshold = 1000  # elements: below the smallest block's [rows, cols] here, above any [N, H] statistic

    def train_step():
        multi_head_cross_entropy(x, w, labels, heads, softcap=softcap, backend="torch").backward()

    def eval_with_ranks():
        with torch.no_grad(), collect_ranks(lambda ranks, nll: None):
            multi_head_cross_entropy(x, w, labels, heads, softcap=softcap, backend="torch")

    def logprobs_step():
        multi_head_logprobs(x, w, heads, softcap=softcap).sum().backward()

    counts = {}
    for mb in (0.4, 0.1):  # the smaller budget makes several times more blocks of the same problem
        monkeypatch.setenv("HF_MHCE_CHUNK_MB", str(mb))
        counts[mb] = [_allocations(step, threshold) for step in (train_step, eval_with_ranks, logprobs_step)]
    # outputs and per-sweep buffers only: a handful, not more with several times more blocks (a few
    # buffers of the larger blocks pass the threshold that the smaller ones stay under).  15: the logprobs
    # backward of several heads with a softcap, since it marks each head's top entry (NOTES change 15)
    assert all(many <= few <= 15 for many, few in zip(counts[0.1], counts[0.4])), counts



class _LargeStorages(TorchDispatchMode):
    """Distinct storages of the op outputs with at least ``threshold`` elements (views share one)."""

    def __init__(self, threshold):
        super().__init__()
        self.threshold, self.storages = threshold, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.threshold:
                self.storages.add(t.untyped_storage().data_ptr())
        return out


@pytest.mark.parametrize("heads", [1, 4])
def test_float32_backward_allocates_dx_once(monkeypatch, heads):
    """Hidden in the compute dtype: the sweep's dX accumulator is the returned gradient, not an
    [H, N, Dh] buffer copied into [N, D] afterwards (an extra N x D for several heads)."""
    n, d, v = 512, 32, 64  # dW (V x D) below N x D
    monkeypatch.setenv("HF_MHCE_CHUNK_MB", "0.05")  # blocks of a few rows: block buffers below N x D too
    x = torch.randn(n, d, requires_grad=True)
    loss = multi_head_cross_entropy(x, torch.randn(v, d) / 3, torch.randint(0, v, (n,)), heads, backend="torch")
    with _LargeStorages(n * d) as mode:
        loss.backward()
    assert len(mode.storages) == 1, "dX allocated more than once"
    assert x.grad.untyped_storage().data_ptr() in mode.storages


@pytest.mark.parametrize("heads", [1, 4, 8])
def test_block_buffers_fit_the_budget_with_several_heads(monkeypatch, heads):
    """A block holds H heads' logits: its rows are divided by H so that the four logits-sized buffers fit
    HF_MHCE_CHUNK_MB whatever H (without that division a block of 8 heads was 1.6x the budget alone)."""
    from hf_mhce.ops.torch_sweep import chunk_bytes

    monkeypatch.setenv("HF_MHCE_CHUNK_MB", "1")
    n, d, v = 512, 8, 4099  # logits of 8 MB per head; inputs and dW well below a quarter of the budget
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g).requires_grad_()
    w = (torch.randn(v, d, generator=g) / 2).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    with LargestOutput() as train:
        multi_head_cross_entropy(x, w, labels, heads, softcap=3.0, backend="torch").backward()
    with torch.no_grad(), collect_ranks(lambda ranks, nll: None), LargestOutput() as ranked:
        multi_head_cross_entropy(x, w, labels, heads, softcap=3.0, backend="torch")
    assert max(train.largest_bytes, ranked.largest_bytes) <= chunk_bytes() // 4, (train.largest_bytes, ranked.largest_bytes)
