"""The verification probe: does the generic forward reproduce a forward that the family table does
not vouch for (a model type outside it, a subclass's override, remote code, a forward replaced on
the instance)?

Both forwards run on two rows of a few tokens in eval mode, one label ignored, and must agree on
what a caller sees: the loss (with gradients enabled, so that a forward that builds no graph is
told apart), its dependence on ``num_items_in_batch`` (which a Trainer passes), the logits with and
without labels (also scaled to large values, where a soft-cap shows), and a mixture of experts'
``aux_loss``.  The model is left as found: mode, buffers
(a step counter, say) and the hooks transformers installs.

A check on a few tokens cannot see everything: what a forward does only in training, on longer
inputs, or later (a regulariser that is zero at first) passes it.  A forward that is not
transformers' own is therefore patched with a warning that says so.
"""

from __future__ import annotations

import functools
import inspect
import types

import torch
from torch import nn

from .families import (CONSUMED_ARGS, KWARGS_ARGS, decoder_of, defined_in_transformers, model_type, named_inputs,
                       probe_inputs, stock_forward, unsupported)
from .forward import ABSENT, PatchState, generic_forward, restore_attr
from .methods import accelerate_autocast, forward_attr, under_trl_heads


def original_forward(model: nn.Module, state=None):
    """The forward the unpatched model runs: an instance attribute that replaced the class's (where
    the patch goes: ``forward``, or ``_old_forward`` under an accelerate hook; recorded in ``state``
    once patched), else the class's forward, bound.  TRL's fused-LM-head wrappers are looked through:
    the patched forward answers their protocol itself (fused_head.py)."""
    original = model.__dict__.get(forward_attr(model), ABSENT) if state is None else state.original
    original = under_trl_heads(original)
    if accelerate_autocast(original) is not None:  # accelerate's mixed precision: the forward inside it
        original = model.__dict__.get("_original_forward", ABSENT)
    func = getattr(original, "__func__", None)
    func = getattr(func, "__func__", func)  # accelerate's unwrap_model rebinds the bound method itself
    if original is ABSENT or func is type(model).forward:
        return types.MethodType(type(model).forward, model)
    return original


def foreign_forward(model: nn.Module, forward) -> str | None:
    """Why ``forward`` (from ``original_forward``) is not transformers' own, or None if it is."""
    cls = type(model)
    if getattr(forward, "__func__", None) is not cls.forward:
        name = getattr(forward, "__qualname__", None) or type(forward).__qualname__  # never a repr of the model
        return f"the instance's forward was replaced by {name!r}"
    if not defined_in_transformers(cls):
        owner = next(c for c in cls.__mro__ if "forward" in c.__dict__)
        if not owner.__module__.startswith("transformers."):
            return f"{owner.__qualname__}.forward is defined outside transformers (in {owner.__module__})"
        code = getattr(owner.__dict__["forward"], "__code__", None)  # a function put on transformers' class
        where = f"{getattr(code, 'co_qualname', code.co_name)} in {code.co_filename}" if code else "a callable"
        return f"{owner.__qualname__}.forward is not transformers' own: the class's forward was replaced by {where}"
    return None


def foreign_params(model: nn.Module, forward) -> dict:
    """{name: default} of ``forward``'s parameters that neither transformers' forward it extends, nor
    the decoder, nor the generic forward itself knows: a subclass's own options (``temperature=1.0``),
    which the fused forward cannot apply."""
    known = set(CONSUMED_ARGS | KWARGS_ARGS)
    for fn in (stock_forward(type(model)), type(decoder_of(model)).forward):
        if fn is not None:
            known |= named_inputs(fn)
    params = inspect.signature(forward).parameters.values()
    return {p.name: p.default for p in params if p.name not in known and p.name != "self"
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


@torch.inference_mode(False)  # the check needs a graph, also where a caller patches under inference_mode
def verify(model: nn.Module, out_cls, facts, router, forward, signature, positional) -> str | None:
    """None if the generic forward reproduces ``forward`` on the probe's inputs, else what differs."""
    from .config import LossConfig

    if any(p.is_meta for p in model.parameters()):
        raise unsupported(model, f"{type(model).__name__} (model type {model_type(model)!r}) must be verified against "
                                 "the generic forward, but its weights are on the meta device")
    state = PatchState(LossConfig(return_logits=True), facts, out_cls, signature, positional, "forward",
                       ABSENT, ABSENT, router=router)
    accepts = inspect.signature(forward).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepts.values())
    base = {"use_cache": False} if takes_any or "use_cache" in accepts else {}
    if router:
        base["output_router_logits"] = True
    was_training, buffers, hooks = model.training, _buffer_snapshot(model), _hook_snapshot(model)
    model.eval()
    try:
        ids = probe_inputs(model)
        labels = ids.clone()
        labels[0, 2] = -100  # rows with different counts: a per-row mean or an ignore_index slip shows
        with torch.enable_grad():  # a forward that builds no graph (under no_grad) shows too
            ours = functools.partial(generic_forward, model, state)
            ref, mine = forward(input_ids=ids, labels=labels, **base), ours(input_ids=ids, labels=labels, **base)
            why = _compare(ref, mine, "with labels", router)
            if why is None and ref.loss.requires_grad != mine.loss.requires_grad:
                why = f"its loss {'does' if ref.loss.requires_grad else 'does not'} require grad, the fused one's not so"
        del ref, mine
        with torch.no_grad():
            if why is None and (takes_any or "num_items_in_batch" in accepts):  # a Trainer passes it then
                count = torch.tensor(2 * int((labels[:, 1:] != -100).sum()), device=ids.device)
                kw = dict(input_ids=ids, labels=labels, num_items_in_batch=count, **base)
                why = _compare(forward(**kw), ours(**kw), "given num_items_in_batch", router)
            if why is None:
                ref = forward(input_ids=ids, **base)
                why = _compare(ref, ours(input_ids=ids, **base), "without labels", router)
            if why is None and torch.is_tensor(ref.logits) and ref.logits.numel():
                why = _large_logits(model, forward, ours, ids, base, router, ref.logits.detach().abs().max().item())
        return why
    except Exception as err:  # noqa: BLE001 - a forward the check cannot run is not verified
        return f"the check's forward raised {type(err).__name__}: {err}"
    finally:
        model.train(was_training)
        _restore_buffers(buffers)
        _remove_new_hooks(hooks)


