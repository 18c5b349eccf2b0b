"""Which causal LMs the generic forward serves, as data.

The generic forward assumes the HF causal-LM shape
    hidden = model.get_decoder()(...).last_hidden_state
    logits = transform(model.get_output_embeddings()(hidden))
where ``transform`` is the identity for most families.  The few families that scale or soft-cap
their final logits say so through a config attribute; ``FAMILIES`` records which attribute, so the
fused loss can fold it in (a scale into the hidden state, a soft-cap into the op).  A model type not
in the table is accepted only if a one-off probe shows the generic path reproduces its logits.
"""

from __future__ import annotations

import ast
import dataclasses
import dis
import functools
import inspect
import os
import textwrap
import typing
from dataclasses import dataclass

import torch
import transformers
from torch import nn
from transformers import PreTrainedModel
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import ModelOutput
from transformers.utils.generic import TransformersKwargs

from .routers import ROUTER_FIELDS, RouterFacts, router_facts


_STOCK_LOSS_PROPERTY = PreTrainedModel.__dict__["loss_function"]


class UnsupportedModelError(TypeError):
    """The model cannot be served by the generic patched forward."""


@dataclass(frozen=True)
class LogitFacts:
    """How a family turns ``lm_head(hidden)`` into its logits (all attributes of model.config)."""

    multiply_attr: str | None = None  # logits * config.<attr>  (Cohere logit_scale, HyperCLOVAX logits_scaling)
    divide_attr: str | None = None  # logits / config.<attr>    (Granite logits_scaling)
    softcap_attr: str | None = None  # cap * tanh(logits / cap) if set (Gemma-2/3)
    # Where the forward reads the multiplier / divisor: an attribute path from the model ("" = model.config).
    # Cohere copies config.logit_scale to model.logit_scale at __init__, Falcon-H1 to model.model.lm_head_multiplier,
    # and multiplies by that copy: an edit of either one then shows only where the forward reads it.
    scale_owner: str | None = None
    float32_softcap: bool = False  # the logits are upcast to float32 before the soft-cap (BEAM)
    float32_logits: bool = False  # the logits are always upcast to float32 (xLSTM)


_PLAIN = LogitFacts()
_SOFTCAP = LogitFacts(softcap_attr="final_logit_softcapping")
_COHERE = LogitFacts(multiply_attr="logit_scale", scale_owner="")
_INKLING2 = LogitFacts(softcap_attr="final_logit_softcapping", float32_logits=True)  # Inkling-2 and its Loop variant

# model_type -> facts.  Tested in tests/patching against the unpatched model.
FAMILIES: dict[str, LogitFacts] = {
    "llama": _PLAIN,
    "mistral": _PLAIN,
    "gpt2": _PLAIN,
    "qwen2": _PLAIN,
    "qwen3": _PLAIN,
    "gemma": _PLAIN,
    "phi3": _PLAIN,
    "olmo2": _PLAIN,
    "gpt_neox": _PLAIN,
    "gemma2": _SOFTCAP,
    "gemma3_text": _SOFTCAP,
    "vaultgemma": _SOFTCAP,
    "nanochat": _SOFTCAP,
    "gemma3n_text": _SOFTCAP,
    "beam": LogitFacts(softcap_attr="final_logit_softcapping", float32_softcap=True),  # MoE, router logits only
    "paligemma": _SOFTCAP,  # PaliGemma 2 caps with its Gemma-2 text config's value (PaliGemma 1: none)
    "cohere": _COHERE,
    "cohere2": _COHERE,
    "granite": LogitFacts(divide_attr="logits_scaling"),
    "granite_swa": LogitFacts(divide_attr="logits_scaling"),
    "hyperclovax": LogitFacts(multiply_attr="logits_scaling"),
    "falcon_h1": LogitFacts(multiply_attr="lm_head_multiplier", scale_owner="model"),
    "recurrent_gemma": LogitFacts(softcap_attr="logits_soft_cap"),
    "xlstm": LogitFacts(softcap_attr="output_logit_soft_cap", float32_logits=True),
    # mixture-of-experts families: their router's load-balancing loss is found by routers.router_facts
    "mixtral": _PLAIN,
    "qwen2_moe": _PLAIN,
    "qwen3_moe": _PLAIN,
    "olmoe": _PLAIN,
    "phimoe": _PLAIN,
    "gpt_oss": _PLAIN,
    "granitemoe": LogitFacts(divide_attr="logits_scaling"),
    "granitemoeshared": LogitFacts(divide_attr="logits_scaling"),
    "granitemoe_swa": LogitFacts(divide_attr="logits_scaling"),
    "glm4_moe": _PLAIN,  # router logits only: no load-balancing loss
    "cohere2_moe": _COHERE,  # router logits only
    "inkling2_text": _INKLING2,  # router logits only
    "inkling2_loop_text": _INKLING2,
}
TESTED_FAMILIES = ("llama", "mistral", "gpt2")

