"""Per-token mixture algebra on [N, H] statistics (device agnostic, no vocabulary dimension).

The vocabulary sweeps (Triton or chunked torch) reduce every token to three per-head numbers:
``lse[n, h]`` = logsumexp_j y[n, h, j], ``target[n, h]`` = y[n, h, t_n] and, when label smoothing
is on, ``logit_sum[n, h]`` = sum_j y[n, h, j].  Everything else -- the loss of the uniform mixture
of the H head softmaxes and the coefficients of its gradient -- is computed here from those.

Per-token loss of a valid token (eps = label smoothing, zl = z-loss weight):

    (1 - eps) * (-log pbar_t) + eps/H * sum_h (lse_h - mean_j y_hj) + zl/H * sum_h lse_h^2

with -log pbar_t = log H - logsumexp_h(y_ht - lse_h).  Smoothing and z-loss act per head; by
Jensen the per-head smoothing term upper-bounds the mixture's, and both equal torch's for H = 1.

Its gradient w.r.t. y[n, h, j] has the form ``alpha[n,h] * p[n,h,j] - beta[n,h] * [j == t] - gamma[n]``
with p = softmax(y_h), responsibilities rho_h = p_ht / sum_h' p_h't and, for incoming gradient g,

    alpha = g * ((1 - eps) * rho + eps/H + 2 * zl * lse / H),  beta = g * (1 - eps) * rho,
    gamma = g * eps / (H * V).

A -inf logit (a bias masking part of the vocabulary) gives torch's values: the sweeps add 0 for it,
a masked target's loss is inf, and so is every loss with smoothing (mean_j y_hj = -inf), gradients
staying finite.  A target masked in every head has rho = 0/0: equal shares 1/H (one head: rho = 1).
"""

from __future__ import annotations

import math

import torch


def token_losses(
    lse: torch.Tensor,
    target: torch.Tensor,
    logit_sum: torch.Tensor | None,
    valid: torch.Tensor,
    vocab_size: int,
    label_smoothing: float,
    z_loss: float,
) -> torch.Tensor:
    """Per-token loss [N] (0 for invalid tokens) from per-head statistics [N, H]."""
    num_heads = lse.shape[1]
    log_p_target = target - lse  # log p_h(t), [N, H]
    nll = math.log(num_heads) - torch.logsumexp(log_p_target, dim=1)
    loss = (1.0 - label_smoothing) * nll if label_smoothing else nll
    if label_smoothing:
        smooth = (lse - logit_sum / vocab_size).mean(dim=1)
        loss = loss + label_smoothing * smooth
    if z_loss:
        loss = loss + z_loss * lse.square().mean(dim=1)
    # where() rather than a product: an ignored token with NaN hidden must still give exactly 0.
    return torch.where(valid, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))


def token_nll(lse: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """-log pbar_t per token [N] (no smoothing, no z-loss)."""
    return math.log(lse.shape[1]) - torch.logsumexp(target - lse, dim=1)


def grad_coefficients(
    lse: torch.Tensor,
    target: torch.Tensor,
    valid: torch.Tensor,
    grad_tokens: torch.Tensor,
    vocab_size: int,
    label_smoothing: float,
    z_loss: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(alpha [N, H], beta [N, H], gamma [N]) with the incoming per-token gradient folded in.

    All three are exactly zero for invalid tokens, so that the sweeps skip nothing and still give them
    a zero logits gradient (the sweeps additionally mask their NaN logits).  Their hidden rows still
    enter dW through dz^T x: a NaN/inf hidden row makes dW NaN (0 * NaN), as torch's cross-entropy does.
    """
    num_heads = lse.shape[1]
    g = torch.where(valid, grad_tokens.to(lse.dtype), torch.zeros((), dtype=lse.dtype, device=lse.device))
    log_p_target = target - lse
    # A target masked in every head (a -inf bias) has an infinite loss, as torch's, and 0/0
    # responsibilities: equal shares then, which for one head is torch's gradient (p - onehot).
    masked = torch.isneginf(log_p_target).all(dim=1, keepdim=True)
    rho = torch.softmax(log_p_target.masked_fill(masked, 0.0), dim=1)  # responsibilities of the heads
    g = g[:, None]
    beta = g * (1.0 - label_smoothing) * rho
    alpha = beta + g * (label_smoothing / num_heads)
    if z_loss:
        alpha = alpha + g * (2.0 * z_loss / num_heads) * lse
    gamma = g[:, 0] * (label_smoothing / (num_heads * vocab_size))
    # A NaN lse of an invalid token must not leak through rho.
    zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
    alpha = torch.where(valid[:, None], alpha, zero)
    beta = torch.where(valid[:, None], beta, zero)
    return alpha, beta, gamma
