"""The reference model of a TRL trainer whose policy is a patched MHCE model.

GRPO and RLOO (with ``beta > 0``), DPO and KTO (with ``ref_model=None`` and no PEFT adapter) load
their reference model themselves, with plain transformers, from the policy's checkpoint.  A plain
model ignores the MHCE loss recorded in the config: its log-probs come from one softmax over the
whole head, not from the mixture the policy uses, so the KL term or the log-ratios would compare two
different distributions from step 1 on.  Nothing of hf_mhce runs in that model, so the check is made
from the policy's side, at its first ``fused_lm_head=True`` call: the trainer making it is found on
the call stack and its ``ref_model`` inspected.
"""

from __future__ import annotations

import torch
from torch import nn

from .callers import calling_trainer


class UnpatchedReferenceError(RuntimeError):
    """A TRL trainer's reference model would score an MHCE policy's tokens with a plain softmax."""


@torch.compiler.disable  # reads the caller's frames: must run as Python, not be traced
def check_reference_model(state, max_depth: int = 64) -> bool:
    """Raise if the trainer calling the policy whose patch state is ``state`` (an MHCE model) holds an
    unpatched reference model.  Returns whether a trainer was found (the check is then done)."""
    trainer = calling_trainer(max_depth)
    if trainer is None:
        return False
    reference = getattr(trainer, "ref_model", None)
    precomputed = bool(getattr(trainer, "precompute_ref_logps", False))  # DPO, KTO: scored in __init__
    if state.config.loss == "mhce" and trainer.__dict__.get(_STALE):
        raise UnpatchedReferenceError(_stale_message(trainer, state))
    if state.config.loss != "mhce" or not isinstance(reference, nn.Module) or _patched(reference):
        return True  # CE: a plain model has the same distribution
    if precomputed:  # patching the reference now would leave its cached log-probs as they are
        trainer.__dict__[_STALE] = True
        raise UnpatchedReferenceError(_stale_message(trainer, state))
    inner = _inner(reference)
    source = getattr(getattr(inner, "config", None), "_name_or_path", "") or "the policy's checkpoint"
    raise UnpatchedReferenceError(
        f"{type(trainer).__name__}'s reference model (loaded from {source!r}) is not patched by hf_mhce, while the "
        f"policy is an MHCE model (num_heads={state.config.num_heads}): it would score tokens with one softmax over the "
        "whole head, not the policy's mixture, and the KL / log-ratio terms would compare two different distributions. "
        "TRL loads that reference itself with plain transformers (GRPO and RLOO with beta > 0, DPO and KTO with "
        "ref_model=None). Call hf_mhce.apply_patch(trainer.ref_model) after building the trainer, or pass "
        "ref_model=hf_mhce.from_pretrained(...) where the trainer takes one; to keep a plain-softmax reference on "
        "purpose: hf_mhce.apply_patch(trainer.ref_model, 'ce')"
    )


_STALE = "_hf_mhce_stale_reference_logps"


def _stale_message(trainer, state) -> str:
    return (f"{type(trainer).__name__} was built with precompute_ref_log_probs=True and a reference model not patched "
            f"by hf_mhce, while the policy is an MHCE model (num_heads={state.config.num_heads}): the reference "
            "log-probs were already computed, with one softmax over the whole head, when the trainer was built, and "
            "patching trainer.ref_model now would not change them. Build the trainer again with "
            "ref_model=hf_mhce.apply_patch(ref_model) (or hf_mhce.from_pretrained(...)), or with ref_model=None "
            "(the policy then scores the reference itself).")


def _inner(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP / DeepSpeed / FSDP wrappers and a PeftModel."""
    from accelerate.utils import extract_model_from_parallel

    from .methods import unwrap  # methods.py sits above the forward that calls us

    return unwrap(extract_model_from_parallel(model))


def _patched(model: nn.Module) -> bool:
    from .forward import STATE_ATTR

    return STATE_ATTR in _inner(model).__dict__