# Output fields the generic forward fills: loss and logits itself, the rest from the decoder.
# transformers >= 5.24 names past_key_values "cache" and returns a multimodal base's encoder outputs as
# image/video/audio_outputs (the *_hidden_states fields before it).
# rope_deltas: Qwen2-VL's output carried it (from its base model's) until transformers 5.20.
PASSTHROUGH_FIELDS = ("past_key_values", "cache", "hidden_states", "attentions", "cross_attentions", "cache_params",
                      "image_hidden_states", "video_hidden_states", "audio_hidden_states",
                      "image_outputs", "video_outputs", "audio_outputs", "rope_deltas")

REQUIREMENT = (
    "hf_mhce.apply_patch supports the families {tested} (tested end to end), {known} (family table, "
    "checked against the unpatched model), and "
    "any other causal LM whose forward is exactly `logits = model.get_output_embeddings()"
    "(model.get_decoder()(...).last_hidden_state)` (or model.model where get_decoder() returns the model itself): "
    "an nn.Linear head (optionally wrapped by PEFT LoRA or "
    "modules_to_save) applied to the decoder's last hidden state, returning a ModelOutput with only the "
    "fields loss, logits, past_key_values (or cache), hidden_states, attentions, cross_attentions, cache_params, "
    "image/video/audio_hidden_states or image/video/audio_outputs (and, for a mixture of "
    "experts, aux_loss and router_logits, with the loss adding transformers' load_balancing_loss_func)"
)


def transforms_in_source(model_class: type, facts: LogitFacts) -> LogitFacts:
    """``facts`` less the logit transforms of which the installed forward's source shows no sign (a soft-cap:
    any "softcap" / "soft_cap"; a scale: its attribute's name).  The table follows recent transformers, whose
    forward may apply a transform an older release's does not (PaliGemma 2's cap, absent from 5.17's
    PaliGemmaForConditionalGeneration).  Unchanged where the source cannot be read."""
    forward = stock_forward(model_class)
    try:
        source = inspect.getsource(inspect.unwrap(forward)).lower() if forward is not None else None
    except (OSError, TypeError):
        source = None
    if source is None:
        return facts
    shown = {}
    if facts.softcap_attr and "softcap" not in source and "soft_cap" not in source:
        shown.update(softcap_attr=None, float32_softcap=False)
    for field_name in ("multiply_attr", "divide_attr"):
        attr = getattr(facts, field_name)
        if attr and attr.lower() not in source:
            shown[field_name] = None
    return dataclasses.replace(facts, **shown) if shown else facts


def requirement_text() -> str:
    known = sorted(set(FAMILIES) - set(TESTED_FAMILIES))
    return REQUIREMENT.format(tested=", ".join(TESTED_FAMILIES), known=", ".join(known))


