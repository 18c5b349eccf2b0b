"""Target ranks from the fused sweeps vs a brute-force materialised reference, both backends.

rank = number of entries j != t whose probability is strictly above the target's (under the
mixture for several heads); ties count in the target's favour.
"""

import contextlib
import math

import pytest
import torch

from hf_mhce.ops import torch_sweep
from reference import requires_triton

BACKENDS = ["torch", "triton"]


def _forward_stats(backend):
    if backend == "torch":
        return torch_sweep.forward_stats
    if backend == "slab":  # cuBLAS logit slabs and a row kernel (one head): the candidate forward
        from hf_mhce.ops import triton_forward_grad

        return triton_forward_grad.slab_forward_stats
    from hf_mhce.ops import triton_forward

    return triton_forward.forward_stats


def equal_rows_alike(*rows: torch.Tensor) -> torch.Tensor:
    """For each vocabulary row, the index of one row equal to it in every tensor of ``rows`` ([V, ...]
    each): a float64 reference indexed with it gives equal rows bit-equal logits (dgemm does not: it
    may round an entry with its position)."""
    key = torch.cat([r.reshape(len(r), -1).double() for r in rows], 1)
    _, group = torch.unique(key, dim=0, return_inverse=True)
    member = torch.empty(int(group.max()) + 1, dtype=torch.long)
    member[group] = torch.arange(len(key))
    return member[group]


def brute_force_ranks(x, w, bias, labels, heads):
    """Sort-free but fully materialised: compare every entry's mixture log-prob with the target's."""
    n, d = x.shape
    y = torch.einsum("nhd,vhd->nhv", x.double().view(n, heads, d // heads), w.double().view(-1, heads, d // heads))
    if bias is not None:
        y = y + bias.double()
    logp = torch.logsumexp(y - y.logsumexp(-1, keepdim=True), dim=1) - math.log(heads)  # [n, V]
    target = logp.gather(1, labels[:, None])
    above = logp > target
    above[torch.arange(n), labels] = False
    return above.sum(-1)


@pytest.mark.parametrize("backend", [*BACKENDS, "slab"])
@pytest.mark.parametrize("n,v,d", [(1, 7, 16), (37, 61, 16), (20, 150, 32)])
def test_one_head_ranks_with_integer_ties(backend, n, v, d):
    # Small integers: every dot product is exact in float32, so the many equal logits are true ties.
    g = torch.Generator().manual_seed(n * 1000 + v)
    x = torch.randint(-2, 3, (n, d), generator=g).float()
    w = torch.randint(-2, 3, (v, d), generator=g).float()
    bias = torch.randint(-2, 3, (v,), generator=g).float()
    labels = torch.randint(0, v, (n,), generator=g)
    for b in (None, bias):
        stats = _forward_stats(backend)(x, w, b, labels, 1, None, False, need_ranks=True)
        expected = brute_force_ranks(x, w, b, labels, 1)
        assert torch.equal(stats.ranks, expected), (stats.ranks, expected)
    if n > 1:  # and ties with the target (beyond itself) really occur in this data
        logits = x @ w.T
        assert (logits == logits.gather(1, labels[:, None])).sum() > n


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", [2, 4])
def test_mixture_ranks_with_duplicated_rows(backend, heads):
    # Integer data: head logits are exact, so rows duplicating a target's row are exact ties
    # under the mixture too (ties are decided on float32 values; see forward_stats).
    g = torch.Generator().manual_seed(heads)
    n, v, d = 29, 83, 32
    x = torch.randint(-2, 3, (n, d), generator=g).float()
    w = torch.randint(-2, 3, (v, d), generator=g).float()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[5:10] = (x[5:10] @ w.T).argmax(-1)  # some well-ranked targets
    w[labels[:10] + 1 - v * (labels[:10] + 1 >= v)] = w[labels[:10]]  # duplicates of targets: exact ties
    stats = _forward_stats(backend)(x, w, None, labels, heads, None, False, need_ranks=True)
    expected = brute_force_ranks(x, w, None, labels, heads)
    assert torch.equal(stats.ranks, expected)
    assert expected.unique().numel() > 10 and expected.min() <= 2  # informative data: ranks vary


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", [1, 2, 4])
def test_ranks_on_real_valued_logits(backend, heads):
    # Random real-valued inputs (no near-ties at this size and seed): exact agreement.
    g = torch.Generator().manual_seed(11 + heads)
    n, v, d = 31, 97, 32
    x = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) / math.sqrt(d)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[:6] = (x[:6] @ w.T).argmax(-1)
    stats = _forward_stats(backend)(x, w, None, labels, heads, None, False, need_ranks=True)
    assert torch.equal(stats.ranks, brute_force_ranks(x, w, None, labels, heads))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("low_rank,bias,softcap", [(False, False, None), (True, True, 20.0)])
def test_ranks_with_duplicated_real_valued_rows(backend, heads, low_rank, bias, softcap):
    """Rows equal to the target's row are exact ties in one full logits matmul; both sweeps form the
    target logits the way their blocks / tiles form every logit, so they are ties there too (a separate
    dot product rounds differently and put about half of them above the target).  Random real values
    over several vocabulary and token blocks, with the low-rank term, bias and softcap the sweep applies.
    The Triton kernels run here through the interpreter; benchmarks/gpu_ties.py checks them on a GPU."""
    g = torch.Generator().manual_seed(3 + heads)
    n, v, d, r = (300, 1500, 64, 4) if backend == "torch" else (50, 230, 64, 4)  # interpreter: 16 x 32 tiles
    x = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) / math.sqrt(d)
    labels = torch.randint(0, v - 1, (n,), generator=g)
    w[labels + 1] = w[labels]  # each target's row also at the next index (chains included)
    lr = (torch.randn(n, heads, r, generator=g) / 4, torch.randn(v, r, generator=g) / 4) if low_rank else None
    if low_rank:
        lr[1][labels + 1] = lr[1][labels]
    b = torch.randn(v, generator=g) if bias else None
    if bias:
        b[labels + 1] = b[labels]
    stats = _forward_stats(backend)(x, w, b, labels, heads, softcap, False, need_ranks=True, low_rank=lr)

    dh = d // heads  # float64 reference, duplicated rows made exact ties
    y = torch.einsum("nhd,vhd->nhv", x.double().view(n, heads, dh), w.double().view(v, heads, dh))
    if low_rank:
        y = y + torch.einsum("nhr,vr->nhv", lr[0].double(), lr[1].double())
    if bias:
        y = y + b.double()
    y = y[..., equal_rows_alike(w, *([lr[1]] if low_rank else []), *([b] if bias else []))]
    if softcap:
        y = softcap * torch.tanh(y / softcap)
    logp = torch.logsumexp(y - y.logsumexp(-1, keepdim=True), dim=1)
    above = logp > logp.gather(1, labels[:, None])
    above[torch.arange(n), labels] = False
    assert torch.equal(stats.ranks, above.sum(-1))


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("n,v,d,chunk_mb", [(1, 301, 768, None), (2, 301, 768, None), (70, 1003, 32, "0.01"),
                                            (257, 1003, 64, "0.05")], ids=["N=1", "N=2", "tails", "token-tail"])
