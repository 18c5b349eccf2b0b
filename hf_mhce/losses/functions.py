"""Autograd Functions over the ops: per-token losses (reductions are plain torch on top) and the
mixture log-probabilities.  Both run with autocast disabled inside: the caller has already cast
the inputs the way autocast would, and the statistics must stay float32."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.autograd.function import once_differentiable

from ..ops import mixture, torch_logprobs


_functorch = getattr(torch._C, "_functorch", None)


@contextlib.contextmanager
def kernels_on(device: torch.device):
    """Autocast off (the caller cast the inputs; the statistics stay float32), and ``device`` the current
    CUDA device: Triton launches on the current device and its stream, not the tensors' (a head on cuda:1
    under device_map="auto", while cuda:0 is current, was read across devices, or not at all)."""
    on_gpu = device.type == "cuda" and device.index is not None
    with torch.autocast(device.type, enabled=False), torch.cuda.device(device) if on_gpu else contextlib.nullcontext():
        yield


def _is_batched(t: torch.Tensor) -> bool:
    """Whether ``t`` is a vmap batch (``autograd.grad(..., is_grads_batched=True)`` makes legacy ones)."""
    return any(getattr(_functorch, name, lambda _: False)(t) for name in ("is_batchedtensor", "is_legacy_batchedtensor"))


def differentiable_once(backward):
    """``once_differentiable``, refusing ``create_graph=True`` outright.  once_differentiable only
    errs when the incoming gradient requires grad, which after a reduction (mean, sum) it does not:
    a double backward (gradient penalty, ``autograd.grad(..., create_graph=True)``) would then
    silently miss every second-order term through the loss.  Batched incoming gradients (vmap) are
    refused by name too: the kernels and the sweeps' in-place buffers failed on them deep inside."""

    @functools.wraps(backward)
    def checked(ctx, *grads):
        if torch.is_grad_enabled():  # the engine enables grad mode inside backward iff create_graph
            raise RuntimeError(
                "hf_mhce's fused losses are differentiable once: backward with create_graph=True (double "
                "backward, gradient penalties) is not supported, as its second-order terms would be missing. "
                "Compute such a loss from full logits (F.cross_entropy) instead.")
        if any(isinstance(g, torch.Tensor) and _is_batched(g) for g in grads):
            raise NotImplementedError(
                "hf_mhce's fused losses have no batched backward: torch.autograd.grad(..., is_grads_batched=True) "
                "and torch.func.vmap over their backward are not supported; compute one gradient at a time.")
        return once_differentiable(backward)(ctx, *grads)

    return checked


def _pair(low_u, low_b):
    """The ops' ``low_rank`` argument from the Function's two tensor inputs (None when absent)."""
    return (low_u, low_b) if low_u is not None else None


def _needs(ctx, low_rank) -> tuple:
    """Which of hidden, weight, bias (and U, B of a low-rank pair) need a gradient."""
    return tuple(ctx.needs_input_grad[:5 if low_rank is not None else 3])


def _all_inputs(ctx, grads) -> tuple:
    """The ops' gradients, then None for every other input of the Function."""
    grads = tuple(grads) if grads is not None else ()
    return grads + (None,) * (len(ctx.needs_input_grad) - len(grads))