def unsupported(model: nn.Module, reason: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"cannot patch {type(model).__name__}: {reason}. {requirement_text()}.")


_TRANSFORMERS_DIR = os.path.join(os.path.dirname(os.path.abspath(transformers.__file__)), "")


def defined_in_transformers(model_class: type) -> bool:
    """Is ``model_class``'s forward transformers' own: does a class of transformers define it (not a user
    subclass's override, nor remote code's), with code from transformers' files (not a function put on the
    class later, which a ``functools.wraps`` wrapper would give the name and ``__module__`` of the forward
    it wraps)?  transformers' own decorators (``can_return_tuple``, ...) live in its files too."""
    owner = next((c for c in model_class.__mro__ if "forward" in c.__dict__), object)
    if not owner.__module__.startswith("transformers."):
        return False
    fn = owner.__dict__["forward"]
    for _ in range(16):  # the function and every function it wraps
        code = getattr(fn, "__code__", None)
        if code is None or not os.path.abspath(code.co_filename).startswith(_TRANSFORMERS_DIR):
            return False
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return True
    return False



# Where the decoder sits when get_decoder() finds none and returns the model itself (Llama-4's text
# model keeps it in .model while its base_model_prefix names "language_model").
DECODER_FALLBACK_ATTR = "model"

# Arguments the generic forward consumes itself; everything else goes to the decoder.
LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")
CONSUMED_ARGS = frozenset({"labels", "return_dict", "logits_to_keep", "return_logits", "skip_logits",
                           "output_router_logits", *LOSS_KWARGS})
# Arguments that reach the decoder through its **kwargs: transformers' shared keyword arguments, and
# cache_position, which 4.x-style forwards (and subclasses written then) name and hand on.
KWARGS_ARGS = frozenset({*TransformersKwargs.__annotations__, "cache_position"})


def decoder_of(model: nn.Module) -> nn.Module:
    """The module whose last hidden state feeds the head: ``model.get_decoder()`` (or the submodule in
    ``DECODER_FALLBACK_ATTR`` where that returns the model), except for a vision-language model, whose
    ``get_decoder()`` is the text model inside its multimodal ``base_model``: the forward runs the base,
    which merges the images (or audio) into the text; the text model alone would silently drop them."""
    decoder = model.get_decoder()
    if decoder is model and isinstance(getattr(model, DECODER_FALLBACK_ATTR, None), nn.Module):
        return getattr(model, DECODER_FALLBACK_ATTR)
    base = model.base_model
    if base is not model and base is not decoder and _takes_more_inputs(type(base).forward, type(decoder).forward):
        return base
    return decoder


def _memoized(fn):
    """``functools.lru_cache(maxsize=None)`` as a plain dict: decoder_of and the labels check run in
    every forward, and dynamo warns of possible silent incorrectness at each lru_cache-wrapped call
    it traces (torch.compile of a patched model), not at a dict lookup."""
    cache = {}

    @functools.wraps(fn)
    def memoized(*args):
        if args not in cache:
            cache[args] = fn(*args)
        return cache[args]

    return memoized


