"""apply_patch / unpatch / from_pretrained: the public entry points of the patching layer."""

from __future__ import annotations

import copy
import inspect
import os
import types
import warnings

from torch import nn

from .card import set_card_section
from .config import CONFIG_KEY, OPTION_NAMES, read_adapter_config, resolve_config
from .families import (FAMILIES, LogitFacts, UnsupportedModelError, check_loss_function, check_structure, model_type,
                       transforms_in_source, unsupported)
from .forward import ABSENT, STATE_ATTR, TRAINER_IGNORE_INDEX, PatchState, mirrored_signature, restore_attr
from .head import UnsupportedHeadError, resolve_head
from .methods import (accelerate_autocast, accelerate_wrapper_around_patch, adopt_trl_head, bind_forward, forward_attr,
                      install, live_attr, reaches_patched_forward, remove, wrap_as_accelerate)
from .methods import uncompiled as _uncompiled
from .methods import unwrap as _unwrap
from .probe import foreign_forward, foreign_params, original_forward, verify
from .sharding import full_shape

def apply_patch(model, loss: str | None = None, num_heads: int | None = None, *,
                override_saved: bool = False, **loss_options):
    """Route a causal LM's forward through the fused losses; returns ``model`` (patched in place).

    model: a transformers causal LM, or a PeftModel wrapping one (before or after get_peft_model).
    loss: "ce" or "mhce"; None keeps the config recorded in ``model.config.hf_mhce`` (or "ce").
    num_heads: MHCE heads (must divide the hidden size); None keeps the recorded value.
    override_saved: allow changing a recorded loss/num_heads (e.g. fine-tune an MHCE checkpoint with
        plain CE); without it such a change raises, so a checkpoint's meaning is never lost silently.
    loss_options: ignore_index, label_smoothing, z_loss, return_logits, backend (see LossConfig).

    Only this instance is patched; calling again updates the options; ``unpatch`` undoes it.
    """
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):  # without importing dynamo
        raise TypeError("apply_patch got a torch.compile'd model: patch the model before torch.compile(model), "
                        "or pass the compiled model's _orig_mod")
    target = _unwrap(model)
    out_cls, _, router = check_structure(target)  # first: a hub id or None passed as the model is named here
    state = target.__dict__.get(STATE_ATTR)
    try:
        facts, foreign = _facts(target, out_cls, router, state)
    except UnsupportedModelError as err:
        if state is None:
            raise
        unpatch(model)  # its patch was checked on what the model was then, not on what it is now
        raise UnsupportedModelError(f"{err} The model was patched before and is unpatched now.") from err
    saved = getattr(target.config, CONFIG_KEY, None)
    cfg = resolve_config(saved, state.config if state else None, loss, num_heads, loss_options, override_saved)
    _check_head(target, cfg.num_heads)
    check_loss_function(target)

    if state is None:
        _own_config(target)
        sig = mirrored_signature(type(target))
        attr = forward_attr(target)
        state = PatchState(
            config=cfg, facts=facts, output_cls=out_cls, signature=sig, positional=_positional(sig),
            attr=attr, original=target.__dict__.get(attr, ABSENT),
            original_config=saved if saved is not None else ABSENT,
            original_accepts=target.__dict__.get(_ACCEPTS, ABSENT), router=router, foreign=foreign,
            per_batch_loss=_trainer_passes_no_count(target),
            autocast=accelerate_autocast(target.__dict__.get(attr)) if attr == "forward" else None,
        )
        target.__dict__[STATE_ATTR] = state
        adopt_trl_head(state, state.original)  # a TRL trainer's model: its wrapper's options
        bind_forward(target)
    else:
        state.config, state.facts, state.router, state.foreign = cfg, facts, router, foreign
        if live_attr(target) is None:  # replaced since (e.g. by Liger or TRL): asked again, so put it back
            state.autocast = accelerate_wrapper_around_patch(target) or state.autocast  # prepared since: keep it
            state.attr = forward_attr(target)
            adopt_trl_head(state, target.__dict__.get("forward"))
            bind_forward(target)
    setattr(target.config, CONFIG_KEY, cfg.to_saved())
    no_count = cfg.ignore_index != TRAINER_IGNORE_INDEX or state.per_batch_loss
    restore_attr(target, _ACCEPTS, False if no_count else state.original_accepts)
    state.saves_adapters = state.saves_adapters or model is not target
    install(target)
    if model is not target:  # a PeftModel saves its adapters itself
        install(model)
    return model


