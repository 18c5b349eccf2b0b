"""Per-token mixture algebra on [N, H] statistics (device agnostic, no vocabulary dimension).

The vocabulary sweeps (Triton or chunked torch) reduce every token to per-head numbers:
``lse[n, h]`` = logsumexp_j y[n, h, j], ``log_p_target[n, h]`` = log p_h(t_n) = y[n, h, t_n] - lse
and, when label smoothing is on, ``logit_sum[n, h]`` = sum_j y[n, h, j].  Everything else -- the
loss of the uniform mixture of the H head softmaxes and the coefficients of its gradient -- is
computed here from those.

log p_h(t) comes from the sweeps as (y_t - max_j y_j) - log sum_j exp(y_j - max), not as y_t - lse:
lse rounded to one float32 is off by up to half an ulp of |lse| (8e-6 at |lse| = 130), which is the
whole loss of a confident token (p_t = 1 - 1e-5) and of its gradient p_t - 1.  The sweeps' target
logit is the very value their maximum was taken over, so y_t - max is exact where it matters; and
log sum is log1p of the sum without the maximum's own 1, which they never add in (a sum holding it
rounds 1 - p_t to an ulp of 1 block after block: eager float32 does, 5e-2 off at V = 32768).  So
the loss and the target's gradient (``target_grad`` below) of a confident token are accurate to
float32's precision at any vocabulary size; over heads, ``token_nll`` keeps pbar_t - 1 likewise.  The
backward sweeps likewise form p = exp((y - max) - log sum), not exp(y - lse), which would scale every
p by one common error of that size (it did not cancel where sum_j p_j x_j nearly does).

Per-token loss of a valid token (eps = label smoothing, zl = z-loss weight):

    (1 - eps) * (-log pbar_t) + eps/H * sum_h (lse_h - mean_j y_hj) + zl/H * sum_h lse_h^2

with -log pbar_t = log H - logsumexp_h(y_ht - lse_h).  Smoothing and z-loss act per head; by
Jensen the per-head smoothing term upper-bounds the mixture's, and both equal torch's for H = 1.

Its gradient w.r.t. y[n, h, j] has the form ``alpha[n,h] * p[n,h,j] - beta[n,h] * [j == t] - gamma[n]``
with p = softmax(y_h), responsibilities rho_h = p_ht / sum_h' p_h't and, for incoming gradient g,

    alpha = g * ((1 - eps) * rho + eps/H + 2 * zl * lse / H),  beta = g * (1 - eps) * rho,
    gamma = g * eps / (H * V).

The sweeps take the target column's value before gamma, ``target_grad`` = alpha * p_t - beta =
alpha * expm1(log p_t) + (alpha - beta), from here rather than forming p_t from their recomputed
logits and lse (1 - p_t would cancel to the rounding of lse; see above).

A -inf logit (a bias masking part of the vocabulary) gives torch's values: the sweeps add 0 for it,
a masked target's loss is inf, and so is every loss with smoothing (mean_j y_hj = -inf), gradients
staying finite.  A target masked in every head has rho = 0/0: equal shares 1/H (one head: rho = 1).
"""

from __future__ import annotations

import math

import torch


def token_losses(
    lse: torch.Tensor,
    log_p_target: torch.Tensor,
    logit_sum: torch.Tensor | None,
    valid: torch.Tensor,
    vocab_size: int,
    label_smoothing: float,
    z_loss: float,
) -> torch.Tensor:
    """Per-token loss [N] (0 for invalid tokens) from per-head statistics [N, H]."""
    nll = token_nll(log_p_target)
    loss = (1.0 - label_smoothing) * nll if label_smoothing else nll
    if label_smoothing:
        smooth = (lse - logit_sum / vocab_size).mean(dim=1)
        loss = loss + label_smoothing * smooth
    if z_loss:
        loss = loss + z_loss * lse.square().mean(dim=1)
    # where() rather than a product: an ignored token with NaN hidden must still give exactly 0.
    return torch.where(valid, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))


def token_nll(log_p_target: torch.Tensor) -> torch.Tensor:
    """-log pbar_t per token [N] (no smoothing, no z-loss) from log p_h(t) [N, H].

    Where pbar_t > 1/2, -log1p(mean_h expm1(log p_h(t))): a logsumexp over the heads rounds its sum
    sum_h p_h ~ H to an ulp of H, which is all of a confident token's loss (1 - pbar_t ~ 1e-5)."""
    heads = log_p_target.shape[1]
    if heads == 1:
        return -log_p_target[:, 0]
    below_one = torch.expm1(log_p_target).mean(dim=1)  # pbar_t - 1, without rounding pbar_t
    confident = below_one > -0.5
    return torch.where(confident, -torch.log1p(below_one), math.log(heads) - torch.logsumexp(log_p_target, dim=1))


def grad_coefficients(
    lse: torch.Tensor,
    log_p_target: torch.Tensor,
    valid: torch.Tensor,
    grad_tokens: torch.Tensor,
    vocab_size: int,
    label_smoothing: float,
    z_loss: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(alpha [N, H], target_grad [N, H], gamma [N]) with the incoming per-token gradient folded in.

    All three are exactly zero for invalid tokens, so that the sweeps skip nothing and still give them
    a zero logits gradient (the sweeps additionally mask their NaN logits).  Their hidden rows would
    still enter dW through dz^T x, where a NaN/inf row makes 0 * NaN: the sweeps zero those rows (of X
    and U) before the products, so that padding with non-finite hidden states leaves dW finite.
    """
    num_heads = lse.shape[1]
    g = torch.where(valid, grad_tokens.to(lse.dtype), torch.zeros((), dtype=lse.dtype, device=lse.device))
    # A target masked in every head (a -inf bias) has an infinite loss, as torch's, and 0/0
    # responsibilities: equal shares then, which for one head is torch's gradient (p - onehot).
    masked = torch.isneginf(log_p_target).all(dim=1, keepdim=True)
    rho = torch.softmax(log_p_target.masked_fill(masked, 0.0), dim=1)  # responsibilities of the heads
    g = g[:, None]
    beta = g * (1.0 - label_smoothing) * rho
    # alpha - beta: smoothing's and the z-loss's share, kept whole for the target column (formed as
    # alpha - beta it kept only an ulp of alpha ~ g: z-loss 1e-3 at a masked vocabulary, 2e-5 relative off)
    extra = g * (label_smoothing / num_heads)
    if z_loss:
        extra = extra + g * (2.0 * z_loss / num_heads) * lse
    alpha = beta + extra
    gamma = g[:, 0] * (label_smoothing / (num_heads * vocab_size))
    # A NaN lse of an invalid token must not leak through rho.
    zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
    alpha = torch.where(valid[:, None], alpha, zero)
    # alpha * p_t - beta with 1 - p_t from log p_t (expm1), not from 1 minus a rounded p_t
    target_grad = alpha * torch.expm1(log_p_target) + extra
    target_grad = torch.where(valid[:, None], target_grad, zero)
    return alpha, target_grad, gamma