@_memoized
def named_inputs(forward) -> frozenset:
    """The arguments ``forward`` names (not those it takes through ``**kwargs``)."""
    params = inspect.signature(forward).parameters.values()
    return frozenset(p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


@_memoized  # decoder_of runs on every forward
def _takes_more_inputs(base_forward, decoder_forward) -> bool:
    return bool(named_inputs(base_forward) - named_inputs(decoder_forward) - CONSUMED_ARGS)


def dropped_inputs(model: nn.Module, decoder: nn.Module) -> list[str]:
    """Inputs transformers' forward of ``model`` names that the generic forward would hand to a decoder
    whose forward does not name them (they would vanish in its ``**kwargs``, or fail)."""
    stock = stock_forward(type(model))
    if stock is None:
        return []
    decoder_attrs = frozenset(name for name, child in model.named_children() if child is decoder)
    return sorted((named_inputs(stock) & _read_names(stock)) - _handed_to(stock, decoder_attrs)
                  - named_inputs(type(decoder).forward) - CONSUMED_ARGS - KWARGS_ARGS)


@functools.lru_cache(maxsize=None)
def _handed_to(forward, attrs: frozenset) -> frozenset:
    """The names ``forward``'s body uses only as ``name=name`` in calls ``self.<attr>(...)`` of the decoder:
    the original hands them to the decoder's ``**kwargs`` just as the generic forward does (InternVL's
    ``image_sizes``, BLT's cross-attention masks), so nothing is dropped.  Empty where the source is unknown."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(forward))))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    handed = set()  # ids of the Name nodes passed on as name=name to the decoder
    for node in ast.walk(tree):
        func = getattr(node, "func", None)
        if (isinstance(node, ast.Call) and isinstance(func, ast.Attribute) and func.attr in attrs
                and isinstance(func.value, ast.Name) and func.value.id == "self"):
            handed.update(id(k.value) for k in node.keywords if isinstance(k.value, ast.Name) and k.value.id == k.arg)
    passed, other = set(), set()  # a name also used any other way (or re-bound) is read, not only handed on
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (passed if id(node) in handed else other).add(node.id)
    return frozenset(passed - other)


@functools.lru_cache(maxsize=None)
def _read_names(forward) -> frozenset:
    """The local names ``forward``'s body reads: a parameter it never reads (Fuyu's deprecated
    ``image_patches``) is ignored by the original too, so the generic forward loses nothing."""
    func = inspect.unwrap(forward)
    names = set(func.__code__.co_cellvars)  # read by a nested function
    for ins in dis.get_instructions(func):
        if ins.opname.startswith(("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE")):
            names.update(ins.argval if isinstance(ins.argval, tuple) else (ins.argval,))
    return frozenset(names)


def custom_loss_function(model: nn.Module):
    """The loss transformers' forward would call where it is not the stock causal-LM cross-entropy
    (``model.loss_function = fn``, ``model.loss_type`` naming another entry of LOSS_MAPPING, or a
    subclass's own ``loss_function``), else None.  Read as transformers' property reads it, without
    that property's unknown-loss_type warning, and in steps dynamo traces without a graph break."""
    if type(model).loss_function is not _STOCK_LOSS_PROPERTY:
        fn = model.loss_function  # a subclass's own property or method
    else:
        fn = getattr(model, "_loss_function", None)  # what the property's setter stores
    if fn is None:
        loss_type = getattr(model, "loss_type", None)
        fn = LOSS_MAPPING[loss_type if loss_type in LOSS_MAPPING else "ForCausalLM"]
    return None if fn is ForCausalLMLoss else fn


def check_loss_function(model: nn.Module) -> None:
    """Refuse a custom loss that the fused path would silently replace by cross-entropy."""
    fn = custom_loss_function(model)
    if fn is not None:
        raise UnsupportedModelError(
            f"{type(model).__name__}.loss_function is {getattr(fn, '__qualname__', fn)!r} (set through "
            "model.loss_function or model.loss_type), not transformers' ForCausalLMLoss: the patched forward "
            "computes the fused cross-entropy and would ignore it. Remove it, or hf_mhce.unpatch(model) to train "
            "with it"
        )


def stock_forward(model_class: type):
    """The forward of the nearest class in ``model_class``'s MRO that transformers defines (None if none)."""
    return next((c.__dict__["forward"] for c in model_class.__mro__
                 if "forward" in c.__dict__ and c.__module__.startswith("transformers.")), None)


def model_type(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def logit_transform(model: nn.Module, facts: LogitFacts) -> tuple[float | None, float | None, float | None]:
    """(multiplier, divisor, softcap) read from the model's config; None where absent."""
    config = model.config

    def read(attr, owner=None):
        if attr and owner is not None:  # the copy the forward reads, e.g. model.logit_scale
            holder = functools.reduce(getattr, owner.split(".") if owner else (), model)
            if hasattr(holder, attr):
                value = getattr(holder, attr)
                return None if value is None else float(value)
        value = getattr(config, attr, None) if attr else None
        if value is None and attr and hasattr(config, "get_text_config"):  # a vision-language model's text config
            value = getattr(config.get_text_config(), attr, None)
        return None if value is None else float(value)

    return (read(facts.multiply_attr, facts.scale_owner), read(facts.divide_attr, facts.scale_owner),
            read(facts.softcap_attr))


def output_type(model_class: type) -> type:
    """The ModelOutput class the original forward returns (from its return annotation; a subclass's
    unannotated override returns what the transformers forward it extends does)."""
    for forward in (model_class.forward, stock_forward(model_class)):
        found = _annotated_output(forward) if forward is not None else None
        if found is not None:
            return found
    return CausalLMOutputWithPast


def _annotated_output(forward) -> type | None:
    annotation = inspect.signature(forward).return_annotation
    if isinstance(annotation, str):
        try:
            annotation = typing.get_type_hints(forward).get("return", annotation)
        except Exception:  # unresolvable forward reference: fall back on the usual type
            annotation = None
    candidates = typing.get_args(annotation) or (annotation,)
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, ModelOutput)), None)