def test_torch_ties_across_blocks_of_every_shape(heads, n, v, d, chunk_mb, monkeypatch):
    """CPU BLAS rounds an entry with the shape of its product: a separate target matmul of a few rows,
    a product of a few tokens, or a last block of other width gave a duplicated target row a logit
    unequal to the target's, ranked above it (an RBE evaluation of a 6-token batch: 8 of 20 wrong).
    The torch sweep reads targets off its blocks, and every product has at least 16 rows and columns
    (zero-padded, or a window of 16 ending at a last block).  Each duplicate sits in another vocabulary
    block than its target."""
    if chunk_mb is not None:
        monkeypatch.setenv("HF_MHCE_CHUNK_MB", chunk_mb)
    rows, cols = torch_sweep.block_shape(n, v, d, heads, 4, torch_sweep.chunk_bytes())
    assert (n % rows or n < 16) and (v % cols or chunk_mb is None), (rows, cols)  # the shapes this is about
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, d, generator=g)
        w = torch.randn(v, d, generator=g) * 3 / math.sqrt(d)
        labels = torch.randint(0, v, (n,), generator=g)
        for t in labels[::2].tolist():
            w[(t * 7 + v // 2) % v] = w[t]
        stats = torch_sweep.forward_stats(x, w, None, labels, heads, None, False, need_ranks=True)
        # float64, duplicates made exact ties; other entries within float32 rounding of the target (rare) may
        # fall either side, so a token's rank must lie between the counts without and with them
        dh = d // heads
        y = torch.einsum("nhd,vhd->nhv", x.double().view(n, heads, dh), w.double().view(v, heads, dh))
        y = y[..., equal_rows_alike(w)]
        logp = torch.logsumexp(y - y.logsumexp(-1, keepdim=True), dim=1)
        gap = logp - logp.gather(1, labels[:, None])
        gap[torch.arange(n), labels] = -1.0
        near = (gap != 0) & (gap.abs() < 1e-5 * logp.abs().amax())
        low = ((gap > 0) & ~near).sum(-1)
        assert ((stats.ranks >= low) & (stats.ranks <= low + near.sum(-1))).all(), seed
        assert near.sum() <= n // 4 and (gap == 0).sum() >= n // 2  # mostly exact comparisons, and duplicates


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,v,chunk_rows,copies", [(1, 63, None, 20), (2, 301, None, 10), (32, 10, None, 1),
                                                   (45, 301, 8, 3)], ids=["N=1", "N=2", "V=10", "chunk-tail"])
