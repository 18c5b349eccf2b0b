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

    All three are exactly zero for invalid tokens so that the sweeps can skip nothing and still
    contribute nothing for them (the sweeps additionally mask NaN logits of invalid tokens).
    """
    num_heads = lse.shape[1]
    g = torch.where(valid, grad_tokens.to(lse.dtype), torch.zeros((), dtype=lse.dtype, device=lse.device))
    rho = torch.softmax(target - lse, dim=1)  # responsibilities of the heads for the target
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