def check_structure(model: nn.Module) -> tuple[type, nn.Module, RouterFacts | None]:
    """Checks of the generic requirement that need no forward pass; returns (output type, decoder,
    router facts of a mixture of experts or None)."""
    if not isinstance(model, PreTrainedModel):
        hint = (": load the checkpoint first (AutoModelForCausalLM.from_pretrained, or hf_mhce.from_pretrained)"
                if isinstance(model, (str, os.PathLike)) else "")
        raise unsupported(model, f"it is not a transformers PreTrainedModel (nor a PeftModel wrapping one){hint}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise unsupported(model, "encoder-decoder models are not causal LMs")
    try:
        decoder = decoder_of(model)
    except Exception as err:  # noqa: BLE001 - some models raise for exotic layouts
        raise unsupported(model, f"get_decoder() failed ({err})") from err
    if not isinstance(decoder, nn.Module) or decoder is model:
        raise unsupported(model, "get_decoder() does not return a decoder submodule")
    dropped = dropped_inputs(model, decoder)
    if dropped:
        raise unsupported(model, f"its forward takes {dropped}, which {type(decoder).__name__}.forward (the module whose "
                                 "hidden state the generic forward reads) does not name: they would be dropped")
    if model.get_output_embeddings() is None:
        raise unsupported(model, "get_output_embeddings() returns None (no LM head)")
    out_cls = output_type(type(model))
    names = {f.name for f in dataclasses.fields(out_cls)}
    router = None
    if set(ROUTER_FIELDS) <= names:
        router = router_facts(model, stock_forward(type(model)))
        if isinstance(router, str):
            raise unsupported(model, router)
    filled = {"loss", "logits", *PASSTHROUGH_FIELDS, *(ROUTER_FIELDS if router else ())}
    if "aux_loss" not in names:  # router logits alone (Inkling-2): passed through, no loss term to add (the
        filled.add("router_logits")  # verification probe shows one the family's forward would add anyway)
    extra = sorted(names - filled)
    if "logits" not in names or extra:
        raise unsupported(model, f"its output type {out_cls.__name__} has fields {extra} the generic forward cannot fill")
    return out_cls, decoder, router


def probe_inputs(model: nn.Module) -> torch.Tensor:
    """Two rows of a few token ids on the embedding's device, for the verification probe."""
    embed = model.get_input_embeddings()
    vocab = embed.weight.shape[0]
    return torch.stack([torch.arange(3, 9), torch.arange(11, 17)]).to(embed.weight.device) % vocab
