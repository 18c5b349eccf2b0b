"""RBEStats and decompose: hand-worked values, the exact identity, merging and state."""

import math

import pytest
import torch

from hf_mhce.rbe import RBEStats, decompose
from hf_mhce.rbe.stats import check_identity


def test_hand_worked_uniform_confidence():
    # n = (2, 1, 0, 1), mean NLL per rank ln2, ln4, -, ln4 -> Q = (1/2, 1/4, 1/4), C = 1, q = p.
    counts = torch.tensor([2, 1, 0, 1, 0])
    sums = torch.tensor([2 * math.log(2), math.log(4), 0.0, math.log(4), 0.0], dtype=torch.float64)
    d = decompose(counts, sums)
    assert d.num_tokens == 4
    assert d.error_entropy == pytest.approx(1.5 * math.log(2), rel=1e-12)
    assert d.self_alignment == pytest.approx(0.0, abs=1e-12)
    assert d.confidence == pytest.approx(0.0, abs=1e-12)
    assert d.cross_entropy == pytest.approx(1.5 * math.log(2), rel=1e-12)
    assert (d.top1, d.top5, d.mean_rank) == (0.5, 1.0, 1.0)


def test_hand_worked_misaligned():
    # n_0 = 1 with NLL 0 (Q=1), n_2 = 1 with NLL ln2 (Q=1/2): p = (1/2, 1/2), C = 3/2, q = (2/3, 1/3).
    d = decompose(torch.tensor([1, 0, 1]), torch.tensor([0.0, 0.0, math.log(2)], dtype=torch.float64))
    assert d.error_entropy == pytest.approx(math.log(2), rel=1e-12)
    assert d.self_alignment == pytest.approx(0.5 * math.log(9 / 8), rel=1e-12)
    assert d.confidence == pytest.approx(math.log(1.5), rel=1e-12)
    assert d.cross_entropy == pytest.approx(0.5 * math.log(2), rel=1e-12)
    assert d.top1 == 0.5 and d.top5 == 1.0 and d.mean_rank == 1.0


@pytest.mark.parametrize("seed", range(5))
def test_identity_random(seed):
    g = torch.Generator().manual_seed(seed)
    vocab = 1000
    ranks = torch.randint(0, vocab, (5000,), generator=g)
    ranks = torch.where(torch.rand(5000, generator=g) < 0.4, torch.zeros_like(ranks), ranks // 7)
    nll = torch.rand(5000, generator=g, dtype=torch.float64) * 12 + ranks.double() * 0.01
    stats = RBEStats(vocab).add(ranks, nll)
    d = stats.decompose()
    assert check_identity(d, 1e-9)
    lhs = d.error_entropy + d.self_alignment - d.confidence
    assert abs(lhs - d.cross_entropy) <= 1e-9 * d.cross_entropy
    assert d.cross_entropy == pytest.approx(float(nll.mean()), rel=1e-12)
    assert d.self_alignment >= -1e-12  # a KL divergence


def test_identity_with_huge_nll_does_not_underflow():
    # exp(-2000) underflows in float64; the log-space computation must not.
    d = decompose(torch.tensor([3, 1]), torch.tensor([6000.0, 1500.0], dtype=torch.float64))
    assert math.isfinite(d.confidence) and check_identity(d)


def test_report_table_perplexity_beyond_float32():
    """A cross-entropy above 88.7 nats printed perplexity inf (float32's exp); float64's holds to 709."""
    from hf_mhce.rbe.evaluate import RBEReport

    s = RBEStats(10).add(torch.tensor([3, 4]), torch.tensor([90.0, 95.0], dtype=torch.float64))
    line = next(line for line in RBEReport(s.decompose(), s).table().splitlines() if line.startswith("perplexity"))
    assert float(line.split()[-1]) == pytest.approx(math.exp(92.5), rel=1e-6)


def test_merge_and_state_dict_equal_single_pass():
    g = torch.Generator().manual_seed(0)
    ranks, nll = torch.randint(0, 50, (300,), generator=g), torch.rand(300, generator=g, dtype=torch.float64)
    whole = RBEStats(50).add(ranks, nll)
    a, b = RBEStats(50).add(ranks[:120], nll[:120]), RBEStats(50).add(ranks[120:], nll[120:])
    merged = a.merge(b)
    assert torch.equal(merged.counts, whole.counts)
    assert torch.allclose(merged.nll_sums, whole.nll_sums, rtol=1e-15, atol=1e-13)
    restored = RBEStats(50)
    restored.load_state_dict(merged.state_dict())
    assert restored.decompose() == merged.decompose()


def test_errors():
    with pytest.raises(ValueError, match="no tokens"):
        decompose(torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        RBEStats(10).add(torch.tensor([10]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="cannot merge"):
        RBEStats(10).merge(RBEStats(11))
    with pytest.raises(ValueError, match=r"ranks \(3,\) and nll \(1,\) must have the same size"):
        RBEStats(10).add(torch.tensor([1, 2, 3]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="counts must be non-negative"):
        decompose(torch.tensor([3, -1, 2]), torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="state over 1 ranks does not fit statistics over 10"):
        RBEStats(10).load_state_dict(RBEStats(1).add(torch.tensor([0]), torch.tensor([1.0])).state_dict())


def test_top5_counts_ranks_0_to_4():
    # one token at rank 0 and one at rank 4 (the fifth entry): both in the top 5, half in the top 1
    d = decompose(torch.tensor([1, 0, 0, 0, 1, 1]), torch.tensor([0.1, 0, 0, 0, 2.0, 3.0], dtype=torch.float64))
    assert (d.top1, d.top5, d.mean_rank) == (pytest.approx(1 / 3), pytest.approx(2 / 3), 3.0)


def test_one_observed_rank_has_no_negative_zero():
    """Every token at one rank (a model that ranks every target first): Error-Entropy is 0.0, not the
    -0.0 that the report printed as "-0.000000" and JSON wrote as -0.0."""
    d = RBEStats(7).add(torch.zeros(3, dtype=torch.long), torch.tensor([0.1, 0.2, 0.3])).decompose()
    assert math.copysign(1.0, d.error_entropy) == 1.0 and math.copysign(1.0, d.self_alignment) == 1.0
    assert check_identity(d) and d.top1 == 1.0


def test_infinite_nll_has_its_documented_result():
    """A target masked by a -inf bias has an infinite NLL: CE is inf; if every observed rank's NLL is infinite,
    Confidence is -inf and Self-Alignment NaN (q = 0/0), as decompose's docstring says."""
    inf = float("inf")
    some = decompose(torch.tensor([2, 1, 0]), torch.tensor([inf, 1.0, 0.0], dtype=torch.float64))
    assert some.cross_entropy == inf and some.self_alignment == inf and math.isfinite(some.confidence)
    every = decompose(torch.tensor([2, 1, 0]), torch.tensor([inf, inf, 0.0], dtype=torch.float64))
    assert every.cross_entropy == inf and every.confidence == -inf and math.isnan(every.self_alignment)
    assert every.error_entropy == pytest.approx(-(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3)), rel=1e-12)
