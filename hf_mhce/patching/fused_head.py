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

``trl_head_options`` recognises TRL's wrapper around a patched forward (methods.py's guard then puts
the patched forward back and keeps TRL's options: which fields, the temperature).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint
from transformers.utils import ModelOutput

from ..losses import multi_head_cross_entropy, multi_head_logprobs
from ..ops.torch_sweep import chunk_bytes
from .families import logit_transform
from .head import fused_operands, mixed_batch_adapters, resolve_head
from .sharding import call_through

TRL_IGNORE_INDEX = -100  # TRL's collators mark ignored labels so, whatever the model's ignore_index
TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
DEFAULT_OPTIONS = {"outputs": ("log_probs",), "temperature": 1.0}  # add_fused_lm_head's defaults


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


def trl_head_options(forward) -> dict | None:
    """TRL's options (``outputs``, ``temperature``, ``original_forward``) if ``forward`` is the wrapper
    ``add_fused_lm_head`` installs, looked for through accelerate's mixed-precision wrapper; else None.
    Read by code object: the wrapper copies the name of the class's forward (functools.wraps)."""
    fn = forward
    for _ in range(6):
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if code is not None and getattr(code, "co_qualname", "") == "add_fused_lm_head.<locals>._fused_forward" \
                and "trl" in code.co_filename.replace("\\", "/").split("/"):
            cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
            return {"outputs": tuple(cells.get("outputs", DEFAULT_OPTIONS["outputs"])),
                    "temperature": float(cells.get("temperature", 1.0)),
                    "original_forward": cells.get("original_forward")}
        inner = getattr(getattr(fn, "__wrapped__", None), "model_forward", None)  # accelerate's ConvertOutputsToFp32
        fn = inner if inner is not None else getattr(fn, "__wrapped__", None)
        if fn is None:
            return None
    return None


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
    multiply, divide, softcap = logit_transform(model, state.facts)
    scale = (multiply or 1.0) / (divide or 1.0)
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

    def fields(hidden, labels):  # reads the head inside the head's call: see sharding.py
        x, w, b, low_rank = fused_operands(resolve_head(head, None, hidden), hidden, cfg.num_heads, scale)
        nll = multi_head_cross_entropy(x, w, labels, cfg.num_heads, bias=b, low_rank=low_rank, softcap=softcap,
                                       ignore_index=TRL_IGNORE_INDEX, reduction="none", backend=cfg.backend)
        return nll, _token_stats(x, w, b, low_rank, labels, cfg.num_heads, softcap, wanted)

    nll, stats = call_through(head, fields, hidden, labels)
    mask = labels != TRL_IGNORE_INDEX
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    if torch.is_tensor(count):
        count = count.to(nll.device)
    return FusedLMHeadOutput(loss=nll.sum() / count, log_probs=-nll, label_mask=mask, **stats)


def _token_stats(x, w, b, low_rank, labels, num_heads, softcap, wanted) -> dict:
    """The requested per-token fields (0 where ignored), from blocks of the valid tokens' log-probs."""
    if not wanted:
        return {}
    flat_x, flat_labels = x.reshape(-1, x.shape[-1]), labels.reshape(-1)
    low_u = None if low_rank is None else low_rank[0].reshape(-1, *low_rank[0].shape[-2:])
    valid = (flat_labels != TRL_IGNORE_INDEX).nonzero().squeeze(1)
    rows = max(1, chunk_bytes() // (3 * 4 * w.shape[0]))  # log-probs, probs and a temporary, float32
    grad = torch.is_grad_enabled() and "entropy" in wanted
    parts = {k: [] for k in wanted}
    for start in range(0, valid.numel(), rows):
        idx = valid[start:start + rows]
        low = None if low_u is None else (low_u[idx], low_rank[1])
        if grad:  # the block's [rows, V] log-probs are recomputed in the backward, not kept
            parts["entropy"].append(checkpoint(_entropy, flat_x[idx], w, b, low, num_heads, softcap, use_reentrant=False))
        with torch.no_grad():
            lp = multi_head_logprobs(flat_x[idx], w, num_heads, bias=b, softcap=softcap, low_rank=low)
            if not grad and "entropy" in wanted:
                parts["entropy"].append(_entropy_of(lp))
            if "is_top1" in wanted:
                parts["is_top1"].append(lp.argmax(-1) == flat_labels[idx])
            if "log_sum_sq_probs" in wanted:
                parts["log_sum_sq_probs"].append(torch.logsumexp(2 * lp, -1))
            if "mean_logits" in wanted:  # one head: its logits' mean; a mixture's only logits are log pbar
                parts["mean_logits"].append(_logits(flat_x[idx], w, b, low, softcap).mean(-1) if num_heads == 1
                                            else lp.mean(-1))
    out = {}
    for k, chunks in parts.items():
        dtype = torch.bool if k == "is_top1" else torch.float32
        full = torch.zeros(flat_labels.shape, dtype=dtype, device=x.device)
        if chunks:
            full = full.index_put((valid,), torch.cat(chunks).to(dtype))  # out of place: entropy keeps its graph
        out[k] = full.view(labels.shape)
    return out


def _entropy(x, w, b, low, num_heads, softcap):
    return _entropy_of(multi_head_logprobs(x, w, num_heads, bias=b, softcap=softcap, low_rank=low))


def _entropy_of(lp):
    """-sum p log p; an entry masked to -inf adds 0 (and a zero gradient, not 0 * inf = NaN)."""
    return -(lp.exp() * lp.masked_fill(lp.isneginf(), 0.0)).sum(-1)


def _logits(x, w, b, low, softcap):
    """One head's logits for a block (mean_logits of a single head)."""
    z = x.float() @ w.float().T
    if low is not None:
        z = z + low[0][:, 0].float() @ low[1].float().T
    if b is not None:
        z = z + b.float()
    return torch.tanh(z / softcap) * softcap if softcap is not None else z