def _own_config(model) -> None:
    """Give the model a config object of its own before the loss is recorded in it.  Models built
    from one config object share it (``LlamaForCausalLM(cfg)`` twice): the record would label the
    others too, and an unpatched sibling would save as MHCE.  Every submodule holding the config (or
    one of its sub-configs) is pointed at the copy, so the model stays consistent with itself."""
    memo: dict = {}
    model.config = copy.deepcopy(model.config, memo)
    for module in model.modules():
        held = module.__dict__.get("config")
        if held is not None and id(held) in memo:
            module.__dict__["config"] = memo[id(held)]


# transformers' Trainer reads ``model.accepts_loss_kwargs`` at init to decide whether to pass
# num_items_in_batch, which it counts as labels != -100.  With another ignore_index that count would
# include the ignored tokens, so the patched model says no: each micro-batch then averages its own
# tokens, as for any model without loss kwargs (the forward refuses a count it cannot trust).
_ACCEPTS = "accepts_loss_kwargs"


def _trainer_passes_no_count(model) -> bool:
    """Whether a Trainer passes the unpatched model no num_items_in_batch: without ``accepts_loss_kwargs``
    it looks for a ``**kwargs`` in the forward's signature, which the mirrored one always has (a subclass's
    override or remote code may have none).  The patched model then says no, so that the Trainer averages
    each micro-batch as for the unpatched model rather than train on token-weighted steps."""
    if hasattr(model, _ACCEPTS):
        return False  # the Trainer reads that, which the patch keeps
    params = inspect.signature(original_forward(model)).parameters.values()
    return not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def add_card_section(model, title: str, render) -> None:
    """Add a section to the card written on save: ``render(save_directory)`` returns markdown
    (None removes the section).  Used by the RBE callback for its final table and plots."""
    set_card_section(_unwrap(model), title, render)


def unpatch(model):
    """Restore the original forward and the original ``model.config.hf_mhce``; returns ``model``."""
    target = _unwrap(model)
    if not isinstance(target, nn.Module):
        raise TypeError(f"unpatch expects the model apply_patch patched, got {type(model).__name__} {model!r:.80}")
    state = target.__dict__.get(STATE_ATTR)
    if state is None:
        return model
    attr = live_attr(target) or state.attr  # where it sits now: accelerate hooks may have come or gone
    del target.__dict__[STATE_ATTR]
    original = state.original
    if getattr(original, "__func__", None) is type(target).forward:
        original = ABSENT  # the class's own forward, bound: the same as no instance attribute
    prepared = None  # the autocast of an Accelerator.prepare after the patch (then re-patched: the state's)
    if attr == "forward":
        prepared = accelerate_wrapper_around_patch(target) or (state.autocast if original is ABSENT else None)
    if prepared is not None and accelerate_autocast(original) is None:
        # accelerate wrapped the patched forward in its autocast since: it wraps the original now
        wrap_as_accelerate(target, getattr(original, "__func__", type(target).forward), prepared)
    elif original is not ABSENT:
        target.__dict__[attr] = original
    elif attr == "_old_forward":  # an accelerate hook calls it: the class's forward, bound
        target.__dict__[attr] = types.MethodType(type(target).forward, target)
    else:
        target.__dict__.pop(attr, None)
    for holder in {target, _uncompiled(model)}:  # a PeftModel inside a compile wrapper holds its own
        remove(holder)
    restore_attr(target, _ACCEPTS, state.original_accepts)
    if state.original_config is ABSENT:
        if hasattr(target.config, CONFIG_KEY):
            delattr(target.config, CONFIG_KEY)
    else:
        setattr(target.config, CONFIG_KEY, state.original_config)
    return model


def is_patched(model) -> bool:
    """True while the model's forward leads to hf_mhce's (not after unpatch, nor once replaced)."""
    target = _unwrap(model)
    return STATE_ATTR in target.__dict__ and reaches_patched_forward(target)


def from_pretrained(path_or_id, **kwargs):
    """``AutoModelForCausalLM.from_pretrained`` (for a vision-language checkpoint, its own class's) +
    ``apply_patch``.

    A checkpoint whose config records ``hf_mhce`` gets its saved loss back; a plain checkpoint is
    patched with loss="ce".  A local PEFT adapter directory (``adapter_config.json``) is loaded
    with ``peft.AutoPeftModelForCausalLM`` (base model from the adapter's record) and gets the
    loss config saved beside the adapter (``hf_mhce.json``), else its base's (a vision-language base
    with its saved class).  The apply_patch
    arguments (loss, num_heads, override_saved and the LossConfig options) may be given here too;
    everything else goes to from_pretrained (``trust_remote_code=True`` for a model that is custom code;
    ``output_loading_info=True`` gives (model, report) for a checkpoint, as transformers does; an adapter
    folder refuses it).  An ``hf_mhce.json`` written for other adapter weights than the folder holds (saved
    again without hf_mhce) is not applied, with a warning.
    """
    names = ("loss", "num_heads", "override_saved", *OPTION_NAMES)
    patch_kwargs = {k: kwargs.pop(k) for k in names if k in kwargs}
    path = os.fspath(path_or_id)
    written_as_a_path = os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1  # never a hub id
    if written_as_a_path and not os.path.exists(os.path.expanduser(path)):  # transformers: "Repo id must be ..."
        raise FileNotFoundError(f"hf_mhce.from_pretrained: no such checkpoint directory: {path!r} (give a "
                                "directory that save_pretrained wrote, or a hub id)")
    _check_not_an_adapter_parent(path)
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        if kwargs.get("output_loading_info"):  # PEFT would take the base's (model, report) for a model
            raise ValueError(f"hf_mhce.from_pretrained: output_loading_info=True reports on a checkpoint's weights, and "
                             f"{path!r} is a PEFT adapter, whose loader builds its base without it: load the base "
                             "with AutoModelForCausalLM.from_pretrained(base, output_loading_info=True) to see that "
                             "report, or leave the option out here")
        model = _peft_loader(path, kwargs).from_pretrained(path, **kwargs)
        saved = read_adapter_config(path)
        if saved is not None:  # what the adapter was trained with is what its outputs mean
            setattr(_unwrap(model).config, CONFIG_KEY, saved)
        return apply_patch(model, **patch_kwargs)
    model = _saved_class(path_or_id, kwargs).from_pretrained(path_or_id, **kwargs)
    if kwargs.get("output_loading_info"):  # (model, loading report), as transformers returns it
        model, info = model
        return apply_patch(model, **patch_kwargs), info
    return apply_patch(model, **patch_kwargs)


def _peft_loader(adapter_path: str, kwargs) -> type:
    """``peft.AutoPeftModelForCausalLM``, building the base with its saved class where that is a
    vision-language one: AutoModelForCausalLM cannot load a Qwen2-VL or LLaVA base.  An adapter
    without a task_type (as ``model.add_adapter(LoraConfig(...))`` saves one), which PEFT's auto
    classes refuse, is loaded by transformers' own PEFT integration: the base's class loads the
    adapter directory."""
    from peft import AutoPeftModelForCausalLM, PeftConfig
    from transformers import AutoModelForCausalLM

    try:
        peft_config = PeftConfig.from_pretrained(adapter_path)
    except (OSError, ValueError):  # let peft report it in its words
        return AutoPeftModelForCausalLM
    hub = {**kwargs, "revision": peft_config.revision} if peft_config.revision else kwargs
    base_class = _saved_class(peft_config.base_model_name_or_path, hub)
    if peft_config.task_type is None and getattr(peft_config, "auto_mapping", None) is None:
        return base_class
    if base_class is AutoModelForCausalLM:
        return AutoPeftModelForCausalLM
    return type(f"AutoPeftModelFor{base_class.__name__}", (AutoPeftModelForCausalLM,), {"_target_class": base_class})