class MultiHeadTokenLoss(torch.autograd.Function):
    """Per-token MHCE loss [N]; the incoming gradient is per token, so every reduction is exact.

    ``grad_scale`` (a float32 0-dim tensor, or None): the gradient every valid token will receive when
    the caller reduces by a mean or a sum.  With it, ops that can (``forward_with_grads``) compute the
    gradients in the forward, and the backward only scales them by the gradient that actually arrives.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, low_u, low_b, labels, valid, num_heads, softcap, label_smoothing,
                z_loss, ops, sink=None, grad_scale=None):
        low_rank = _pair(low_u, low_b)
        needs = _needs(ctx, low_rank)
        ctx.precomputed_grads = None
        with kernels_on(hidden.device):
            early = None
            if grad_scale is not None and sink is None and any(needs) and hasattr(ops, "forward_with_grads"):
                early = ops.forward_with_grads(hidden, weight, bias, labels, valid, num_heads, softcap,
                                               label_smoothing, z_loss, grad_scale, needs, low_rank=low_rank)
            if early is not None:
                stats, ctx.precomputed_grads = early
                ctx.grad_scale = grad_scale
            else:
                stats = ops.forward_stats(hidden, weight, bias, labels, num_heads, softcap, label_smoothing > 0,
                                          need_ranks=sink is not None, low_rank=low_rank)
            log_p_target = stats.log_p_target
            losses = mixture.token_losses(
                stats.lse, log_p_target, stats.logit_sum, valid, weight.shape[0], label_smoothing, z_loss
            )
            if sink is not None:
                sink(stats.ranks[valid], mixture.token_nll(log_p_target[valid]))
        ctx.save_for_backward(hidden, weight, bias, low_u, low_b, labels, valid, stats.top, stats.log_sum, log_p_target)
        ctx.options = (num_heads, softcap, label_smoothing, z_loss, ops)
        return losses

    @staticmethod
    @differentiable_once
    def backward(ctx, grad_tokens):
        hidden, weight, bias, low_u, low_b, labels, valid, top, log_sum, log_p_target = ctx.saved_tensors
        num_heads, softcap, label_smoothing, z_loss, ops = ctx.options
        low_rank = _pair(low_u, low_b)
        needs = _needs(ctx, low_rank)
        early, ctx.precomputed_grads = ctx.precomputed_grads, None  # once: a second backward (retain_graph) recomputes
        if early is not None:
            factor = _common_factor(grad_tokens, valid, ctx.grad_scale)
            if factor is not None:
                return _all_inputs(ctx, _scaled(early, factor, needs))
            early = None  # they do not apply: freed before the recompute builds its own (peak memory)
        if not any(needs):
            return _all_inputs(ctx, None)
        with kernels_on(hidden.device):
            alpha, target_grad, gamma = mixture.grad_coefficients(
                top + log_sum, log_p_target, valid, grad_tokens, weight.shape[0], label_smoothing, z_loss
            )
            grads = ops.backward(
                hidden, weight, bias, labels, top, log_sum, alpha.contiguous(), target_grad.contiguous(),
                gamma.contiguous(), num_heads, softcap, needs, low_rank=low_rank,
            )
        return _all_inputs(ctx, grads)


def _common_factor(grad_tokens, valid, assumed) -> float | None:
    """grad / assumed when every valid token's incoming gradient is the same ``grad`` (one host sync),
    None when they differ (the stored gradients do not apply).  No valid token: 1 (zero gradients)."""
    given = grad_tokens.to(torch.float32)
    inf = torch.tensor(float("inf"), device=given.device)
    low, high, count, assumed = torch.stack([torch.where(valid, given, inf).min(), torch.where(valid, given, -inf).max(),
                                             valid.sum().to(given), assumed.to(given)]).tolist()
    if count == 0:
        return 1.0
    if not (low == high or (low != low and high != high)):  # NaN everywhere also scales to NaN
        return None
    return high / assumed


def _scaled(grads, factor, needs):
    """The stored gradients times ``factor`` (in place: they are ours), None where not needed."""
    out = []
    for grad, need in zip(grads, needs):
        if grad is not None and need and factor != 1.0:
            grad.mul_(factor)
        out.append(grad if need else None)
    return tuple(out)


class MixtureLogprobs(torch.autograd.Function):
    """log pbar [N, V] (chunked torch sweeps on every device: the output is [N, V] by nature)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, low_u, low_b, num_heads, softcap):
        low_rank = _pair(low_u, low_b)
        with kernels_on(hidden.device):
            out, head_stats = torch_logprobs.mixture_logprobs(hidden, weight, bias, num_heads, softcap, low_rank)
        ctx.save_for_backward(hidden, weight, bias, low_u, low_b, head_stats, out)
        ctx.options = (num_heads, softcap)
        return out

    @staticmethod
    @differentiable_once
    def backward(ctx, grad):
        hidden, weight, bias, low_u, low_b, head_stats, out = ctx.saved_tensors
        num_heads, softcap = ctx.options
        low_rank = _pair(low_u, low_b)
        needs = _needs(ctx, low_rank)
        if not any(needs):
            return _all_inputs(ctx, None)
        with kernels_on(hidden.device):
            grads = torch_logprobs.mixture_logprobs_backward(
                hidden, weight, bias, num_heads, softcap, head_stats, out, grad, needs, low_rank
            )
        return _all_inputs(ctx, grads)
