"""Materialized reference implementations of the hf_mhce core ops (tests only).

Everything here builds the full [N, H, V] logits tensor with plain torch ops, so it is only meant
for small shapes.  Two flavours share one code path:

* the *float64 reference* (``reference_loss`` / ``reference_logprobs`` on float64 tensors): the
  ground truth that the fused implementation is compared against;
* the *eager low-precision baseline* (``eager_loss`` on bf16 / fp16 tensors): what a plain PyTorch
  (Hugging Face style) implementation does in that dtype -- logits from a matmul in the input dtype,
  then ``.float()`` and the loss statistics in float32.  Low-precision tests only require the fused
  op to be no less accurate than this baseline.

Semantics (see the spec in tests/losses/*.py and BRIEF.md section 2): with H heads, hidden's last
dim and weight's columns are split into H contiguous slices; head logits
``y[n, h, j] = softcap(x[n, h-slice] . W[j, h-slice] + b[j])``; ``lse_h = logsumexp_j y_h``;
``pbar = mean_h softmax(y_h)``; per token (non-ignored, target t)::

    (1 - eps) * (-log pbar_t) + eps * mean_h [lse_h - mean_j y_hj] + z_loss * mean_h lse_h^2
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode


def _have_triton() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


HAVE_TRITON = _have_triton()

# Skip only when `import triton` fails (triton is installed in CI, so those tests must run there).
requires_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")

__all__ = [
    "head_logits",
    "per_token_loss",
    "reduce_loss",
    "reference_loss",
    "reference_logprobs",
    "eager_loss",
    "eager_logprobs",
]


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def head_logits(hidden, weight, num_heads, bias=None, softcap=None):
    """[..., D] x [V, D] -> [N, H, V] head logits in the statistics dtype.

    The matmul runs in the inputs' dtype (float64 for the reference, bf16/fp16 for the eager
    baseline), then the result is upcast, like ``logits.float()`` in transformers.
    """
    D = hidden.shape[-1]
    V = weight.shape[0]
    H = num_heads
    assert D % H == 0
    d = D // H
    x = hidden.reshape(-1, H, d)  # [N, H, d]
    w = weight.reshape(V, H, d)  # [V, H, d]
    sd = _stat_dtype(hidden.dtype)
    # Per head matmul in the input dtype: [H, N, d] @ [H, d, V] -> [H, N, V]
    z = torch.bmm(x.transpose(0, 1), w.permute(1, 2, 0)).transpose(0, 1)  # [N, H, V]
    z = z.to(sd)
    if bias is not None:
        z = z + bias.to(sd)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


def per_token_loss(
    hidden,
    weight,
    labels,
    num_heads=1,
    *,
    bias=None,
    ignore_index=-100,
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
):
    """Per-token loss, flattened to [N]; exactly 0 at ignored positions."""
    y = head_logits(hidden, weight, num_heads, bias=bias, softcap=softcap)  # [N, H, V]
    N, H, V = y.shape
    lab = labels.reshape(-1)
    assert lab.numel() == N
    mask = lab != ignore_index
    tgt = torch.where(mask, lab, torch.zeros_like(lab))
    lse = torch.logsumexp(y, dim=-1)  # [N, H]
    y_t = y.gather(-1, tgt.view(N, 1, 1).expand(N, H, 1)).squeeze(-1)  # [N, H]
    logp_t = y_t - lse  # log p_{h,t}
    # -log pbar_t with a two-level logsumexp (over V per head, then over heads).
    nll = -(torch.logsumexp(logp_t, dim=-1) - math.log(H))
    loss = nll
    if label_smoothing:
        smooth = (lse - y.mean(dim=-1)).mean(dim=-1)
        loss = (1.0 - label_smoothing) * nll + label_smoothing * smooth
    if z_loss:
        loss = loss + z_loss * (lse**2).mean(dim=-1)
    return torch.where(mask, loss, torch.zeros_like(loss)), mask


def reduce_loss(loss, mask, labels_shape, reduction="mean", num_items_in_batch=None):
    if reduction == "none":
        assert num_items_in_batch is None
        return loss.reshape(labels_shape)
    total = loss.sum()
    if num_items_in_batch is not None:
        n = num_items_in_batch
        if isinstance(n, torch.Tensor):
            n = n.item()
        if n == 0:
            # Only defined (and only tested) for all-ignored batches: 0 / 0 -> 0.
            assert not bool(mask.any())
            return total * 0.0
        return total / n
    if reduction == "sum":
        return total
    assert reduction == "mean"
    count = int(mask.sum())
    if count == 0:
        return total * 0.0  # all ignored: 0 (not NaN), keeps the graph for zero grads
    return total / count


def reference_loss(
    hidden,
    weight,
    labels,
    num_heads=1,
    *,
    bias=None,
    ignore_index=-100,
    reduction="mean",
    num_items_in_batch=None,
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
):
    """Loss with the semantics of hf_mhce.multi_head_cross_entropy.

    Pass float64 tensors for the ground truth.  Differentiable with plain autograd.
    """
    loss, mask = per_token_loss(
        hidden,
        weight,
        labels,
        num_heads,
        bias=bias,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
    )
    return reduce_loss(loss, mask, labels.shape, reduction, num_items_in_batch)


def reference_logprobs(hidden, weight, num_heads=1, *, bias=None, softcap=None):
    """log pbar, shaped [..., V] (mixture log-probabilities)."""
    y = head_logits(hidden, weight, num_heads, bias=bias, softcap=softcap)  # [N, H, V]
    logp = torch.log_softmax(y, dim=-1)
    out = torch.logsumexp(logp, dim=1) - math.log(num_heads)
    return out.reshape(*hidden.shape[:-1], weight.shape[0])


def eager_loss(hidden, weight, labels, num_heads=1, *, bias=None, softcap=None, **kw):
    """Eager baseline in the inputs' dtype (what transformers does for H=1).

    H=1 without softcap: ``F.linear(x, w, b).float()`` then ``F.cross_entropy`` (plus z-loss /
    num_items handling from ``reduce_loss``).  Otherwise the per-head logits come from the same
    low-precision matmul and the statistics run in float32.
    """
    if num_heads == 1 and softcap is None and not kw.get("z_loss"):
        ignore_index = kw.get("ignore_index", -100)
        reduction = kw.get("reduction", "mean")
        num_items = kw.get("num_items_in_batch")
        logits = F.linear(hidden, weight, bias).float()
        V = weight.shape[0]
        flat = F.cross_entropy(
            logits.reshape(-1, V),
            labels.reshape(-1),
            ignore_index=ignore_index,
            reduction="none",
            label_smoothing=kw.get("label_smoothing", 0.0),
        )
        mask = labels.reshape(-1) != ignore_index
        return reduce_loss(flat, mask, labels.shape, reduction, num_items)
    return reference_loss(hidden, weight, labels, num_heads, bias=bias, softcap=softcap, **kw)


def eager_logprobs(hidden, weight, num_heads=1, *, bias=None, softcap=None):
    return reference_logprobs(hidden, weight, num_heads, bias=bias, softcap=softcap)


# ----------------------------------------------------------------------------------------------
# Test helpers shared by tests/losses and tests/ops.
# ----------------------------------------------------------------------------------------------


def make_inputs(
    lead,
    D,
    V,
    *,
    dtype=torch.float32,
    bias=False,
    num_heads=1,
    ignore_frac=0.0,
    ignore_index=-100,
    logit_std=1.5,
):
    """Random (never zero) inputs.

    hidden ~ N(0, 1); weight ~ N(0, 1) * logit_std / sqrt(D / H) so every head's logits have std
    ~logit_std (non-trivial, non-uniform softmaxes).  Labels uniform in [0, V); a fraction
    ``ignore_frac`` is set to ``ignore_index`` but at least one token always stays a target.
    The tensors are rounded to ``dtype`` once and returned in ``dtype``.
    """
    if isinstance(lead, int):
        lead = (lead,)
    lead = tuple(lead)
    d = D // num_heads
    hidden = torch.randn(*lead, D)
    weight = torch.randn(V, D) * (logit_std / math.sqrt(d))
    b = (torch.randn(V) * 0.5) if bias else None
    labels = torch.randint(0, V, lead, dtype=torch.long)
    if ignore_frac:
        drop = torch.rand(lead) < ignore_frac
        labels[drop] = ignore_index
    flat = labels.view(-1)
    if not bool((flat != ignore_index).any()):
        flat[0] = 0
    hidden = hidden.to(dtype)
    weight = weight.to(dtype)
    if b is not None:
        b = b.to(dtype)
    return hidden, weight, b, labels


def run_with_grads(fn, hidden, weight, labels, *args, bias=None, grad_out=None, dtype=None, **kw):
    """Call ``fn`` on fresh leaf copies (optionally cast to ``dtype``) and backprop.

    ``grad_out``: None -> ones (scalar or per-token); otherwise a tensor (cast to the loss dtype).
    Returns (out, d_hidden, d_weight, d_bias) with the outputs detached.
    """

    def leaf(t):
        if t is None:
            return None
        t = t.detach().clone()
        if dtype is not None:
            t = t.to(dtype)
        return t.requires_grad_(True)

    h, w, b = leaf(hidden), leaf(weight), leaf(bias)
    out = fn(h, w, labels, *args, bias=b, **kw)
    g = torch.ones_like(out) if grad_out is None else grad_out.to(out.dtype)
    out.backward(g)
    return out.detach(), h.grad, w.grad, (b.grad if b is not None else None)


def assert_close_scaled(actual, expected, *, rtol=1e-5, atol=1e-6, name=""):
    """|actual - expected| <= atol * max|expected| + rtol * |expected| elementwise.

    The absolute part is *relative to the tensor's largest magnitude* (not a fixed number): it only
    matters for entries that are near 0 compared with the rest of the tensor (cancellations such as
    sum_j (p_j - onehot_j) W_j), and it stays meaningful for tensors whose entries are all tiny
    (dW with V=50257 has most entries ~1e-5).
    """
    assert actual is not None, f"{name}: missing"
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    assert torch.isfinite(a).all(), f"{name}: non-finite values"
    scale = e.abs().max().item() if e.numel() else 0.0
    assert scale > 0 or not e.numel(), f"{name}: reference is all zeros (test would be vacuous)"
    torch.testing.assert_close(a, e, rtol=rtol, atol=atol * scale, msg=lambda m: f"{name}: {m}")


def low_precision_tol(dtype, ref):
    """Slack allowed on top of the eager baseline's error, in the same (L2) norm.

    0.5 * finfo(dtype).eps is the unit roundoff u of the input dtype (bf16: 3.9e-3, fp16: 4.9e-4),
    so the slack is u * ||ref||: "at most one extra rounding of every element to the input dtype".
    An implementation that returns dX/dW in the input dtype necessarily rounds each element once,
    and one with the same rounding profile as eager (logits rounded to the input dtype) differs from
    eager by accumulation order only; both stay well inside this.  Real bugs (a missing term, a
    mis-scaled gradient, dropped vocabulary tiles, low-precision accumulation of statistics) give
    errors far larger than one rounding per element.
    """
    return 0.5 * torch.finfo(dtype).eps * ref.detach().double().norm().item()


def assert_no_worse_than_eager(ours, eager, ref, dtype, *, name=""):
    """||ours - ref64|| <= ||eager - ref64|| + low_precision_tol."""
    assert ours is not None, f"{name}: missing"
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    o = ours.detach().double()
    assert torch.isfinite(o).all(), f"{name}: non-finite values"
    r = ref.detach().double()
    assert r.abs().max() > 0, f"{name}: reference is all zeros (test would be vacuous)"
    e_ours = (o - r).norm().item()
    e_eager = (eager.detach().double() - r).norm().item()
    tol = low_precision_tol(dtype, r)
    assert e_ours <= e_eager + tol, (
        f"{name}: |ours-ref|={e_ours:.3e} > |eager-ref|={e_eager:.3e} + tol={tol:.3e} "
        f"(|ref|={r.norm().item():.3e})"
    )


def default_atol(V):
    """1e-6 (relative to the tensor's max, see assert_close_scaled) for V up to ~1k; grows like
    sqrt(V) beyond, as fp32 rounding of sums over V terms does (dX = sum_j (p_j - onehot_j) W_j):
    an exact fp32 eager computation needs ~2e-6 at V=50257, H=8."""
    return 1e-6 * max(1.0, math.sqrt(V / 1031))


def grad_out_for(reduction, labels, dtype=torch.float32):
    """Incoming gradient: a random scalar, or (reduction "none") arbitrary per-token values --
    including at ignored positions, which must not leak into the gradients."""
    if reduction == "none":
        return torch.randn(labels.shape, dtype=dtype) * 2.0
    return torch.tensor(1.0 + torch.rand(()).item() * 2.0, dtype=dtype)


# ----------------------------------------------------------------------------------------------
# Masked vocabularies (-inf bias entries): torch's values, not NaN.
# ----------------------------------------------------------------------------------------------


def masked_vocab_loss(hidden, weight, labels, num_heads=1, *, bias, label_smoothing=0.0, z_loss=0.0):
    """Per-token loss [N] (0 where ignored, label -100) for a bias with -inf entries, differentiable.

    One head: ``F.cross_entropy`` itself (inf for a masked target or with label smoothing, finite
    gradients).  Several heads: the mixture loss where the target is allowed; where it is masked in
    every head, the mean over heads of torch's per-head cross-entropy -- the library's convention
    (the heads' responsibilities for a target of probability 0 are 0/0; it takes equal shares).
    Built row subset by row subset: a logsumexp over all -inf entries has a NaN backward.
    """
    y = head_logits(hidden, weight, num_heads, bias=bias)  # [N, H, V]
    n, h, _ = y.shape
    valid = labels.reshape(-1) != -100
    t = torch.where(valid, labels.reshape(-1), torch.zeros_like(labels.reshape(-1)))
    lse = torch.logsumexp(y, dim=-1)
    loss = torch.stack([F.cross_entropy(y[:, i], t, reduction="none", label_smoothing=label_smoothing)
                        for i in range(h)], 1).mean(1)
    y_t = y.gather(2, t.view(n, 1, 1).expand(n, h, 1))[..., 0]
    allowed = (valid & torch.isfinite(y_t[:, 0])).nonzero()[:, 0]
    if h > 1 and allowed.numel():
        mix = math.log(h) - torch.logsumexp(y_t[allowed] - lse[allowed], dim=1)
        if label_smoothing:
            mix = (1.0 - label_smoothing) * mix + label_smoothing * (lse - y.mean(-1)).mean(1)[allowed]
        loss = loss.index_put((allowed,), mix)
    if z_loss:
        loss = loss + z_loss * lse.square().mean(1)
    return torch.where(valid, loss, torch.zeros_like(loss))


def masked_vocab_logprobs(hidden, weight, num_heads=1, *, bias):
    """log pbar [N, V] for a bias with -inf entries, differentiable.  One head: ``log_softmax``, whose
    gradient reaches masked entries (d log p_j / d y_j = 1 - p_j = 1).  Several heads: at entries
    masked in every head the mean of the heads' log-probabilities (-inf), i.e. the library's
    convention of equal shares 1/H for the 0/0 responsibilities there; the mixture elsewhere."""
    logp = torch.log_softmax(head_logits(hidden, weight, num_heads, bias=bias), dim=-1)  # [N, H, V]
    if num_heads == 1:
        return logp[:, 0]
    masked = torch.isneginf(logp).all(dim=1).all(dim=0)  # [V]; a -inf bias masks a column in every row
    keep, drop = (~masked).nonzero()[:, 0], masked.nonzero()[:, 0]
    out = torch.zeros(logp.shape[0], logp.shape[2], dtype=logp.dtype)
    out = out.index_copy(1, keep, torch.logsumexp(logp[:, :, keep], dim=1) - math.log(num_heads))
    return out.index_copy(1, drop, logp[:, :, drop].mean(1))


def assert_same_nonfinite(actual, expected, *, name="", **tol):
    """Equal infinities (and no NaN) where ``expected`` is infinite, close elsewhere."""
    a, e = actual.detach().double(), expected.detach().double()
    assert not a.isnan().any(), f"{name}: NaN"
    inf = e.isinf()
    assert torch.equal(a[inf], e[inf]), f"{name}: infinities differ"
    if (e[~inf] != 0).any():
        assert_close_scaled(a[~inf], e[~inf], name=name, **tol)
    else:  # only ignored tokens are finite (label smoothing): exact zeros
        assert torch.equal(a[~inf], e[~inf]), f"{name}: finite entries differ"


class LargestOutput(TorchDispatchMode):
    """Records the largest tensor any aten op returns: ``largest`` (elements) and ``largest_bytes`` (of its
    storage, so that a view of a larger buffer counts as that buffer)."""

    def __init__(self):
        super().__init__()
        self.largest = self.largest_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                self.largest_bytes = max(self.largest_bytes, t.untyped_storage().nbytes())
        return out
