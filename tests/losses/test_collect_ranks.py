"""collect_ranks: an evaluation's loss calls feed per-token ranks and NLL from the same sweep."""

import math

import pytest
import torch

from hf_mhce import multi_head_cross_entropy
from hf_mhce.losses import collect_ranks


@pytest.mark.parametrize("heads", [1, 4])
def test_collects_ranks_and_nll_of_counted_tokens(heads):
    g = torch.Generator().manual_seed(heads)
    n, v, d = 40, 73, 32
    x, w = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g) / math.sqrt(d)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -100
    got = []
    with torch.no_grad(), collect_ranks(lambda r, l: got.append((r, l))):
        loss = multi_head_cross_entropy(x, w, labels, heads, label_smoothing=0.1, backend="torch")
    (ranks, nll), = got
    valid = labels != -100
    y = torch.einsum("nhd,vhd->nhv", x.double().view(n, heads, -1), w.double().view(v, heads, -1))
    logp = torch.logsumexp(y.log_softmax(-1), 1) - math.log(heads)
    ref_nll = -logp[valid].gather(1, labels[valid, None])[:, 0]
    ref_rank = (logp[valid] > logp[valid].gather(1, labels[valid, None])).sum(-1)
    assert torch.allclose(nll.double(), ref_nll, rtol=1e-5)
    assert torch.equal(ranks, ref_rank)
    assert loss.isfinite()


def test_no_collection_with_grad_or_outside_context():
    x, w = torch.randn(5, 8, requires_grad=True), torch.randn(11, 8)
    labels = torch.randint(0, 11, (5,))
    got = []
    with collect_ranks(lambda r, l: got.append(r)):
        multi_head_cross_entropy(x, w, labels, 2).backward()  # training step: no ranks
    with torch.no_grad():
        multi_head_cross_entropy(x, w, labels, 2)  # no context: nothing collected
    assert got == []
