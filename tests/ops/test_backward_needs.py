"""Every subset of gradients the backward can be asked for (hidden, weight, bias, low-rank U and B):
``triton_backward.backward`` (interpreter) and ``torch_sweep.backward`` against float64 on the
widened operands (x_h | U_h, W_h | B per head).

Each subset takes its own branch of the Triton backward (fused pass, dW pass, dX pass over token
ranges, side gradients only); a gradient computed only in a pass that the subset skips comes back
as zeros (as dU did for a trainable head plus LoRA over a frozen body, 16-bit).  The ops are called
directly, after one forward per case, to keep the interpreter's time down; which subset autograd
asks for is tests/losses/test_low_rank.py's.  Odd sizes: N = 1 and 17 (one token block and a
bit), V = 37 (a partial vocabulary block), D = 7 and head width 5, R = 17 (two K blocks); 16-bit also under
a workspace so small that the dW and dX passes each run over two ranges.
"""

import functools
import itertools

import pytest
import torch

import reference as R
from hf_mhce.ops import mixture, torch_sweep
from reference import HAVE_TRITON, assert_close_scaled, default_atol

NAMES = ("hidden", "weight", "bias", "U", "B")
SUBSETS = [m for m in itertools.product((False, True), repeat=5) if any(m)]
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAVE_TRITON, reason="no triton"))]
SHAPES = {"N17-D10-H2": (17, 10, 37, 2, 3), "N1-D7-H1-R17": (1, 7, 37, 1, 17)}  # N, D, V, heads, R
# "0.001" MB (1048 bytes): under one interpreter tile of everything, so the dW pass sums slabs of 16 tokens
# into a float32 accumulator and the dX pass slabs of 32 columns
# float32 under "0.001" MB: slabs of 16 tokens, dW and dX added into the outputs across slabs
CONFIGS = {"fp32": (torch.float32, None), "fp32-ranges": (torch.float32, "0.001"), "fp16": (torch.float16, None),
           "bf16-split": (torch.bfloat16, "0.001")}
LABEL_SMOOTHING, Z_LOSS, SOFTCAP = 0.1, 1e-3, 5.0


def _ids(mask):
    return "+".join(n for n, f in zip(NAMES, mask) if f)


@functools.lru_cache(maxsize=None)
def _case(shape, dtype):
    """Inputs (x, w, bias, U, B) in ``dtype``, labels (-1: ignored), backward coefficients of
    sum_n g_n loss_n, and the float64 gradients of that sum on the widened operands."""
    n, d, v, heads, rank = SHAPES[shape]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, d, generator=gen)
    w = torch.randn(v, d, generator=gen) / (d // heads) ** 0.5
    bias = torch.randn(v, generator=gen) * 0.5
    u = torch.randn(n, heads, rank, generator=gen)
    b = torch.randn(v, rank, generator=gen) / rank ** 0.5
    g = torch.randn(n, generator=gen)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[0] = v - 1  # a target in the partial vocabulary block
    labels[3::5] = -100
    tensors = [t.to(dtype) for t in (x, w, bias, u, b)]
    x, w, bias, u, b = tensors

    valid = labels != -100
    ops_labels = torch.where(valid, labels, -1)
    stats = torch_sweep.forward_stats(x, w, bias, ops_labels, heads, SOFTCAP, True, low_rank=(u, b))
    alpha, target_grad, gamma = mixture.grad_coefficients(stats.lse, stats.log_p_target, valid, g, v, LABEL_SMOOTHING, Z_LOSS)
    coefficients = (ops_labels, stats.top, stats.log_sum, alpha.contiguous(), target_grad.contiguous(), gamma.contiguous())

    x64, w64, bias64, u64, b64 = (t.double().requires_grad_() for t in tensors)
    xs = torch.cat([x64.unflatten(-1, (heads, d // heads)), u64], dim=-1).flatten(-2)
    ws = torch.cat([w64.unflatten(-1, (heads, d // heads)), b64.unsqueeze(1).expand(v, heads, rank)], -1).flatten(-2)
    loss = R.reference_loss(xs, ws, labels, heads, bias=bias64, reduction="none", label_smoothing=LABEL_SMOOTHING,
                            z_loss=Z_LOSS, softcap=SOFTCAP)
    (loss * g.double()).sum().backward()
    return tensors, coefficients, [t.grad for t in (x64, w64, bias64, u64, b64)]


def _check(backend, shape, config, mask, monkeypatch):
    dtype, workspace_mb = CONFIGS[config]
    if workspace_mb is not None:
        monkeypatch.setenv("HF_MHCE_WORKSPACE_MB", workspace_mb)
    if backend == "triton":
        from hf_mhce.ops.triton_backward import backward
    else:
        backward = torch_sweep.backward
    (x, w, bias, u, b), coefficients, want = _case(shape, dtype)
    needs = (mask[0], mask[1], mask[2], mask[3], mask[4])  # the ops' order: dX, dW, dB, dU, dB_low
    got = backward(x, w, bias, *coefficients, SHAPES[shape][3], SOFTCAP, needs, low_rank=(u, b))
    for name, m, grad, ref in zip(NAMES, mask, got, want):
        if not m:
            assert grad is None, name
            continue
        assert grad is not None and grad.dtype == dtype, name
        if dtype == torch.float32:
            assert_close_scaled(grad, ref, rtol=1e-5, atol=default_atol(37), name=name)
        else:  # 16-bit logits and outputs: a few roundings of the input dtype (a skipped pass is off by 100 %)
            eps = torch.finfo(dtype).eps
            assert_close_scaled(grad, ref, rtol=4 * eps, atol=4 * eps, name=name)


@pytest.mark.parametrize("mask", [m for m in SUBSETS if m[3]], ids=_ids)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_subsets_with_low_rank_u(backend, shape, config, mask, monkeypatch):
    _check(backend, shape, config, mask, monkeypatch)


@pytest.mark.parametrize("mask", [m for m in SUBSETS if not m[3]], ids=_ids)
@pytest.mark.parametrize("backend", BACKENDS)
def test_subsets_without_u(backend, mask, monkeypatch):
    _check(backend, "N17-D10-H2", "bf16-split", mask, monkeypatch)
