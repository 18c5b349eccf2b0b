"""N * V > 2^31 (the peer bug of 32-bit logit offsets): losses and dX rows at both ends of the
token range, against float64 references built from those rows alone (each depends only on its
own row).  Torch path on CPU; the Triton kernels at this size are in benchmarks/gpu_suite.py."""

import math

import torch

from hf_mhce import linear_cross_entropy


def test_more_than_2_pow_31_logits():
    n, v, d = 16_800, 128_256, 8
    assert n * v > 2**31
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g).requires_grad_()
    w = torch.randn(v, d, generator=g) / math.sqrt(d)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[-4:] = torch.tensor([v - 1, v - 2, 0, v // 2])  # extreme targets on the last rows
    losses = linear_cross_entropy(x, w, labels, reduction="none", backend="torch")
    grad_out = torch.rand(n, generator=g, dtype=torch.float32) + 0.5
    losses.backward(grad_out)

    rows = torch.cat([torch.arange(0, 6), torch.arange(n - 6, n)])
    xr = x.detach()[rows].double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(xr @ w.double().T, labels[rows], reduction="none")
    ref.backward(grad_out[rows].double())
    assert torch.allclose(losses.detach()[rows].double(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(x.grad[rows].double(), xr.grad, rtol=1e-5, atol=1e-7)
