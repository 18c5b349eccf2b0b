"""Mixture log-probabilities log pbar [N, V] on the chunked torch sweeps (every device: the output is
[N, V] by nature), and their backward.

log p_h = (y - max_h) - log sum_j exp(y_hj - max_h), not y - lse_h: the top entry's log p of a
confident head is then exact to its own size (lse rounded to one float32 is off by half an ulp of
|lse|, the whole of log p = -1e-5; see ``mixture``), at any vocabulary size (``_lse_sweep``).  The mixture
of several heads is a logsumexp over them per entry, whose sum ~ H rounds to an ulp of H as eager's does:
a top entry's log pbar ~ -1e-5 keeps eager float32's accuracy there, not float32's precision.  The backward
forms each head's top entry's gradient without cancelling where p_top > 1/2 (S' summed beside S,
the entry found by ``_at_top``).
"""

from __future__ import annotations

import math

import torch

from .torch_sweep import _blocks, _Grads, _logsumexp_heads, _lse_sweep, _Problem, head_logprobs


def mixture_logprobs(x, w, bias, num_heads, softcap, low_rank=None):
    """(log pbar [N, V] in compute dtype, per-head (max, log sum exp(y - max)) [2, N, H] for the backward):
    two sweeps (per-head statistics, then the mixture per block)."""
    pb = _Problem(x, w, bias, num_heads, softcap, low_rank)
    top, log_sum, _, _ = _lse_sweep(pb, need_logit_sum=False)
    out = torch.empty(pb.n, pb.v, dtype=pb.cdt, device=x.device)
    log_h = math.log(num_heads)
    for v0, v1 in _blocks(pb.v, pb.cols):
        wc = pb.weight_chunk(v0, v1)
        for n0, n1 in _blocks(pb.n, pb.rows):
            logp = head_logprobs(pb.logits(n0, n1, v0, v1, wc), top, log_sum, n0, n1)
            out[n0:n1, v0:v1] = logp[0] if num_heads == 1 else _logsumexp_heads(logp, pb).sub_(log_h)
    return out, torch.stack([top, log_sum])


def mixture_logprobs_backward(x, w, bias, num_heads, softcap, head_stats, logpbar, grad, needs, low_rank=None):
    """Gradients of sum(grad * log pbar) (``head_stats``: ``mixture_logprobs``' second output); ``needs``
    and the returned tuple as in ``backward``.

    d log pbar_k / d y_hj = r_hk ([k = j] - p_hj) with r_hk = p_hk / (H pbar_k), hence
    dy_hj = grad_j r_hj - p_hj S_h where S_h = sum_k grad_k r_hk (one extra sweep, H > 1 only).
    An entry masked in every head (-inf logits, pbar_k = 0) makes r_hk 0/0; it takes equal shares
    r_hk = 1 / H there, which for one head is torch's log_softmax gradient (dy_k = grad_k).
    """
    pb = _Problem(x, w, bias, num_heads, softcap, low_rank)
    grad = grad.to(pb.cdt)
    top, log_sum = head_stats
    log_h = math.log(num_heads)
    # One check up front (unmasked vocabularies pay nothing), by row minima: no [N, V] temporary, and a
    # NaN row (amin propagates it) hides only its own -inf entries, whose gradient is NaN anyway.
    masked = bool((logpbar.amin(dim=1) == -math.inf).any())

    def block_terms(wc, v0, v1, n0, n1):
        """(hidden chunk, low-rank chunk, softcap derivative or None, log p, grad * r) of one block."""
        xc, lr = pb.hidden_chunk(n0, n1), pb.low_rank_chunk(n0, n1, v0, v1)
        y, slope = pb.logits_and_slope(n0, n1, v0, v1, wc)
        logp = head_logprobs(y, top, log_sum, n0, n1)
        lpbar = logpbar[None, n0:n1, v0:v1]
        gr = torch.sub(logp, log_h, out=pb.scratch("gr", *y.shape)).sub_(lpbar).exp_()
        if masked:  # exp(-inf - -inf) is NaN at entries masked in every head: equal shares
            gr.masked_fill_(torch.isneginf(lpbar), 1.0 / num_heads)
        return xc, lr, slope, logp, gr.mul_(grad[None, n0:n1, v0:v1])

    # S_h, and S'_h: the sum without each head's top entry (see _at_top), for that entry's dz
    s = torch.zeros(pb.h, pb.n, dtype=pb.cdt, device=x.device)
    s_below = torch.zeros_like(s)
    ls_t = log_sum.T  # [H, N]
    for v0, v1 in _blocks(pb.v, pb.cols):
        wc = pb.weight_chunk(v0, v1) if num_heads > 1 else None
        for n0, n1 in _blocks(pb.n, pb.rows):
            if num_heads == 1:  # gr = grad (r = 1) and log p = log pbar: no logits needed
                logp = logpbar[None, n0:n1, v0:v1]
                gr = pb.scratch("gr", *logp.shape).copy_(grad[None, n0:n1, v0:v1])
            else:
                _, _, _, logp, gr = block_terms(wc, v0, v1, n0, n1)
            s[:, n0:n1] += gr.sum(-1)
            s_below[:, n0:n1] += gr.masked_fill_(_at_top(pb, logp, ls_t[:, n0:n1]), 0.0).sum(-1)
    # where p_top > 1/2: g_top (1 - p_top) - p_top S' (g_top = S - S', to its own precision)
    confident = ls_t < math.log(2.0)
    top_value = (s - s_below) * torch.expm1(-ls_t).neg() - torch.exp(-ls_t) * s_below

    grads = _Grads(pb, needs)
    for v0, v1 in _blocks(pb.v, pb.cols):
        wc = pb.weight_chunk(v0, v1)
        grads.start_chunk(v0, v1)
        for n0, n1 in _blocks(pb.n, pb.rows):
            xc, lr, slope, logp, gr = block_terms(wc, v0, v1, n0, n1)
            # before the in-place exp: each confident head's top entry
            at_top = _at_top(pb, logp, ls_t[:, n0:n1]).logical_and_(confident[:, n0:n1, None])
            dz = gr.sub_(logp.exp_().mul_(s[:, n0:n1, None]))
            dz = torch.where(at_top, top_value[:, n0:n1, None], dz, out=dz)
            if slope is not None:
                dz *= slope
            grads.add(dz, xc, wc, lr, n0, n1)
        grads.end_chunk()
    return grads.result()


def _at_top(pb, logp, log_sum):
    """[H, rows, cols] bools: log p == -log_sum, each head's top entry (log p = (y - top) - log_sum is
    exactly -log_sum there).  Where p_top > 1/2 no other entry can round to it (its p would be about
    p_top too); NaN and masked entries never match."""
    return torch.eq(logp, log_sum.neg()[..., None], out=pb.scratch("at_top", *logp.shape, dtype=torch.bool))
