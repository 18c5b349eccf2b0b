"""Who is calling the patched forward: the transformers Trainer frames on the call stack.

A Trainer tells what it will do with the outputs only in its own frames (``prediction_loss_only`` in
``prediction_step``, a subclass's ``compute_loss``, TRL's ``ref_model``), so the forward reads them
from there.  Outside a Trainer, or if a future Trainer renames what is read, every answer here is the
default (no logits, no warning, no check): never a wrong number.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Iterator
from types import FrameType

import torch


def trainer_frames(start: FrameType | None, name: str | None = None, max_depth: int | None = None) -> Iterator:
    """(frame, trainer) for each frame from ``start`` outwards (at most ``max_depth`` frames) that is a
    method of a transformers Trainer, only those of the method ``name`` where given (its name is checked
    before the frame's locals are read); nothing when no Trainer class is loaded."""
    trainer_module = sys.modules.get("transformers.trainer")
    if trainer_module is None:  # no Trainer can be calling
        return
    frame, depth = start, 0
    while frame is not None and (max_depth is None or depth < max_depth):
        if name is None or frame.f_code.co_name == name:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, trainer_module.Trainer):
                yield frame, candidate
        frame, depth = frame.f_back, depth + 1


@torch.compiler.disable  # reads the caller's frames: must run as Python, not be traced
def trainer_needs_predictions() -> bool:
    """True when this forward runs inside a transformers ``Trainer.prediction_step`` that returns the
    logits (``prediction_loss_only`` False: ``compute_metrics`` is set, or ``predict()``).

    The Trainer says whether it will use the logits only in that local variable (its own
    ``skip_logits`` hint is sent to Liger-patched models alone), so we read it from the calling frame.
    """
    stacks = [(sys._getframe(1), False)]
    if threading.current_thread() is not threading.main_thread():
        # nn.DataParallel (Trainer on several GPUs of one process) runs the replicas in worker
        # threads while the main thread waits inside the prediction step: that step's, if its model is
        # one (another thread's forward is not this step's)
        stacks.append((sys._current_frames().get(threading.main_thread().ident), True))
    for stack, replicas_only in stacks:
        for frame, _ in trainer_frames(stack, "prediction_step"):
            if replicas_only and not isinstance(frame.f_locals.get("model"), torch.nn.DataParallel):
                return False
            loss_only = frame.f_locals.get("prediction_loss_only")
            return isinstance(loss_only, bool) and not loss_only
    return False


def custom_compute_loss_warning(state) -> None:
    """Warn once when the forward, returning logits=None (labels given), is called from a Trainer
    subclass's own ``compute_loss``: code written for transformers may read ``outputs.logits`` there
    and would fail on None far from the cause.  Trainer's, TRL's and our own compute_loss use the loss
    only; a subclass's that calls ``super().compute_loss`` gets the outputs only with ``return_outputs=True``.
    Checked (``state.checked_compute_loss``) until a Trainer's compute_loss is seen calling: a model may
    first run outside one."""
    custom, hands_outputs = None, True  # whether the compute_loss frames so far pass the outputs outwards
    for frame, _ in trainer_frames(sys._getframe(1), "compute_loss"):
        state.checked_compute_loss = True
        if not frame.f_globals.get("__name__", "").startswith(("transformers.", "trl.", "hf_mhce.")):
            custom = frame if hands_outputs and custom is None else custom
        else:
            hands_outputs = hands_outputs and bool(frame.f_locals.get("return_outputs", False))
    if custom is not None:  # reported at the line of that compute_loss that called the model
        name = type(custom.f_locals["self"]).__qualname__
        warnings.warn_explicit(
            f"hf_mhce: {name}.compute_loss calls the patched model with labels, which returns logits=None: the "
            "fused loss builds no [tokens x vocab] logits. If that compute_loss reads outputs.logits, patch with "
            "return_logits=True (hf_mhce.apply_patch(model, return_logits=True)), which builds them again, and "
            "their memory; one that uses outputs.loss alone needs nothing.",
            UserWarning, custom.f_code.co_filename, custom.f_lineno, module=custom.f_globals.get("__name__"),
            registry=custom.f_globals.setdefault("__warningregistry__", {}))


@torch.compiler.disable  # reads the caller's frames: must run as Python, not be traced
def check_trainer_loss(config) -> None:
    """Refuse a call without labels from transformers' own ``Trainer.compute_loss`` that took them out of the
    inputs to compute the loss itself (``label_smoothing_factor``, ``compute_loss_func``), where the fused
    loss's options would be dropped silently: its ``z_loss``, a ``label_smoothing`` other than the Trainer's
    own (for MHCE any: the Trainer smooths the mixture's log-probs), an ``ignore_index`` that the Trainer's
    smoothing does not know (it ignores -100 alone).  Only a model with such options looks."""
    for frame, trainer in trainer_frames(sys._getframe(1), "compute_loss"):
        if frame.f_globals.get("__name__") != "transformers.trainer" or frame.f_locals.get("labels") is None:
            return  # a subclass's own compute_loss, or the model got the labels
        smoother = trainer.label_smoother if trainer.compute_loss_func is None else None
        lost = {"z_loss": config.z_loss} if config.z_loss else {}
        if config.label_smoothing and not (smoother is not None and config.loss == "ce"
                                           and smoother.epsilon == config.label_smoothing):
            lost["label_smoothing"] = config.label_smoothing
        default = type(config)()  # the loss options the Trainer's own loss has (ignore_index -100, as it ignores)
        if smoother is not None and config.ignore_index != default.ignore_index:
            lost["ignore_index"] = config.ignore_index
        if lost:
            if smoother is None:
                how, instead = "compute_loss_func", "leave the loss to the model (no compute_loss_func)"
            else:
                how = f"label_smoothing_factor={smoother.epsilon}"
                instead = "smooth in the fused loss (apply_patch(model, label_smoothing=...), label_smoothing_factor=0)"
            raise ValueError(
                f"hf_mhce: the Trainer computes the loss itself ({how}): it takes the labels out of the inputs and "
                f"builds the loss from the logits, which would drop this model's {lost} silently. Either {instead}, "
                f"or patch for the Trainer's loss ({', '.join(f'{k}={getattr(default, k)!r}' for k in lost)}).")
        return



def calling_trainer(max_depth: int):
    """The innermost transformers Trainer with a method on the call stack (within ``max_depth`` frames), or None."""
    return next((trainer for _, trainer in trainer_frames(sys._getframe(1), max_depth=max_depth)), None)
