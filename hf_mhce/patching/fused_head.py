"""TRL's fused-LM-head protocol, answered by the patched forward.

TRL (>= 1.15) trainers (SFT, DPO, GRPO, KTO, RLOO) call ``trl.trainer.utils.add_fused_lm_head`` on
their model and then ``model(..., labels=..., fused_lm_head=True)``, which returns per-token fields
(``FusedCausalLMOutput``) instead of logits.  TRL's own head computes them from ``softmax(W x)``: on
a patched model that would train an MHCE model as plain CE.  So the patched forward answers the
protocol itself, under the model's own distribution (the mixture pbar for "mhce"):

- ``log_probs``: log p(label) per token, with gradients, from the fused op (no [tokens x vocab] tensor);
- ``entropy`` (with gradients: GRPO's entropy bonus), ``is_top1``, ``log_sum_sq_probs``, ``mean_logits``
  (without): from token blocks of the log-probs within ``HF_MHCE_CHUNK_MB``, recomputed in the
  backward rather than kept;
- ``loss`` = -sum(log_probs) / (num_items_in_batch or the count), plus an MoE router loss; every
  per-token field is 0 where the label is -100, as TRL's.

methods.py recognises TRL's wrapper around a patched forward (``trl_head_options``); its guard then
puts the patched forward back and keeps TRL's options (which fields, the temperature, and
``cast_lm_head_to_fp32``: the head then runs in float32 outside autocast, as in TRL's own fused head).
The first call under a trainer also checks the trainer's reference model (trl_reference.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint
from transformers.utils import ModelOutput

from ..losses import collect_ranks, multi_head_cross_entropy, multi_head_logprobs
from ..losses.collect import active_sink
from ..ops.torch_sweep import chunk_bytes
from .families import logit_transform
from .head import fused_operands, mixed_batch_adapters, resolve_head
from .sharding import call_through
from .trl_reference import check_reference_model

TRL_IGNORE_INDEX = -100  # TRL's collators mark ignored labels so, whatever the model's ignore_index
TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
DEFAULT_OPTIONS = {"outputs": ("log_probs",), "temperature": 1.0, "cast_lm_head_to_fp32": False}  # add_fused_lm_head's


@dataclass
class FusedLMHeadOutput(ModelOutput):
    """The fields of TRL's ``FusedCausalLMOutput``, which its trainers read."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def fused_head_output(model, state, hidden, labels, shift_labels=None, num_items_in_batch=None, **_):
    """``model(..., labels=..., fused_lm_head=True)``: TRL's per-token fields under the model's distribution."""
    cfg = state.config
    options = state.fused_head or DEFAULT_OPTIONS
    if labels is None and shift_labels is None:
        raise ValueError("fused_lm_head=True needs labels (or shift_labels): it returns their per-token log-probs")
    if cfg.label_smoothing or cfg.z_loss:
        raise ValueError(
            f"fused_lm_head=True (TRL's trainers) builds the loss from per-token log-probs, which would drop this "
            f"model's label_smoothing={cfg.label_smoothing} and z_loss={cfg.z_loss} silently: apply_patch(model, "
            "label_smoothing=0.0, z_loss=0.0) to train with TRL")
    if shift_labels is None:
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"fused_lm_head=True: labels of shape {tuple(labels.shape)} for an input of shape "
                         f"{tuple(hidden.shape[:-1])} (after the shift)")
    labels = labels.to(hidden.device)
    if not state.reference_checked:
        state.reference_checked = check_reference_model(state)
    multiply, divide, softcap = logit_transform(model, state.facts)
    scale = own_scale = (multiply or 1.0) / (divide or 1.0)
    temperature = options["temperature"]
    if temperature != 1.0:
        if cfg.loss == "mhce" or softcap is not None:
            raise ValueError(
                f"TRL asked for log-probs at temperature={temperature}: TRL divides the logits by it before the softmax, "
                f"which has no single meaning for {'a mixture of softmaxes (MHCE)' if cfg.loss == 'mhce' else 'a soft-capped head'}; "
                "use temperature=1.0")
        scale = scale / temperature
    head = model.get_output_embeddings()
    if mixed_batch_adapters(head) is not None:
        raise ValueError("fused_lm_head=True with a PEFT mixed-adapter batch (adapter_names=...) is not supported")
    wanted = [k for k in TOKEN_FIELDS if k in options["outputs"] and k != "log_probs"]
    fp32 = options.get("cast_lm_head_to_fp32", False)

    # ranks counted in this pass (RBECallback, rbe.evaluate) are the model's, not at TRL's sampling temperature
    count_apart = temperature != 1.0 and active_sink() is not None

    def operands(hidden, scale):
        x, w, b, low_rank = fused_operands(resolve_head(head, None, hidden), hidden, cfg.num_heads, scale)
        if fp32:  # TRL's cast_lm_head_to_fp32: float32 operands, autocast off (as its own fused head)
            x, w, b = x.float(), w.float(), None if b is None else b.float()
            low_rank = None if low_rank is None else (low_rank[0].float(), low_rank[1].float())
        return x, w, b, low_rank

    def token_nll(x, w, b, low_rank, labels):
        return multi_head_cross_entropy(x, w, labels, cfg.num_heads, bias=b, low_rank=low_rank, softcap=softcap,
                                        ignore_index=TRL_IGNORE_INDEX, reduction="none", backend=cfg.backend)

    def fields(hidden, labels):  # reads the head inside the head's call: see sharding.py
        x, w, b, low_rank = operands(hidden, scale)
        with collect_ranks(None) if count_apart else contextlib.nullcontext():
            nll = token_nll(x, w, b, low_rank, labels)
        if count_apart:  # no gradient here: one more sweep, at temperature 1, feeds the sink
            token_nll(*operands(hidden, own_scale), labels)
        return nll, _token_stats(x, w, b, low_rank, labels, cfg.num_heads, softcap, wanted)

    with torch.autocast(hidden.device.type, enabled=False) if fp32 else contextlib.nullcontext():
        nll, stats = call_through(head, fields, hidden, labels)
    mask = labels != TRL_IGNORE_INDEX
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    if torch.is_tensor(count):
        count = count.to(nll.device)
    return FusedLMHeadOutput(loss=nll.sum() / count, log_probs=-nll, label_mask=mask, **stats)


