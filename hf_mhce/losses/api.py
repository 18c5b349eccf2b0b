"""Public losses: fused linear cross-entropy, multi-head cross-entropy and mixture log-probs."""

from __future__ import annotations

import functools
import inspect
import math

import torch

from . import checks, dispatch
from .collect import active_sink
from .functions import MixtureLogprobs, MultiHeadTokenLoss

# Under torch.compile the fused losses run as they are, between compiled graphs: they are already
# fused sweeps, and tracing them would only meet their data-dependent checks and kernel launches
# (graph breaks with warnings, or dynamo tracing the Triton launch code).  The reason is what
# fullgraph=True's error shows (dynamo otherwise says "reason: None").
_COMPILE_REASON = (
    "hf_mhce's fused losses run as they are, outside torch.compile's graph (their Triton/chunked sweeps "
    "are already fused): compile with fullgraph=False, which breaks the graph once around the loss call "
    "(or, for an MHCE model without labels, around the mixture log-probs)"
)
_opaque_to_compile = (  # older torch has no reason argument
    functools.partial(torch.compiler.disable, reason=_COMPILE_REASON)
    if "reason" in inspect.signature(torch.compiler.disable).parameters else torch.compiler.disable
)


def _autocast(hidden, weight, bias, low_rank=None):
    """Cast like nn.Linear under torch.autocast: to the autocast dtype (differentiably)."""
    pair = tuple(low_rank) if isinstance(low_rank, (tuple, list)) else ()
    tensors = (hidden, weight) + ((bias,) if bias is not None else ()) + pair
    if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tensors):
        return hidden, weight, bias, low_rank  # let the checks name the problem
    device_type = hidden.device.type
    if not torch.is_autocast_enabled(device_type):
        return hidden, weight, bias, low_rank
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):  # autocast leaves float64 alone
        return t if t is None or t.dtype == torch.float64 else t.to(dtype)

    pair = tuple(cast(t) for t in pair) if pair else low_rank
    return cast(hidden), cast(weight), cast(bias), pair


def _divisor(valid, reduction, num_items_in_batch, dtype):
    """What the summed loss is divided by, a 0-dim tensor of the loss's ``dtype`` (1 for a sum, and for
    num_items_in_batch = 0 with every label ignored); None for reduction "none"."""
    if reduction == "none":
        return None
    if num_items_in_batch is not None:
        divisor = torch.as_tensor(num_items_in_batch, device=valid.device).to(dtype).reshape(())
        value = float(divisor)  # one sync for both tests

        def given():  # a count that only rounds to 0 or inf in the loss's dtype: what was passed
            return "" if value == float(num_items_in_batch) else f" ({num_items_in_batch!r} given, as {dtype})"

        if not 0 <= value < math.inf:  # negative, NaN or infinite (which would give a loss of 0)
            raise ValueError(f"num_items_in_batch must be a finite count >= 0, got {value}{given()}")
        if value == 0:
            if bool(valid.any()):
                raise ValueError(f"num_items_in_batch is 0{given()} but some labels are not ignored")
            return torch.ones((), dtype=dtype, device=valid.device)  # all ignored: 0, with zero gradients
        return divisor
    if reduction == "sum":
        return torch.ones((), dtype=dtype, device=valid.device)
    # mean over non-ignored tokens; all ignored gives 0 (torch's cross_entropy gives NaN).
    return valid.sum().clamp_min(1).to(dtype)


def _grad_scale(divisor, hidden):
    """The gradient each valid token gets from ``loss.backward()`` of the reduced loss (DivBackward's own
    1 / divisor, bit for bit), when gradients will be taken; else None."""
    if divisor is None or not torch.is_grad_enabled():
        return None
    return torch.ones((), dtype=torch.float32, device=hidden.device) / divisor.to(torch.float32)


def _reduce(losses, label_shape, divisor):
    if divisor is None:
        return losses.view(label_shape)
    return losses.sum() / divisor  # x / 1 is exact: a sum stays a sum


