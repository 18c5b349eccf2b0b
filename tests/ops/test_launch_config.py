"""Launch settings of the Triton kernels (interpreter): vocabulary splits of the forward and of the
several-head rank sweep, and the grouped tile order of the backward give the float64 results for any
setting, including splits that do not divide the vocabulary blocks, more splits than blocks, partial
groups and odd tile shapes.
The tile sweep (benchmarks/tile_sweep.py) relies on this: any setting it picks computes the same
function."""

import math

import pytest
import torch

import reference as R
from reference import assert_close_scaled, make_inputs, requires_triton, run_with_grads

pytestmark = requires_triton

import hf_mhce  # noqa: E402
from hf_mhce.ops import torch_sweep  # noqa: E402


def _triton():
    from hf_mhce.ops import triton_forward, triton_tile

    return triton_forward, triton_tile


def _stats_inputs(n, v, d, heads, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) * (2.0 / math.sqrt(d // heads))
    bias = 0.5 * torch.randn(v, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -1  # ignored tokens
    return x, w, bias, labels


@pytest.mark.parametrize("splits", [1, 2, 3, 4, 50])
@pytest.mark.parametrize("heads", [1, 2])
def test_forward_splits_match_float64(splits, heads):
    """61 columns in blocks of 16: 4 blocks, so 3 splits are uneven and 50 is clamped to 4."""
    fwd, tile = _triton()
    x, w, bias, labels = _stats_inputs(37, 61, 32, heads, seed=splits * 10 + heads)
    ref = torch_sweep.forward_stats(x.double(), w.double(), bias.double(), labels, heads, None, True, True)
    with tile.override_tiles("forward", SPLITS=splits, BLOCK_V=16):
        got = fwd.forward_stats(x, w, bias, labels, heads, None, True, True)
    valid = labels >= 0
    for name in ("lse", "target", "logit_sum"):
        assert_close_scaled(getattr(got, name)[valid], getattr(ref, name)[valid].float(), name=name)
    assert torch.equal(got.ranks[valid], ref.ranks[valid])


@pytest.mark.parametrize("splits", [1, 2, 3, 50])
@pytest.mark.parametrize("heads", [2, 4])
def test_mixture_rank_splits_count_every_entry_once(splits, heads):
    """The several-head rank sweep's vocabulary splits (83 columns in 16-column blocks: 6 blocks, 3 splits
    uneven, 50 clamped): the counts of integer data with exact ties equal the float64 count, for any split
    (rows with an entry within float32 rounding of the target left out)."""
    fwd, tile = _triton()
    g = torch.Generator().manual_seed(splits + 7 * heads)
    n, v, d = 29, 83, 32
    x = torch.randint(-2, 3, (n, d), generator=g).float()
    w = torch.randint(-2, 3, (v, d), generator=g).float()
    labels = torch.randint(0, v - 1, (n,), generator=g)
    w[labels[:12] + 1] = w[labels[:12]]  # rows equal to a target's, across split edges too: exact ties
    labels[::7] = -1
    mix = torch.einsum("nhd,vhd->nhv", x.double().view(n, heads, -1), w.double().view(v, heads, -1))
    mix = mix.log_softmax(-1).logsumexp(1) - math.log(heads)
    valid = labels >= 0
    gap = mix[valid] - mix[valid].gather(1, labels[valid, None])
    expected = (gap > 0).sum(1)
    # float32 decides entries within its rounding of the target apart from the exact ties: leave out rows with one
    clear = ((gap.abs() > 1e-4) | (gap == 0)).all(1)
    with tile.override_tiles("ranks", SPLITS=splits, BLOCK_V=16):
        got = fwd.forward_stats(x, w, None, labels, heads, None, False, need_ranks=True)
    assert torch.equal(got.ranks[valid][clear], expected[clear])
    assert clear.sum() >= 0.5 * valid.sum() and (gap[clear] == 0).sum() > clear.sum()  # exact ties beyond the target
    assert expected.unique().numel() > 5  # informative: ranks vary


def test_forward_splits_exact_same_ranks_and_close_lse():
    """Splitting only regroups the tiles: ranks are identical, lse equal up to float32 rounding."""
    fwd, tile = _triton()
    x, w, bias, labels = _stats_inputs(20, 150, 16, 1, seed=3)
    with tile.override_tiles("forward", SPLITS=1):
        one = fwd.forward_stats(x, w, None, labels, 1, 30.0, True, True)
    with tile.override_tiles("forward", SPLITS=5):
        five = fwd.forward_stats(x, w, None, labels, 1, 30.0, True, True)
    assert torch.equal(one.ranks, five.ranks)
    assert torch.equal(one.target, five.target)
    torch.testing.assert_close(one.lse, five.lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(one.logit_sum, five.logit_sum, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group_n", [1, 2, 3, 64, 1 << 30])  # 1 << 30: GROUP_N x blocks > 2^31 (int64 in the kernel; the interpreter cannot show an int32 wrap, a GPU would)
@pytest.mark.parametrize("heads", [1, 4])
def test_backward_grouped_order_matches_float64(group_n, heads):
    """N=37 in blocks of 16 is 3 token blocks: groups of 2 leave a partial group, 64 is one group."""
    _, tile = _triton()
    hidden, weight, b, labels = make_inputs((37,), 32, 61, bias=True, num_heads=heads, ignore_frac=0.2, logit_std=2.5)
    with tile.override_tiles("backward", GROUP_N=group_n), tile.override_tiles("forward", SPLITS=2):
        ours = run_with_grads(hf_mhce.multi_head_cross_entropy, hidden, weight, labels, heads, bias=b, backend="triton")
    ref = run_with_grads(R.reference_loss, hidden, weight, labels, heads, bias=b, dtype=torch.float64)
    for name, o, r in zip(["loss", "d_hidden", "d_weight", "d_bias"], ours, ref):
        assert_close_scaled(o, r, rtol=1e-5, atol=1e-6, name=name)


@pytest.mark.parametrize("kernel,settings", [
    ("forward", {"BLOCK_N": 32, "BLOCK_V": 64, "BLOCK_K": 32}),
    ("backward", {"BLOCK_N": 32, "BLOCK_V": 16, "BLOCK_K": 32, "GROUP_N": 1}),
])
def test_other_tile_shapes(kernel, settings):
    _, tile = _triton()
    hidden, weight, b, labels = make_inputs((45,), 48, 77, bias=True, ignore_frac=0.1)
    with tile.override_tiles(kernel, **settings):
        ours = run_with_grads(hf_mhce.linear_cross_entropy, hidden, weight, labels, bias=b, backend="triton")
    ref = run_with_grads(R.reference_loss, hidden, weight, labels, 1, bias=b, dtype=torch.float64)
    for name, o, r in zip(["loss", "d_hidden", "d_weight", "d_bias"], ours, ref):
        assert_close_scaled(o, r, rtol=1e-5, atol=1e-6, name=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("capability", [(9, 0), (8, 0)], ids=["hopper", "ampere"])
def test_gpu_settings_keep_rank_ties(monkeypatch, dtype, capability):
    """On a GPU the rank kernel must accumulate its tiles like the forward's target tile (same BLOCK_K
    and num_warps) for exact ties, for every dtype and architecture; float32 (FMA products, operands in
    registers) takes BLOCK_K 16, where ptxas spills least (benchmarks/results/compile-check-2026-11-24-sweep.md).
    Hopper's 16-bit forward takes the H100 sweep's 128 x 256 tiles; elsewhere (not timed there) the
    default 64 x 128."""
    _, tile = _triton()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(tile, "_capability", lambda device: capability)
    cuda = torch.device("cuda", 0)
    fwd, ranks, bwd = (tile.launch_config(k, dtype, cuda) for k in ("forward", "ranks", "backward"))
    assert (ranks["BLOCK_K"], ranks["num_warps"]) == (fwd["BLOCK_K"], fwd["num_warps"])
    if dtype == torch.float32:
        assert fwd["BLOCK_K"] == bwd["BLOCK_K"] == 16
        assert (fwd["BLOCK_N"], fwd["BLOCK_V"]) == (64, 128)
    else:
        assert (fwd["BLOCK_K"], bwd["BLOCK_K"]) == (64, 32)
        assert (fwd["BLOCK_N"], fwd["BLOCK_V"]) == ((128, 256) if capability == (9, 0) else (64, 128))
    assert tile.launch_config("forward", dtype) == tile.launch_config("forward", dtype, torch.device("cpu"))
    monkeypatch.setattr(torch.version, "hip", "6.4")  # ROCm: an MI300 reports capability 9 as well
    assert tile.launch_config("forward", dtype, cuda) == tile.launch_config("forward", dtype)


def test_override_is_scoped_and_validated():
    _, tile = _triton()
    before = tile.launch_config("backward", torch.float32)
    with tile.override_tiles("backward", GROUP_N=5):
        with tile.override_tiles("backward", BLOCK_V=64):
            inner = tile.launch_config("backward", torch.float32)
            assert (inner["GROUP_N"], inner["BLOCK_V"]) == (5, 64)
        assert tile.launch_config("backward", torch.float32)["BLOCK_V"] == before["BLOCK_V"]
    assert tile.launch_config("backward", torch.float32) == before
    with pytest.raises(ValueError, match="unknown setting.*SPLITS"):
        with tile.override_tiles("backward", SPLITS=2):
            pass
    with pytest.raises(ValueError, match="unknown kernel"):
        with tile.override_tiles("sideways", BLOCK_N=16):
            pass


def test_auto_splits_fill_the_device():
    _, tile = _triton()
    cpu = torch.device("cpu")
    assert tile.vocab_splits(64, 1002, cpu, 3) == 3
    assert tile.vocab_splits(64, 2, cpu, 3) == 2  # never more splits than vocabulary blocks
    assert tile.vocab_splits(64, 1002, cpu, None) == 1  # one "SM" off CUDA: 64 programs suffice
    assert tile.vocab_splits(1, 1002, cpu, None) == 2
    assert tile.vocab_splits(0, 1002, cpu, None) == 2  # an empty batch: nothing launches, no division by 0


def test_empty_batch_with_automatic_vocab_splits():
    """SPLITS=None (the GPU default: splits sized to the SMs) with no tokens: loss 0, zero gradients."""
    _, triton_tile = _triton()
    w = torch.randn(13, 8, requires_grad=True)
    x = torch.randn(0, 8, requires_grad=True)
    with triton_tile.override_tiles("forward", SPLITS=None):
        loss = hf_mhce.linear_cross_entropy(x, w, torch.zeros(0, dtype=torch.long), backend="triton")
    loss.backward()
    assert loss.item() == 0.0 and (w.grad == 0).all() and x.grad.shape == (0, 8)
