"""The one generic forward every patched causal LM runs.

    hidden = model.get_decoder()(**inputs).last_hidden_state
    labels given  -> loss = fused op on the HF-shifted labels; logits None unless asked for
                     (``return_logits``, or a Trainer's prediction step that needs predictions)
    no labels     -> logits like HF (logits_to_keep honoured); for "mhce" the mixture log-probs

The loss always covers every position (logits_to_keep only trims returned logits).  With
return_dict=False and labels the logits are built (unless return_logits=False), so the tuple keeps
HF's positions (loss, logits, past_key_values, ...); None fields are left out, as HF's are.

Everything model-specific is data: the original forward's signature (mirrored, so generate() and
Trainer see the same parameters), its output type, and the family's logit facts.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # transformers < 5.23 (pyproject allows 5.x): the slice its causal LMs wrote inline
    def slice_logits_to_keep(hidden, logits_to_keep):
        return hidden[:, slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep, :]

from ..losses import linear_cross_entropy, multi_head_cross_entropy, multi_head_logprobs
from ..losses.checks import int64_labels
from .callers import check_trainer_loss, custom_compute_loss_warning, trainer_needs_predictions
from .config import LossConfig
from .families import LOSS_KWARGS, LogitFacts, check_loss_function, decoder_of, logit_transform, named_inputs, stock_forward
from .fused_head import FusedLMHeadOutput, fused_head_output
from .head import fused_operands, head_rng_state, mixed_batch_adapters, resolve_head, restore_rng_state
from .routers import RouterFacts, router_loss, wants_router_logits
from .sharding import call_through

STATE_ATTR = "_hf_mhce_patch"
TRAINER_IGNORE_INDEX = -100  # what transformers' Trainer assumes when it counts num_items_in_batch
FUSED_REROUTE_KWARG = "_hf_mhce_fused_lm_head"


@dataclass
class PatchState:
    """Per-instance record of a patch (stored in the instance's __dict__)."""

    config: LossConfig
    facts: LogitFacts
    output_cls: type
    signature: inspect.Signature  # mirrored original signature, without self
    positional: tuple[str, ...]  # names that positional arguments bind to
    attr: str  # "forward", or "_old_forward" under an accelerate hook
    original: object  # the instance attribute we replaced, or _ABSENT
    original_config: object  # model.config.hf_mhce before the first patch, or _ABSENT
    saves_adapters: bool = False  # a PeftModel around the model was patched too (writes hf_mhce.json)
    original_accepts: object = field(default_factory=lambda: ABSENT)  # instance's accepts_loss_kwargs before
    per_batch_loss: bool = False  # a Trainer passed the unpatched model no num_items_in_batch (api._trainer_passes_no_count)
    warned_adapter_save: bool = False
    warned_tuple_logits: bool = False
    checked_compute_loss: bool = False  # a Trainer's compute_loss was seen calling (custom_compute_loss_warning)
    router: RouterFacts | None = None  # a mixture of experts' load-balancing loss (routers.py)
    foreign: dict = field(default_factory=dict)  # a replaced forward's own options: {name: default} (probe.py)
    autocast: object = None  # accelerate's mixed-precision autocast the forward ran under (methods.py)
    fused_autocast: object = None  # the one around the TRL fused head adopted last, for its calls (methods.py)
    fused_head: dict = field(default_factory=dict)  # TRL's add_fused_lm_head options, once seen (fused_head.py)
    reference_checked: bool = False  # the reference model of the TRL trainer adopted last (trl_reference.py)


class _Absent:
    """Marks "there was no instance attribute"; a singleton, also across copy/deepcopy/pickle."""

    def __repr__(self):
        return "<absent>"

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return "ABSENT"


ABSENT = _Absent()


def restore_attr(target, name: str, value) -> None:
    """Set an instance attribute, or remove it for ABSENT."""
    if value is ABSENT:
        target.__dict__.pop(name, None)
    else:
        target.__dict__[name] = value


def mirrored_signature(model_class: type) -> inspect.Signature:
    """The original forward's signature plus ``return_logits`` (and ``**kwargs`` if it had none)."""
    sig = inspect.signature(model_class.forward)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values()):
        # A subclass's forward(*args, **kwargs) hands them on: the transformers forward it extends names them.
        stock = stock_forward(model_class)
        if stock is not None:
            sig = inspect.signature(stock)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    var_kw = [p for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    if "return_logits" not in sig.parameters:
        params.append(inspect.Parameter("return_logits", inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation="bool | None"))
    params += var_kw or [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]
    return sig.replace(parameters=params)


def make_forward(signature: inspect.Signature, model_class: type):
    """A forward function carrying ``signature`` (generation and Trainer inspect it)."""

    def forward(self, *args, **kwargs):
        return generic_forward(self, self.__dict__[STATE_ATTR], *args, **kwargs)

    forward.__signature__ = signature
    forward.__name__ = "forward"
    forward.__qualname__ = f"{model_class.__name__}.forward"
    forward.__doc__ = (
        f"{model_class.__name__}.forward patched by hf_mhce: fused loss when labels are given (logits None "
        "unless return_logits=True or a Trainer needs predictions), logits (for 'mhce': mixture log-probs) otherwise."
    )
    forward.hf_mhce_patched = True
    return forward


def generic_forward(model: nn.Module, state: PatchState, *args, **kwargs):
    if len(args) > len(state.positional):
        raise TypeError(f"forward() takes {len(state.positional)} positional arguments but {len(args)} were given")
    for name, value in zip(state.positional, args):
        if name in kwargs:
            raise TypeError(f"forward() got multiple values for argument {name!r}")
        kwargs[name] = value
    for name, default in state.foreign.items():
        if name in kwargs and not _is_default(kwargs.pop(name), default):
            raise TypeError(
                f"{name!r} is an option of the forward hf_mhce replaced ({type(model).__name__}'s own), which the "
                f"fused forward cannot apply; leave it at its default {default!r}, or hf_mhce.unpatch(model)")
    cfg = state.config
    if ("peft_config" in model.__dict__ and not (state.saves_adapters or state.warned_adapter_save)
            and not has_integrated_adapters(model)):  # whose save_pretrained is ours: it writes hf_mhce.json
        _warn_adapter_save(state)

    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:  # as transformers' can_return_tuple
        return_dict = getattr(model.config, "return_dict", True)
    labels = kwargs.pop("labels", None)
    logits_to_keep = kwargs.pop("logits_to_keep", 0)
    want_logits = kwargs.pop("return_logits", None)
    skip_logits = kwargs.pop("skip_logits", None)  # the Liger/Trainer spelling of the same wish
    # TRL's fused-LM-head call (fused_head.py); the second name is how methods.py's guard reroutes one
    # that reaches us through TRL's wrapper
    fused = bool(kwargs.pop("fused_lm_head", False)) | bool(kwargs.pop(FUSED_REROUTE_KWARG, False))
    if want_logits is None:
        want_logits = cfg.return_logits if skip_logits is None else not skip_logits
    loss_kwargs = {k: kwargs.pop(k) for k in LOSS_KWARGS if k in kwargs}
    if state.router is not None:  # an MoE forward resolves the flag and hands it to its decoder
        kwargs["output_router_logits"] = wants_router_logits(model, kwargs)

    decoder = decoder_of(model)
    if labels is not None and "labels" in named_inputs(type(decoder).forward):
        kwargs["labels"] = labels  # Gemma-3's multimodal base builds its training attention mask from them
    outputs = decoder(**kwargs)
    hidden = outputs[0] if isinstance(outputs, tuple) else outputs.last_hidden_state

    loss = logits = aux_loss = None
    rng = None  # training logits beside the loss (asked for, or HF's tuple): replay the head's dropout
    if (model.training and labels is not None and not fused and (want_logits or (want_logits is None and not return_dict))
            and not torch.compiler.is_compiling()):
        rng = head_rng_state(model, hidden)
    if fused:
        check_loss_function(model)
        result = fused_head_output(model, state, hidden, labels, **loss_kwargs)
        loss = result.loss
    elif labels is not None:  # as in transformers, shift_labels without labels asks for no loss
        check_loss_function(model)
        loss = _loss(model, state, _loss_positions(hidden, labels, logits_to_keep, loss_kwargs), labels, **loss_kwargs)
    elif (cfg.z_loss or cfg.label_smoothing or cfg.ignore_index != TRAINER_IGNORE_INDEX) and (
            model.training or not torch.compiler.is_compiling()):  # compiled generation: no graph break
        check_trainer_loss(cfg)  # a Trainer that took the labels would drop them
    if state.router is not None and state.router.adds_loss and kwargs["output_router_logits"]:
        aux_loss, weight = router_loss(model, state.router, getattr(outputs, "router_logits", None),
                                       kwargs.get("attention_mask"))
        if loss is not None:
            loss = loss + weight * aux_loss.to(loss.device)
    if fused:
        return FusedLMHeadOutput(**{**result, "loss": loss, "aux_loss": aux_loss})
    if want_logits is None and loss is not None and not return_dict:
        want_logits = True  # HF's tuple is (loss, logits, ...): code that unpacks it by position
        _warn_tuple_logits(state)
    if want_logits is None and loss is not None and not model.training:
        want_logits = trainer_needs_predictions()
    if loss is None or want_logits:
        if rng is not None:  # the head's dropout (LoRA) draws the loss's mask again: one sample, as unpatched
            restore_rng_state(rng)
        logits = _logits(model, state, slice_logits_to_keep(hidden, logits_to_keep))
    elif not state.checked_compute_loss and not torch.compiler.is_compiling():
        custom_compute_loss_warning(state)

    passthrough = {}
    if not isinstance(outputs, tuple):
        passthrough = {k: getattr(outputs, k, None) for k in state.output_cls.__dataclass_fields__
                       if k not in ("loss", "logits")}
    if aux_loss is not None:
        passthrough["aux_loss"] = aux_loss
    result = state.output_cls(loss=loss, logits=logits, **passthrough)
    return result if return_dict else result.to_tuple()


def _is_default(value, default) -> bool:
    if value is default or torch.is_tensor(value) or torch.is_tensor(default):
        return value is default
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001 - values that cannot be compared are not the default
        return False


def _warn_tuple_logits(state: PatchState) -> None:
    if not state.warned_tuple_logits:
        state.warned_tuple_logits = True
        warnings.warn(
            "hf_mhce: return_dict=False with labels builds the [tokens x vocab] logits, so that the tuple keeps "
            "transformers' positions (loss, logits, ...). Pass return_logits=False (forward keyword or apply_patch "
            "option) to skip them; the tuple then has no logits entry, as a ModelOutput leaves out None fields.",
            stacklevel=4)


def has_integrated_adapters(model: nn.Module) -> bool:
    """Adapters added through transformers' own PEFT integration (``add_adapter`` / ``load_adapter``),
    which make ``save_pretrained`` write the active adapter alone."""
    return bool(model.__dict__.get("_hf_peft_config_loaded", False))


def _warn_adapter_save(state: PatchState) -> None:
    """PEFT wrapped the model after apply_patch: the PeftModel's save_pretrained is not ours."""
    state.warned_adapter_save = True
    if state.config.to_saved() == LossConfig().to_saved():
        return  # plain CE with default options: an adapter saved without hf_mhce.json loses nothing
    warnings.warn(
        "hf_mhce: this model was patched before get_peft_model, so saving the PeftModel's adapter alone "
        "(PeftModel.save_pretrained, Trainer.save_model) will not write hf_mhce.json, the loss config "
        f"{state.config.to_saved()}; hf_mhce.from_pretrained(adapter_dir) would then load plain CE. "
        "Call hf_mhce.apply_patch(peft_model) once more after get_peft_model (with a trainer that wraps the model "
        "itself, such as TRL's peft_config=..., hf_mhce.apply_patch(trainer.model)).",
        stacklevel=3,
    )


def _loss(model, state, hidden, labels, shift_labels=None, num_items_in_batch=None, ignore_index=None):
    """HF's ForCausalLMLoss semantics, computed by the fused op (no [N, V] logits)."""
    cfg = state.config
    ignore_index = cfg.ignore_index if ignore_index is None else ignore_index
    # as in HF, labels are only read without shift_labels; as int64 (F.pad cannot pad unsigned ones with -100)
    if shift_labels is None:
        _check_label_shape("labels", labels, hidden)
        labels = int64_labels(labels)
    else:
        _check_label_shape("shift_labels", shift_labels, hidden)
        shift_labels = int64_labels(shift_labels)
    if num_items_in_batch is not None and ignore_index != TRAINER_IGNORE_INDEX:  # the labels as given, not our padding
        _check_item_count_ignores(labels[..., 1:] if shift_labels is None else shift_labels, ignore_index)
    if shift_labels is None:  # tokens < n predict n; the last position predicts nothing
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(hidden.device)
    multiply, divide, softcap = logit_transform(model, state.facts)
    scale = (multiply or 1.0) / (divide or 1.0)
    head = model.get_output_embeddings()
    options = dict(ignore_index=ignore_index, num_items_in_batch=num_items_in_batch,
                   label_smoothing=cfg.label_smoothing, z_loss=cfg.z_loss, softcap=softcap, backend=cfg.backend)

    def fused(hidden, shift_labels, adapter=None):  # reads the head inside the head's call: see sharding.py
        x, w, b, low_rank = fused_operands(resolve_head(head, adapter, hidden), hidden, cfg.num_heads, scale)
        if cfg.loss == "mhce":
            return multi_head_cross_entropy(x, w, shift_labels, cfg.num_heads, bias=b, low_rank=low_rank, **options)
        return linear_cross_entropy(x, w, shift_labels, bias=b, low_rank=low_rank, **options)

    counted = (shift_labels != ignore_index).sum()
    names = mixed_batch_adapters(head)
    if names is None:
        loss = call_through(head, fused, hidden, shift_labels)
    else:
        if num_items_in_batch is None:  # each row group's sum over the whole batch's count adds up to the mean
            options["num_items_in_batch"] = counted.clamp_min(1)
        groups = list(_adapter_groups(names, hidden))

        def fused_groups(hidden, shift_labels):  # every group in one call of the head (see _adapter_groups)
            return sum(fused(hidden[rows], shift_labels[rows], adapter=name) for name, rows in groups)

        loss = call_through(head, fused_groups, hidden, shift_labels)
    return _nan_when_nothing_counts(loss, counted, num_items_in_batch)


def _loss_positions(hidden, labels, logits_to_keep, loss_kwargs):
    """The hidden states the loss covers: every position, or those ``logits_to_keep`` keeps where the
    labels are sized to them (HF computes its loss on the kept logits then)."""
    given = loss_kwargs.get("shift_labels")
    given = labels if given is None else given
    if isinstance(logits_to_keep, int) and logits_to_keep == 0 or given.shape == hidden.shape[:-1]:
        return hidden
    kept = slice_logits_to_keep(hidden, logits_to_keep)
    if given.shape == kept.shape[:-1]:
        return kept
    raise ValueError(f"labels of shape {tuple(given.shape)} fit neither the input {tuple(hidden.shape[:-1])} nor "
                     f"the positions logits_to_keep={logits_to_keep!r} keeps {tuple(kept.shape[:-1])}")


def _check_label_shape(name, labels, hidden) -> None:
    if labels is not None and labels.shape != hidden.shape[:-1]:
        hint = f" (add the batch dimension: {name}[None])" if labels.dim() == 1 and hidden.shape[0] == 1 else ""
        raise ValueError(f"{name} has shape {tuple(labels.shape)}, but the input has shape {tuple(hidden.shape[:-1])} "
                         f"(batch, sequence): {name} must have the shape of input_ids{hint}")


def _nan_when_nothing_counts(loss, counted, num_items_in_batch):
    """HF's loss of a batch without any target is 0/0 = NaN, which the Trainer's evaluation leaves
    out of eval_loss (``logging_nan_inf_filter``); the fused loss gives 0.  Report HF's value, but as
    a constant beside the loss, so the gradients stay zero, as HF's are.  No device sync."""
    empty = counted == 0
    if num_items_in_batch is not None:  # a count over a larger batch: HF's 0 / count = 0 then
        empty = empty & (torch.as_tensor(num_items_in_batch, device=loss.device) == 0)
    return loss + torch.where(empty, float("nan"), 0.0).to(device=loss.device, dtype=loss.dtype)


def _check_item_count_ignores(shift_labels, ignore_index) -> None:
    """transformers' Trainer counts num_items_in_batch as labels != -100: with another ignore_index in
    the labels that count takes the ignored tokens in too, and the loss would be divided by too many.
    A Trainer created after apply_patch never passes it then (api._ACCEPTS)."""
    if bool((shift_labels == ignore_index).any()):
        raise ValueError(
            f"num_items_in_batch was passed with labels that hold ignore_index={ignore_index} tokens. transformers' "
            f"Trainer counts num_items_in_batch as labels != {TRAINER_IGNORE_INDEX}, so it would count these "
            f"ignored tokens and the loss would come out too small. Create the Trainer after apply_patch (the "
            f"patched model then asks it for no count, and each batch averages its own tokens), or mark ignored "
            f"labels with {TRAINER_IGNORE_INDEX}.")


def _adapter_groups(names, hidden):
    """(adapter name, row indices) of a PEFT mixed-adapter batch, in order of first appearance.

    The groups are computed inside *one* ``call_through``, as the unpatched head is called once: a
    sharded head (ZeRO-3, an FSDP2 unit) gathers its weight in each call, a collective, so one call
    per group would have a rank whose rows hold another set of adapters (or none of "__base__") call
    it a different number of times than its peers, and hang."""
    if len(names) != hidden.shape[0]:
        raise ValueError(f"adapter_names has {len(names)} entries for a batch of {hidden.shape[0]} rows")
    for name in dict.fromkeys(names):
        yield name, torch.tensor([i for i, n in enumerate(names) if n == name], device=hidden.device)


def _logits(model, state, hidden):
    """Logits exactly as the unpatched model ("ce"), or the mixture's log-probs ("mhce")."""
    cfg = state.config
    multiply, divide, softcap = logit_transform(model, state.facts)
    head = model.get_output_embeddings()
    if cfg.loss == "mhce":
        scale = (multiply or 1.0) / (divide or 1.0)

        def mixture(hidden, adapter=None):
            x, w, b, low_rank = fused_operands(resolve_head(head, adapter, hidden), hidden, cfg.num_heads, scale)
            return multi_head_logprobs(x, w, cfg.num_heads, bias=b, softcap=softcap, low_rank=low_rank)

        names = mixed_batch_adapters(head)
        if names is None:
            return call_through(head, mixture, hidden)
        groups = list(_adapter_groups(names, hidden))

        def mixtures(hidden):  # every group in one call of the head (see _adapter_groups)
            out = None
            for name, rows in groups:
                part = mixture(hidden[rows], adapter=name)
                out = part.new_empty(*hidden.shape[:-1], part.shape[-1]) if out is None else out
                out[rows] = part
            return out

        return call_through(head, mixtures, hidden)
    logits = head(hidden)  # the module itself: every PEFT wrapper (mixed-adapter batches too) behaves as in the original
    if state.facts.float32_logits or (softcap is not None and state.facts.float32_softcap):
        logits = logits.float()  # as the family's forward: its soft-cap runs in float32, its logits are float32
    if multiply is not None:
        logits = logits * multiply
    if divide is not None:
        logits = logits / divide
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits
