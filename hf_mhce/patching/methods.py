"""The bound methods a patch puts in an instance's ``__dict__``, and how they survive pickling.

A patched transformers model carries ``forward`` (or accelerate's ``_old_forward``) and
``save_pretrained`` and ``_upload_modified_files`` (both write the model card); a PeftModel around it
carries those two.  They stay real bound methods of plain functions, because accelerate rewraps
``model.forward.__func__`` for autocast and rebinds it with ``MethodType`` when unwrapping.

Pickle and ``copy`` would save a bound method as ``getattr(instance, name)`` and look it up while
the instance is still empty: a load error, or worse, the class's unpatched forward.  So each holder
also gets a ``__reduce_ex__`` that leaves these methods (and the card sections, which reference
live callbacks) out of the state and re-installs them when the copy is built: ``torch.save(model)``
and ``copy.deepcopy`` give a model that is patched the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types

import torch
from torch import nn

from .card import SECTIONS_ATTR, write_card
from .config import CONFIG_KEY, write_adapter_config
from .forward import FUSED_REROUTE_KWARG, STATE_ATTR, has_integrated_adapters, make_forward
from .fused_head import DEFAULT_OPTIONS

_REDUCE = "__reduce_ex__"
_UPLOAD = "_upload_modified_files"  # transformers' PushToHubMixin: the last step of every push
_SETSTATE = "__setstate__"


def uncompiled(model):
    """The module a ``torch.compile(model)`` wrapper (OptimizedModule) holds, else ``model``: the patch state
    lives on that module, and the wrapper runs its forward (read without importing dynamo)."""
    while type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model


def unwrap(model) -> nn.Module:
    """The transformers model inside a PeftModel (or LoraModel) and a torch.compile wrapper; the model
    itself otherwise."""
    model = uncompiled(model)
    try:
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTuner
    except ImportError:  # pragma: no cover
        return model
    if isinstance(model, PeftModel):
        return model.get_base_model()
    if isinstance(model, BaseTuner):  # LoraModel & co.: the tuner around the transformers model
        return model.model
    return model


class PatchBypassedError(RuntimeError):
    """Something replaced the patched forward after apply_patch (e.g. Liger's instance patch)."""


def bind_forward(model: nn.Module) -> None:
    """Put the patched forward where the model's patch state says (``forward`` or ``_old_forward``),
    inside the autocast of accelerate's mixed-precision wrapper where the patch replaced one."""
    state = model.__dict__[STATE_ATTR]
    fn = make_forward(state.signature, type(model))
    if state.autocast is not None and state.attr == "forward":
        from accelerate.utils.operations import convert_outputs_to_fp32

        patched = fn

        def under_autocast(self, *args, **kwargs):
            with call_autocast(self.__dict__[STATE_ATTR], kwargs):
                return patched(self, *args, **kwargs)

        fn = convert_outputs_to_fp32(under_autocast)  # as Accelerator.prepare_model builds it
        fn.hf_mhce_patched = True
    model.__dict__[state.attr] = types.MethodType(fn, model)


def accelerate_wrapper_around_patch(model: nn.Module):
    """The autocast of accelerate's mixed-precision wrapper where one now holds the patched forward
    (``Accelerator.prepare`` after apply_patch, as a Trainer with bf16=True does), else None.  A re-patch
    or an unpatch that replaced that wrapper by a forward of its own would drop autocast for the run."""
    forward = model.__dict__.get("forward")
    autocast = accelerate_autocast(forward)
    return autocast if autocast is not None and leads_to_patched(forward) else None


def wrap_as_accelerate(model: nn.Module, forward_fn, autocast) -> None:
    """``model.forward`` = ``forward_fn`` under ``autocast`` with float32 outputs, and ``_original_forward``,
    as ``Accelerator.prepare_model`` leaves a model it prepared with mixed precision."""
    from accelerate.utils.operations import convert_outputs_to_fp32

    model.__dict__["_original_forward"] = types.MethodType(forward_fn, model)
    model.__dict__["forward"] = types.MethodType(convert_outputs_to_fp32(_fresh(autocast)(forward_fn)), model)


def call_autocast(state, kwargs):
    """The autocast one call of the patched forward runs under, read from the state at each call (a later
    TRL trainer may change it): a TRL fused-head call's is the one around that trainer's head alone, any
    other call's the forward's.  A fresh context with the same settings: re-entering the instance that
    accelerate's own wrapper may already be inside would corrupt the state torch.autocast saves on it."""
    fused = state.fused_head and (kwargs.get("fused_lm_head") or kwargs.get(FUSED_REROUTE_KWARG))
    autocast = state.fused_autocast if fused else state.autocast
    return contextlib.nullcontext() if autocast is None else _fresh(autocast)


def _fresh(autocast) -> torch.autocast:
    """A torch.autocast with ``autocast``'s settings (an instance keeps the state it saves on entry)."""
    return torch.autocast(autocast.device, dtype=autocast.fast_dtype, enabled=autocast._enabled,
                          cache_enabled=autocast._cache_enabled)


def accelerate_autocast(forward):
    """The torch.autocast that accelerate's mixed-precision wrapper runs the model's forward under
    (``Accelerator.prepare`` with mixed_precision, as a Trainer with bf16=True does at its first
    evaluate or train), or None if ``forward`` is not that wrapper.  The patch goes inside it: replacing
    it would silently drop autocast for the rest of the run."""
    fn = getattr(forward, "__func__", None)
    if getattr(fn, "__module__", None) != "accelerate.utils.operations" or getattr(fn, "hf_mhce_patched", False):
        return None
    inner = getattr(getattr(fn, "__wrapped__", None), "model_forward", None)  # ConvertOutputsToFp32's
    inner = getattr(inner, "__func__", inner)
    cells = getattr(inner, "__closure__", None) or ()
    return next((c.cell_contents for c in cells if isinstance(c.cell_contents, torch.autocast)), None)


def forward_attr(model: nn.Module) -> str:
    """Where a patched forward goes: ``_old_forward`` under an accelerate hook (which calls it, so the
    hook stays around us), ``forward`` otherwise."""
    return "_old_forward" if "_old_forward" in model.__dict__ and hasattr(model, "_hf_hook") else "forward"


def live_attr(model: nn.Module) -> str | None:
    """Where the patched forward sits now, and the patch state updated to match: accelerate hooks
    added or removed since apply_patch move it between ``forward`` and ``_old_forward``.  None if
    something replaced it."""
    attr = _sits_at(model)
    if attr is not None:
        model.__dict__[STATE_ATTR].attr = attr
    return attr


def _sits_at(model: nn.Module) -> str | None:
    for attr in ("forward", "_old_forward"):
        if getattr(getattr(model.__dict__.get(attr), "__func__", None), "hf_mhce_patched", False):
            return attr
    return None


def reaches_patched_forward(model: nn.Module) -> bool:
    """Does ``model.forward`` lead to the patched forward: an accelerate hook calling it as
    ``_old_forward``, or wrappers that name what they wrap (``__wrapped__``, ``functools.partial``)?"""
    if _sits_at(model) == "_old_forward" and hasattr(model, "_hf_hook"):
        return True
    return leads_to_patched(model.__dict__.get("forward"))


def wrapper_chain(fn, depth: int = 8):
    """``fn`` and what it wraps, outermost first: through bound methods, ``functools.wraps``
    (``__wrapped__``), accelerate's ConvertOutputsToFp32 (``model_forward``) and ``functools.partial``."""
    for _ in range(depth):
        fn = getattr(fn, "__func__", fn)
        if fn is None:
            return
        yield fn
        inner = getattr(fn, "__wrapped__", None)
        fn = getattr(inner, "model_forward", inner) if inner is not None else getattr(fn, "func", None)


def leads_to_patched(fn) -> bool:
    """Does ``fn`` (a forward, possibly inside wrappers) reach the patched one?"""
    return any(getattr(f, "hf_mhce_patched", False) for f in wrapper_chain(fn))


def trl_head_options(forward) -> dict | None:
    """TRL's options (``outputs``, ``temperature``, ``original_forward``) if ``forward`` is the wrapper
    ``trl.trainer.utils.add_fused_lm_head`` installs (fused_head.py), else None.  Told by code object:
    that wrapper copies the name of the class's forward (functools.wraps)."""
    for fn in wrapper_chain(forward):
        code = getattr(fn, "__code__", None)
        if code is not None and getattr(code, "co_qualname", "") == "add_fused_lm_head.<locals>._fused_forward" \
                and "trl" in code.co_filename.replace("\\", "/").split("/"):
            cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
            return {"outputs": tuple(cells.get("outputs", DEFAULT_OPTIONS["outputs"])),
                    "temperature": float(cells.get("temperature", 1.0)),
                    "cast_lm_head_to_fp32": bool(cells.get("cast_lm_head_to_fp32", False)),
                    "original_forward": cells.get("original_forward")}
    return None


def under_trl_heads(forward):
    """What TRL's fused-LM-head wrappers around ``forward`` wrap, innermost: each trainer built on a model
    wraps the forward it finds, TRL's wrapper of an earlier trainer included."""
    for _ in range(16):
        trl = trl_head_options(forward)
        if trl is None:
            break
        forward = trl["original_forward"]
    return forward


def _guard(holder: nn.Module, args, kwargs):
    """Forward pre-hook: on the first call after the patched forward was replaced, put it back where the
    replacement is TRL's fused LM head around it (fused_head.py: the patched forward answers that protocol
    under the model's own distribution), else fail (a Trainer with use_liger_kernel=True replaces it
    when training starts) instead of training with another loss while the config still records hf_mhce's."""
    target = unwrap(holder)
    if STATE_ATTR not in target.__dict__ or reaches_patched_forward(target):
        return None
    state = target.__dict__[STATE_ATTR]
    current = target.__dict__.get("forward")
    trl = trl_head_options(current)
    if trl is not None and leads_to_patched(under_trl_heads(current)):
        adopt_trl_head(state, current)
        state.attr = "forward"
        bind_forward(target)
        # This call has already looked up TRL's wrapper, which hands everything but fused_lm_head=True on to
        # the forward it wrapped (the patched one): the wish goes on under our own name.
        if kwargs.pop("fused_lm_head", False):
            kwargs[FUSED_REROUTE_KWARG] = True
        return args, kwargs
    name, where = _culprit(current)
    raise PatchBypassedError(
        f"{type(target).__name__}.forward was replaced after hf_mhce.apply_patch by {name} ({where}), so the model "
        f"would run without hf_mhce's {state.config.loss!r} loss while its config still records it. A Trainer with "
        "use_liger_kernel=True does this: keep Liger's other kernels with liger_kernel_config="
        "{'fused_linear_cross_entropy': False}, or call hf_mhce.unpatch(model) first to train with Liger's loss "
        "(hf_mhce.apply_patch(model) again puts hf_mhce's forward back)"
    )


def adopt_trl_head(state, forward) -> None:
    """If ``forward`` is TRL's fused-LM-head wrapper, keep its options (which fields, the temperature)
    for the patched forward that replaces it, and the mixed-precision autocast it ran under."""
    trl = trl_head_options(forward)
    if trl is not None:  # the outermost wrapper's: the last trainer built on the model
        state.fused_head = {k: trl[k] for k in DEFAULT_OPTIONS}
        # TRL's head calls the backbone itself, under this trainer's autocast alone: one that an earlier trainer
        # left on the forward inside (which a plain call still passes through) would run an fp32 trainer in bf16
        state.fused_autocast = accelerate_autocast(forward)
        state.autocast = state.fused_autocast or accelerate_autocast(under_trl_heads(forward)) or state.autocast
        state.reference_checked = False  # a new trainer: its reference model is checked at its first call


def _culprit(forward) -> tuple[str, str]:
    """(name, file) of what replaced the forward, by code object through accelerate's and torch's
    wrappers: functools.wraps would have it take the name of the class's forward it wraps."""
    for fn in wrapper_chain(forward):
        code = getattr(fn, "__code__", None)
        if code is not None and not {"accelerate", "torch"} & set(code.co_filename.replace("\\", "/").split("/")):
            return getattr(code, "co_qualname", code.co_name), code.co_filename
    func = getattr(forward, "__func__", forward)
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', type(func).__name__)}", "file unknown"


def install(holder: nn.Module) -> None:
    """Give ``holder`` the saving and pickling methods and the guard (those already there are kept)."""
    for name, function in (("save_pretrained", _save_with_card), (_REDUCE, _reduce_ex), (_UPLOAD, _upload_with_card)):
        if name not in holder.__dict__ and (name != _UPLOAD or hasattr(type(holder), _UPLOAD)):
            holder.__dict__[name] = types.MethodType(function, holder)
    if _guard not in holder._forward_pre_hooks.values():
        holder.register_forward_pre_hook(_guard, with_kwargs=True)


def remove(holder: nn.Module) -> None:
    """Drop the saving and pickling methods and the guard ``install`` added (unpatch restores the forward)."""
    for name in ("save_pretrained", _REDUCE, _UPLOAD):
        if _is_ours(holder.__dict__.get(name)):
            del holder.__dict__[name]
    for key in [k for k, hook in holder._forward_pre_hooks.items() if hook is _guard]:
        del holder._forward_pre_hooks[key]
        holder._forward_pre_hooks_with_kwargs.pop(key, None)


def _is_ours(value) -> bool:
    func = getattr(value, "__func__", None)
    return func in (_save_with_card, _reduce_ex, _upload_with_card) or getattr(func, "hf_mhce_patched", False)


def _save_with_card(self, save_directory, *args, **kwargs):
    """The class's save_pretrained, then the hf_mhce section of the model card (main process).

    A PeftModel saves its adapters without the base's config.json, so the loss config goes beside
    each of them in ``hf_mhce.json``, where ``from_pretrained`` of the adapter directory finds it:
    the "default" adapter in ``save_directory``, any other one in ``save_directory/<name>`` (PEFT's layout).
    A transformers model carrying adapters of its own (``add_adapter`` / ``load_adapter``) saves its
    active adapter alone, also without config.json: ``hf_mhce.json`` goes beside it too.
    """
    target = unwrap(self)
    if STATE_ATTR in target.__dict__:  # config.json records the loss this model computes, whatever changed the
        # config since (unpatch of a shallow copy sharing it, say): else it reloads with another loss
        setattr(target.config, CONFIG_KEY, target.__dict__[STATE_ATTR].config.to_saved())
    result = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    _write_hf_mhce_files(self, save_directory, kwargs.get("is_main_process", True))
    return result


def _upload_with_card(self, working_dir, repo_id, *args, **kwargs):
    """transformers' ``push_to_hub`` (and ``save_pretrained(push_to_hub=True)``) saves, then replaces README.md
    with the Hub's card and uploads the folder through this method: the hf_mhce section (for MHCE, the notice
    that transformers alone computes another distribution) is put back first, loading by the repo id."""
    _write_hf_mhce_files(self, working_dir, True, name=repo_id)
    return type(self)._upload_modified_files(self, working_dir, repo_id, *args, **kwargs)


def _write_hf_mhce_files(self, save_directory, main_process: bool, name: str | None = None) -> None:
    target = unwrap(self)
    state = target.__dict__.get(STATE_ATTR)
    if state is not None and main_process:
        directory = os.fspath(save_directory)
        adapters_only = self is not target or has_integrated_adapters(target)
        names = getattr(self, "peft_config", {}) if self is not target else {}  # integrated: the active one only
        candidates = dict.fromkeys([directory, *(os.path.join(directory, n) for n in names if n != "default")])
        adapter_dirs = [d for d in candidates if os.path.isfile(os.path.join(d, "adapter_config.json"))] if adapters_only else []
        # PEFT saves adapters not named "default" in <directory>/<name>: the card loads the first of those
        loads = name or (os.path.abspath(adapter_dirs[0]) if adapter_dirs and adapter_dirs[0] != directory else None)
        write_card(target, state.config, directory, bool(adapter_dirs), loads)
        for adapter_dir in adapter_dirs:
            write_adapter_config(adapter_dir, state.config)


def _reduce_ex(self, protocol):
    """What pickle and copy save: the class's own reduction, minus our methods and card sections,
    rebuilt through ``_rebuild`` so the copy gets its own methods back."""
    patch = self.__dict__.get(STATE_ATTR)
    if patch is not None:
        live_attr(self)  # re-installed where it sits now (an accelerate hook may have come or gone)
    func, args, state, *rest = type(self).__reduce_ex__(self, protocol)
    if not isinstance(state, dict):  # pragma: no cover - nn.Module always reduces to its __dict__
        raise TypeError(f"cannot pickle a patched {type(self).__name__}: unexpected state {type(state)}")
    state = {k: v for k, v in state.items() if k != SECTIONS_ATTR and not _is_ours(v)}
    prepared = accelerate_wrapper_around_patch(self) if patch is not None else None
    if prepared is not None:  # accelerate's mixed-precision wrapper came after the patch (Accelerator.prepare, a
        # Trainer with bf16): the copy's patched forward goes under the same autocast; this model's record is kept
        state[STATE_ATTR] = dataclasses.replace(patch, autocast=prepared)
    return (_rebuild, (func, args), state, *rest)


def _rebuild(func, args):
    """The class's reconstruction, with a one-shot ``__setstate__`` that re-installs our methods."""
    obj = func(*args)
    obj.__dict__[_SETSTATE] = types.MethodType(_setstate, obj)
    return obj


def _setstate(self, state):
    del self.__dict__[_SETSTATE]
    type(self).__setstate__(self, state)
    if STATE_ATTR in self.__dict__:
        bind_forward(self)
    install(self)