def _saved_class(path_or_id, kwargs) -> type:
    """``AutoModelForCausalLM``, or for a vision-language checkpoint the class it was saved from:
    AutoModelForCausalLM cannot load Qwen2-VL or LLaVA, and loads Mllama as its text model alone
    (without the images, and without the loss config, which is in the outer config)."""
    import transformers
    from transformers import AutoModelForCausalLM, PretrainedConfig
    from transformers.models.auto import modeling_auto

    hub = {k: kwargs[k] for k in ("revision", "subfolder", "cache_dir", "token", "local_files_only") if k in kwargs}
    try:
        saved, _ = PretrainedConfig.get_config_dict(path_or_id, **hub)
    except (OSError, ValueError):  # let AutoModelForCausalLM report it in its words
        return AutoModelForCausalLM
    multimodal = {name for mapping in ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES")
                  for names in getattr(modeling_auto, mapping, {}).values()
                  for name in ((names,) if isinstance(names, str) else names)}
    architecture = (saved.get("architectures") or [None])[0]
    if architecture in multimodal and isinstance(getattr(transformers, architecture, None), type):
        return getattr(transformers, architecture)
    return AutoModelForCausalLM


def _check_not_an_adapter_parent(path: str) -> None:
    """PEFT saves adapters other than "default" in ``<dir>/<name>``: name them instead of failing in
    transformers with "Unrecognized model"."""
    if not os.path.isdir(path) or any(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")):
        return
    names = sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n, "adapter_config.json")))
    if names:
        raise ValueError(f"{path} holds no model or adapter itself but PEFT adapters in the subdirectories {names}: "
                         f"pass one of them, e.g. hf_mhce.from_pretrained({os.path.join(path, names[0])!r})")


def _positional(sig) -> tuple[str, ...]:
    kinds = (sig.parameters[n].kind for n in sig.parameters)
    names = [n for n, k in zip(sig.parameters, kinds) if k in (k.POSITIONAL_ONLY, k.POSITIONAL_OR_KEYWORD)]
    return tuple(names[1:])  # drop self


def _check_head(model, num_heads: int) -> None:
    try:
        parts = resolve_head(model.get_output_embeddings())
    except UnsupportedHeadError as err:
        raise unsupported(model, str(err)) from err
    hidden = full_shape(parts.weight)[1]  # ZeRO-3 partitioning at load (zero.Init) leaves an empty placeholder
    if hidden % num_heads:
        configured = getattr(model.config, "hidden_size", hidden)
        also = f" (config.hidden_size is {configured})" if configured != hidden else ""  # OPT's word_embed_proj_dim
        raise ValueError(
            f"num_heads={num_heads} does not divide the hidden size {hidden} that the LM head of "
            f"{type(model).__name__} reads{also}: MHCE splits the final hidden state into num_heads equal slices"
        )


def _facts(model, out_cls, router, state) -> tuple[LogitFacts, dict]:
    """The family's logit facts and the forward's own options the fused forward cannot apply.  A
    family outside the table, or a forward that is not transformers' own (a subclass's override,
    remote code, one replaced on the instance), must pass the verification probe (probe.py)."""
    kind = model_type(model)
    facts = FAMILIES.get(kind)
    forward = original_forward(model, state)
    foreign = foreign_forward(model, forward)
    listed = facts is not None and foreign is None
    if listed:
        facts, table_facts = transforms_in_source(type(model), facts), facts
        if facts == table_facts:
            return facts, {}
        # this transformers' forward lacks a transform the table lists: checked like an unlisted family
    # Probed per instance, never cached per class: a family may transform its logits by a config
    # value (HyperCLOVAX-like scales) that is the identity in one instance and not in the next.
    facts = facts or LogitFacts()
    sig = mirrored_signature(type(model))
    why = verify(model, out_cls, facts, router, forward, sig, _positional(sig))
    if why is not None:
        head = (f"{type(model).__name__}.forward of this transformers release does not apply the logit transform "
                f"the family table lists for {kind!r}" if listed else
                f"model type {kind!r} is not in the family table" if foreign is None else
                f"{foreign}, so the fused loss would bypass it,")
        raise unsupported(model, f"{head} and the generic forward does not reproduce its logits and loss: {why}")
    if foreign is None:
        return facts, {}
    if state is None:  # once per patch, not on each apply_patch that updates its options
        warnings.warn(
            f"hf_mhce: {foreign}; the fused forward replaces it. A check on a few tokens found the same logits and "
            "loss, but what that forward does only in training, on longer inputs or later (a loss term that is zero "
            "now) will not happen. Call apply_patch again after changing what its output depends on.",
            stacklevel=3,
        )
    return facts, foreign_params(model, forward)
