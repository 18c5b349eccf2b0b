"""``triton_forward_grad.slab_forward_stats``, the candidate statistics-only forward (cuBLAS logit slabs and
a row kernel, through the interpreter here): the tile forward's statistics against float64, over one chunk
or several; None where it does not apply.  Rank ties: tests/ops/test_ranks.py ("slab")."""

import pytest
import torch

from hf_mhce.ops import torch_sweep
from reference import make_inputs, requires_triton

pytestmark = requires_triton


def _case(n, d, v, heads, dtype, bias, softcap, rank, neginf):
    hidden, weight, b, labels = make_inputs((n,), d, v, bias=bias, num_heads=heads, logit_std=3.0, dtype=dtype)
    labels = labels.clone()
    labels[1::5] = -1  # the ops' encoding of ignored tokens
    if neginf:  # a masked quarter of the vocabulary, no target in it
        b = b.clone()
        b[v // 4: v // 2] = float("-inf")
        labels[(labels >= v // 4) & (labels < v // 2)] = 0
    g = torch.Generator().manual_seed(n + v)
    low = None
    if rank:
        low = (torch.randn(n, heads, rank, generator=g).to(dtype), (torch.randn(v, rank, generator=g) / rank).to(dtype))
    return hidden, weight, b, labels, low


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,d,v,heads,bias,softcap,rank,neginf", [
    (1, 7, 29, 1, False, None, 0, False),
    (45, 33, 301, 3, True, 20.0, 0, False),
    (60, 24, 1500, 2, True, None, 2, True),  # V above the row kernel's block of 1024
    (37, 16, 61, 1, True, 4.0, 3, False),
])
@pytest.mark.parametrize("chunks", ["one", "several"])
def test_statistics_match_float64(dtype, n, d, v, heads, bias, softcap, rank, neginf, chunks, monkeypatch):
    from hf_mhce.ops import triton_forward_grad as fg

    x, w, b, labels, low = _case(n, d, v, heads, dtype, bias, softcap, rank, neginf)
    if chunks == "several":
        monkeypatch.setattr(fg, "MIN_ROWS", 4)
        row_bytes = heads * (-(-v // 8) * 8) * 4
        monkeypatch.setenv("HF_MHCE_WORKSPACE_MB", str(8 * row_bytes * 8 / 7 / 2**20))  # 8 tokens a chunk
        assert fg.chunk_rows(n, v, d, heads, dtype, False, fg.workspace_bytes()) == min(n, 8)
    got = fg.slab_forward_stats(x, w, b, labels, heads, softcap, True, need_ranks=heads == 1, low_rank=low)
    double = (lambda t: None if t is None else t.double())
    want = torch_sweep.forward_stats(double(x), double(w), double(b), labels, heads, softcap, True,
                                     need_ranks=heads == 1, low_rank=None if low is None else tuple(map(double, low)))
    valid = labels >= 0
    for name in ("lse", "target", "logit_sum"):
        g, r = getattr(got, name)[valid], getattr(want, name)[valid]
        assert g.dtype == torch.float32, name
        finite = torch.isfinite(r)
        assert torch.equal(torch.isfinite(g), finite), name  # -inf bias: an infinite logit sum, as torch's
        assert torch.equal(g[~finite].double(), r[~finite]), name
        if finite.any():
            scale = r[finite].abs().max().clamp_min(1.0)
            assert (g[finite].double() - r[finite]).abs().max() <= 2e-5 * scale * max(1.0, d ** 0.5), name
    if heads == 1:  # rank counts from float32 logits vs float64: equal away from near-ties
        mismatch = (got.ranks[valid] != want.ranks[valid]).float().mean()
        assert mismatch <= 0.05, (got.ranks[valid], want.ranks[valid])


def test_none_where_it_does_not_apply(monkeypatch):
    from hf_mhce.ops import triton_forward_grad as fg

    x, w, b, labels, _ = _case(20, 8, 50, 2, torch.float32, True, None, 0, False)
    assert fg.slab_forward_stats(x, w, b, labels, 2, None, False, need_ranks=True) is None  # mixture ranks
    assert fg.slab_forward_stats(x, w, b, labels, 2, None, False) is not None
    monkeypatch.setenv("HF_MHCE_WORKSPACE_MB", "0.0001")  # not one token's slab row
    assert fg.slab_forward_stats(x, w, b, labels, 2, None, False) is None