def test_slab_ties_of_every_shape(dtype, n, v, chunk_rows, copies, monkeypatch):
    """The slab forward reads its targets off the chunk's logits, so copies of a target's weight row tie
    with it if the product rounds equal columns alike.  CPU BLAS does not for a product of a few rows
    or columns (a one-token chunk, V = 10, a 5-token last chunk): every product is zero-padded to 16 of
    each (before, the one-token and V = 10 cases ranked duplicates above their targets)."""
    from hf_mhce.ops import triton_forward_grad as fg

    if chunk_rows is not None:  # 45 tokens in chunks of 8: a last chunk of 5
        monkeypatch.setattr(fg, "MIN_ROWS", 4)
        row_bytes = -(-v // 8) * 8 * 4
        monkeypatch.setenv("HF_MHCE_WORKSPACE_MB", str(chunk_rows * row_bytes * 8 / 7 / 2**20))
        assert fg.chunk_rows(n, v, 39, 1, dtype, False, fg.workspace_bytes()) == chunk_rows
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 39, generator=g).to(dtype)
        w = torch.randn(v, 39, generator=g).to(dtype)
        labels = torch.randint(0, v, (n,), generator=g)
        for t in labels.tolist():  # copies of each target's row
            for k in range(copies):
                w[(t * 7 + v // 2 + 3 * k) % v] = w[t]
        stats = fg.slab_forward_stats(x, w, None, labels, 1, None, False, need_ranks=True)
        y = (x.double() @ w.double().T)[:, equal_rows_alike(w)]
        gap = y - y.gather(1, labels[:, None])
        gap[torch.arange(n), labels] = -1.0
        near = (gap != 0) & (gap.abs() < 1e-5 * y.abs().amax())
        low = ((gap > 0) & ~near).sum(-1)
        assert ((stats.ranks >= low) & (stats.ranks <= low + near.sum(-1))).all(), (seed, stats.ranks, low)
        assert (gap == 0).any(1).float().mean() >= 0.5  # most tokens have a duplicate: an exact tie


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_ignore_invalid_and_match_softcap(backend):
    g = torch.Generator().manual_seed(7)
    n, v, d = 23, 57, 16
    x = torch.randint(-2, 3, (n, d), generator=g).float()
    w = torch.randint(-2, 3, (v, d), generator=g).float()
    labels = torch.randint(0, v, (n,), generator=g)
    ops_labels = labels.clone()
    ops_labels[::4] = -1  # ignored tokens must not break the valid ones
    stats = _forward_stats(backend)(x, w, None, ops_labels, 1, 30.0, False, need_ranks=True)
    # softcap is monotone: ranks equal those of the raw logits
    expected = brute_force_ranks(x, w, None, labels, 1)
    valid = ops_labels >= 0
    assert torch.equal(stats.ranks[valid], expected[valid])


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")  # interpreter: log(0)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", [1, 2])
def test_ranks_with_masked_vocabulary(backend, heads, monkeypatch):
    """A -inf bias on a leading block wider than a torch chunk / Triton tile and split (plus scattered
    columns): masked entries never rank above the target, and a masked target ranks below every
    allowed entry (its mixture log-probability is -inf, not NaN)."""
    g = torch.Generator().manual_seed(5 + heads)
    n, v, d = 21, 101, 32
    x = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) / math.sqrt(d)
    bias = torch.randn(v, generator=g)
    bias[:70] = -math.inf
    bias[[75, 88]] = -math.inf
    labels = torch.randint(70, v, (n,), generator=g)
    labels[[1, 2, 9]] = torch.tensor([3, 69, 88])
    monkeypatch.setenv("HF_MHCE_CHUNK_MB", "0.01")  # torch: 4-8 column chunks
    if backend == "triton":
        from hf_mhce.ops.triton_tile import override_tiles

        ctx = override_tiles("forward", SPLITS=2)  # 64-column splits: the first wholly masked
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        stats = _forward_stats(backend)(x, w, bias, labels, heads, None, False, need_ranks=True)
    expected = brute_force_ranks(x, w, bias, labels, heads)
    assert torch.equal(stats.ranks, expected)
    assert (expected[[1, 2, 9]] == int(torch.isfinite(bias).sum())).all()