def _token_stats(x, w, b, low_rank, labels, num_heads, softcap, wanted) -> dict:
    """The requested per-token fields (0 where ignored), from blocks of the valid tokens' log-probs:
    one [rows, V] pass per block, run under checkpoint where the entropy needs a gradient (then the
    block is recomputed in the backward rather than kept)."""
    if not wanted:
        return {}
    flat_x, flat_labels = x.reshape(-1, x.shape[-1]), labels.reshape(-1)
    low_u = None if low_rank is None else low_rank[0].reshape(-1, *low_rank[0].shape[-2:])
    valid = (flat_labels != TRL_IGNORE_INDEX).nonzero().squeeze(1)
    rows = max(1, chunk_bytes() // (3 * 4 * w.shape[0]))  # log-probs, probs and a temporary, float32
    grad = torch.is_grad_enabled() and "entropy" in wanted
    parts = []
    for start in range(0, valid.numel(), rows):
        idx = valid[start:start + rows]
        low = None if low_u is None else (low_u[idx], low_rank[1])
        args = (flat_x[idx], w, b, low, flat_labels[idx], num_heads, softcap, tuple(wanted))
        if grad:
            parts.append(checkpoint(_block_fields, *args, use_reentrant=False))
        else:
            with torch.no_grad():
                parts.append(_block_fields(*args))
    out = {}
    for i, k in enumerate(wanted):
        dtype = torch.bool if k == "is_top1" else torch.float32
        full = torch.zeros(flat_labels.shape, dtype=dtype, device=x.device)
        if parts:
            full = full.index_put((valid,), torch.cat([p[i] for p in parts]).to(dtype))  # out of place: keeps the graph
        out[k] = full.view(labels.shape)
    return out


def _block_fields(x, w, b, low, labels, num_heads, softcap, wanted) -> tuple:
    """The fields of one block of tokens, in ``wanted``'s order; only the entropy carries a gradient."""
    lp = multi_head_logprobs(x, w, num_heads, bias=b, softcap=softcap, low_rank=low)
    fields = []
    for k in wanted:
        if k == "entropy":  # an entry masked to -inf adds 0 (and a zero gradient, not 0 * inf = NaN)
            fields.append(-(lp.exp() * lp.masked_fill(lp.isneginf(), 0.0)).sum(-1))
            continue
        with torch.no_grad():
            if k == "is_top1":
                fields.append(lp.argmax(-1) == labels)
            elif k == "log_sum_sq_probs":
                fields.append(torch.logsumexp(2 * lp, -1))
            else:  # mean_logits: one head's logits' mean; a mixture's only logits are log pbar
                fields.append(_logits(x, w, b, low, softcap).mean(-1) if num_heads == 1 else lp.mean(-1))
    return tuple(fields)


def _logits(x, w, b, low, softcap):
    """One head's logits for a block (mean_logits of a single head)."""
    z = x.float() @ w.float().T
    if low is not None:
        z = z + low[0][:, 0].float() @ low[1].float().T
    if b is not None:
        z = z + b.float()
    return torch.tanh(z / softcap) * softcap if softcap is not None else z