LARGE_LOGIT = 50.0  # well inside any soft-cap's bend (Gemma-2's 30), far from float16's range


def _large_logits(model, forward, ours, ids, base, router, largest: float) -> str | None:
    """The logits once more with the head's output scaled to |logit| ~ LARGE_LOGIT: a fresh model's
    logits are small, where a soft-cap c * tanh(z / c) is z to the check's tolerance, so a family
    that caps them would pass with the cap dropped.  Skipped where the forward does not call the head
    module (nothing to scale)."""
    head = model.get_output_embeddings()
    scale, fired = LARGE_LOGIT / max(largest, 1e-6), []

    def scaled(module, inputs, output):
        fired.append(True)
        return output * scale

    handle = head.register_forward_hook(scaled)
    try:
        ref = forward(input_ids=ids, **base)
        if not fired:
            return None
        return _compare(ref, ours(input_ids=ids, **base), "with large logits (a logit transform such as a soft-cap)",
                        router)
    finally:
        handle.remove()


def _compare(ref, ours, case: str, router) -> str | None:
    pairs = [("logits", ref.logits, ours.logits), ("loss", ref.loss, ours.loss)]
    if router:
        pairs.append(("aux_loss", getattr(ref, "aux_loss", None), getattr(ours, "aux_loss", None)))
    scale = ref.logits.detach().abs().max().item() if torch.is_tensor(ref.logits) and ref.logits.numel() else 0.0
    for name, r, o in pairs:
        if r is None and o is None:
            continue
        if r is None or o is None:
            return f"{case}, its {name} is {'None' if r is None else 'set'} and the fused one's is not"
        atol = 1e-5
        if name == "loss" and torch.is_tensor(ref.logits) and ref.logits.dtype.is_floating_point:
            # HF's loss comes from logits rounded to their dtype, the fused one from float32 sums: in
            # bf16 they differ by about the rounding of the largest logit
            atol = max(atol, torch.finfo(ref.logits.dtype).eps * scale)
        if r.shape != o.shape:
            return f"{case}, its {name} has shape {tuple(r.shape)}, the fused one {tuple(o.shape)}"
        if not torch.allclose(r.detach().float(), o.detach().float(), rtol=1e-4, atol=atol):
            gap = (r.detach().float() - o.detach().float()).abs().max().item()
            verb = "differ" if name == "logits" else "differs"
            return f"{case}, its {name} {verb} from the fused one's (largest difference {gap:.3g})"
    return None


def _buffer_snapshot(model):
    return [(b, b.detach().clone()) for b in model.buffers() if not b.is_meta]


@torch.no_grad()
def _restore_buffers(snapshot) -> None:
    for buffer, saved in snapshot:
        if buffer.shape == saved.shape:
            with torch.inference_mode(buffer.is_inference()):  # a model built under inference_mode has such buffers
                buffer.copy_(saved)


# transformers installs output-capturing forward hooks, local closures that pickle cannot save, on the
# first forward that records outputs (router logits here), and marks the model with this attribute.
_HOOKED = "_output_capturing_hooks_installed"


def _hook_snapshot(model):
    return [(m, set(m._forward_hooks), m.__dict__.get(_HOOKED, ABSENT)) for m in model.modules()]


def _remove_new_hooks(snapshot) -> None:
    """Undo the hooks the probe's forwards installed: the probe must leave the model as it found it
    (a model that pickled before apply_patch still pickles, and after unpatch)."""
    for module, keys, flag in snapshot:
        for key in set(module._forward_hooks) - keys:
            for table in (module._forward_hooks, module._forward_hooks_with_kwargs, module._forward_hooks_always_called):
                table.pop(key, None)
        restore_attr(module, _HOOKED, flag)