@_opaque_to_compile
def multi_head_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    num_heads: int,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    backend: str | None = None,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Multi-head cross-entropy of ``hidden @ weight.T`` without materialising the logits.

    The last dimension of ``hidden`` [..., D] and the columns of ``weight`` [V, D] are split into
    ``num_heads`` contiguous slices; head h has logits y_h = softcap(hidden_h @ weight_h.T + bias)
    and the model's distribution is the uniform mixture pbar = mean_h softmax(y_h).  For a token
    with target t (``labels`` aligned with ``hidden``, no shift) the loss is

        (1 - eps) * (-log pbar_t) + eps * mean_h(lse_h - mean_j y_hj) + z_loss * mean_h(lse_h ** 2)

    where eps = ``label_smoothing`` and lse_h = logsumexp_j y_hj: smoothing and z-loss act per head
    (for one head, exactly ``F.cross_entropy(label_smoothing=eps)`` plus ``z_loss * lse ** 2``).

    reduction: "mean" (over non-ignored tokens; 0 if all are ignored, where torch gives NaN),
    "sum", or "none" (per-token, shaped like ``labels``, 0 where ignored).  With
    ``num_items_in_batch`` the result is the summed loss divided by it (transformers' gradient
    accumulation convention).  The loss is float32 (float64 for float64 inputs).

    dtypes: ``hidden`` and ``weight`` share a dtype (fp32, bf16, fp16; float64 on the torch
    backend).  Under ``torch.autocast`` they are cast to the autocast dtype as ``nn.Linear`` would
    be.  Statistics and dW are accumulated in float32 (float64 for float64 inputs).

    backend: "auto" (Triton on CUDA, chunked torch elsewhere), "triton" or "torch"; defaults to
    the environment variable ``HF_MHCE_BACKEND``.

    bias may hold -inf entries (predictions restricted to a sub-vocabulary): the values are torch's,
    an infinite loss for a masked target and with label smoothing (mean_j y_hj is -inf), gradients
    finite; under several heads a masked target's gradient is shared equally between the heads.

    low_rank: optional pair (U [..., num_heads, R], B [V, R]) adding ``U[..., h, :] @ B.T`` to head
    h's logits (before bias and softcap), in the same sweeps.  A LoRA adapter on the head is
    ``U_h = A[:, slice h] @ dropout(hidden)_h`` and ``B = scaling * lora_B``: this is how the patch
    trains one without a widened [V, D + H*R] copy of the weight, and without computing dW when
    ``weight`` is frozen.  Same dtype and device as ``hidden``.
    """
    checks.check_dense_values(hidden=hidden, weight=weight, bias=bias, labels=labels, low_rank=low_rank)
    # then autocast, which admits mixed dtypes
    hidden, weight, bias, low_rank = _autocast(hidden, weight, bias, low_rank)
    checks.check_matrices(hidden, weight, bias)
    num_heads = checks.check_heads(num_heads, weight.shape[1])
    checks.check_low_rank(low_rank, hidden, weight, num_heads)
    checks.check_options(reduction, label_smoothing, z_loss, softcap, num_items_in_batch, ignore_index)
    inputs = checks.prepare(hidden, weight, bias, labels, ignore_index)
    low_u, low_b = _flat_low_rank(low_rank, num_heads)
    ops = dispatch.resolve(backend, hidden.device, hidden.dtype)
    divisor = _divisor(inputs.valid, reduction, num_items_in_batch,
                       torch.float64 if inputs.hidden.dtype == torch.float64 else torch.float32)
    losses = MultiHeadTokenLoss.apply(
        inputs.hidden, inputs.weight, inputs.bias, low_u, low_b, inputs.labels, inputs.valid, num_heads,
        float(softcap) if softcap is not None else None, float(label_smoothing), float(z_loss), ops,
        active_sink(), _grad_scale(divisor, inputs.hidden),
    )
    return _reduce(losses, inputs.label_shape, divisor)


@_opaque_to_compile
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    backend: str | None = None,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, labels)`` without materialising the logits.

    The one-head case of :func:`multi_head_cross_entropy`; same keywords and rules (``low_rank``'s
    U is then [..., 1, R]).
    """
    return multi_head_cross_entropy(
        hidden, weight, labels, 1, bias=bias, ignore_index=ignore_index, reduction=reduction,
        num_items_in_batch=num_items_in_batch, label_smoothing=label_smoothing, z_loss=z_loss,
        softcap=softcap, backend=backend, low_rank=low_rank,
    )


@_opaque_to_compile
def multi_head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    num_heads: int,
    *,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """log pbar [..., V]: the mixture's normalised log-probabilities, float32 (float64 inputs: float64).

    With ``num_heads=1`` this is ``log_softmax(softcap(hidden @ weight.T + bias))``.  Computed in
    vocabulary/token blocks (never an [N, H, V] tensor); differentiable.  The output is [N, V] by
    nature, so every device computes it with the blocked torch sweeps (cuBLAS matmuls on GPU).
    ``low_rank`` as in :func:`multi_head_cross_entropy`.  A -inf bias entry gives -inf; the gradient
    reaching it passes to the logits as log_softmax's does, shared equally between the heads.
    """
    checks.check_dense_values(hidden=hidden, weight=weight, bias=bias, low_rank=low_rank)
    hidden, weight, bias, low_rank = _autocast(hidden, weight, bias, low_rank)
    checks.check_matrices(hidden, weight, bias)
    num_heads = checks.check_heads(num_heads, weight.shape[1])
    checks.check_low_rank(low_rank, hidden, weight, num_heads)
    checks.check_options("mean", 0.0, 0.0, softcap, None)
    lead = hidden.shape[:-1]
    flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    low_u, low_b = _flat_low_rank(low_rank, num_heads)
    out = MixtureLogprobs.apply(
        flat, weight.contiguous(), bias.contiguous() if bias is not None else None, low_u, low_b, num_heads,
        float(softcap) if softcap is not None else None,
    )
    return out.view(*lead, weight.shape[0])


def _flat_low_rank(low_rank, num_heads):
    """(U [N, H, R], B [V, R]) contiguous for the ops, or (None, None)."""
    if low_rank is None:
        return None, None
    u, b = low_rank
    return u.reshape(-1, num_heads, b.shape[1]).contiguous(), b.contiguous()
