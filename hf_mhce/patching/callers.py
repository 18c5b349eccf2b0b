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
    stacks = [sys._getframe(1)]
    if threading.current_thread() is not threading.main_thread():
        # nn.DataParallel (Trainer on several GPUs of one process) runs the replicas in worker
        # threads while the main thread waits inside the prediction step
        stacks.append(sys._current_frames().get(threading.main_thread().ident))
    for stack in stacks:
        for frame, _ in trainer_frames(stack, "prediction_step"):
            loss_only = frame.f_locals.get("prediction_loss_only")
            return isinstance(loss_only, bool) and not loss_only
    return False


def custom_compute_loss_warning(state) -> None:
    """Warn once when the forward, returning logits=None (labels given), is called from a Trainer
    subclass's own ``compute_loss``: code written for transformers may read ``outputs.logits`` there
    and would fail on None far from the cause.  Trainer's, TRL's and our own compute_loss use the loss
    only.  Checked (``state.checked_compute_loss``) until a Trainer's compute_loss is seen calling: a
    model may first run outside one."""
    custom = None
    for frame, _ in trainer_frames(sys._getframe(1), "compute_loss"):
        state.checked_compute_loss = True
        if custom is None and not frame.f_globals.get("__name__", "").startswith(("transformers.", "trl.", "hf_mhce.")):
            custom = frame
    if custom is not None:  # reported at the line of that compute_loss that called the model
        name = type(custom.f_locals["self"]).__qualname__
        warnings.warn_explicit(
            f"hf_mhce: {name}.compute_loss calls the patched model with labels, which returns logits=None: the "
            "fused loss builds no [tokens x vocab] logits. If that compute_loss reads outputs.logits, patch with "
            "return_logits=True (hf_mhce.apply_patch(model, return_logits=True)), which builds them again, and "
            "their memory; one that uses outputs.loss alone needs nothing.",
            UserWarning, custom.f_code.co_filename, custom.f_lineno, module=custom.f_globals.get("__name__"),
            registry=custom.f_globals.setdefault("__warningregistry__", {}))


def calling_trainer(max_depth: int):
    """The innermost transformers Trainer with a method on the call stack (within ``max_depth`` frames), or None."""
    return next((trainer for _, trainer in trainer_frames(sys._getframe(1), max_depth=max_depth)), None)
