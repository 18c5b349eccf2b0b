"""The LM head as one linear map the fused ops can take, PEFT wrappers included.

The ops read ``weight`` as a tensor, so a module wrapper around the head would be bypassed
silently (the peer bug: LoRA on lm_head ignored).  Here the head module is resolved into its base
weight/bias plus the active LoRA adapters, and LoRA enters *exactly*:

    W x + s B A drop(x) = W x + (s B) u,   u = A drop(x)  (rank R)

For MHCE the hidden state is cut into H slices and head h uses only W_h x_h, so u is formed per
head, u_h = A_h drop(x)_h, and head h's logits are W_h x_h + s B u_h: the logits of its slice of the
effective weight W + sBA.  (u, sB) reach the fused ops as their ``low_rank`` term, for the loss and
for the mixture logits alike: no copy of W, no dW for a frozen W.  The gradient reaches W, A and B
through autograd, H = 1 is plain LoRA, and LoRA dropout is applied exactly once to the head input,
as PEFT does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .sharding import check_gathered, owns_sharded_params, unwrapped

try:  # peft is a dependency, but the head logic must not fail where it is absent
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper
except ImportError:  # pragma: no cover
    LoraLayer = BaseTunerLayer = AuxiliaryTrainingWrapper = ModulesToSaveWrapper = ()
try:  # apart: a PEFT without trainable tokens must keep the LoRA support above
    from peft.utils.other import TrainableTokensWrapper
except ImportError:  # pragma: no cover
    TrainableTokensWrapper = ()


class UnsupportedHeadError(TypeError):
    """The LM head is a module type whose linear map cannot be handed to the fused ops."""


@dataclass
class Adapter:
    """One active LoRA adapter on the head: adds scaling * B(A(dropout(x)))."""

    lora_a: nn.Linear  # or a Factor (trainable tokens)
    lora_b: nn.Linear  # or a Factor
    dropout: nn.Module
    scaling: float


@dataclass
class Factor:
    """A low-rank factor given as a tensor: what ``_lora_terms`` reads of a LoRA ``nn.Linear``."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None


@dataclass
class HeadParts:
    weight: torch.Tensor  # [V, D]
    bias: torch.Tensor | None  # [V]
    adapters: list[Adapter] = field(default_factory=list)
    float32: bool = False  # TRL's cast_lm_head_to_fp32 forward: F.linear on float32 operands (``_instance_forward``)


def resolve_head(head: nn.Module, adapter: str | None = None, hidden: torch.Tensor | None = None) -> HeadParts:
    """Base weight, bias and active LoRA adapters of the head module, following PEFT's forward;
    ``adapter`` (a name from ``mixed_batch_adapters``) stands in for the active adapters (a name the
    head does not carry, such as PEFT's "__base__", leaves the base layer alone).  Given the head's
    input ``hidden``, the head's own forward pre-hooks run first (see ``run_head_hooks``)."""
    run_head_hooks(head, hidden)
    return _resolve(head, adapter)


def _resolve(head: nn.Module, adapter: str | None = None) -> HeadParts:
    head = unwrapped(head)  # FSDP1's wrapper: read inside its call (sharding.py), as the module it holds
    replaced = _instance_forward(head)
    if replaced is not None:
        if not (_is_trl_fp32_forward(replaced) and type(head) is nn.Linear):
            raise UnsupportedHeadError(
                f"the LM head's forward was replaced on the instance by {_name(replaced)}; the fused loss reads the "
                "head's weight and bias and never calls it, so that forward would be skipped. Remove it (del "
                "lm_head.forward), or hf_mhce.unpatch(model)"
            )
        return HeadParts(head.weight, head.bias, float32=True)
    if ModulesToSaveWrapper and isinstance(head, ModulesToSaveWrapper):
        # PEFT trains a copy; the original is used only while adapters are disabled.
        active = head.active_adapters if adapter is None else [adapter]
        if head.disable_adapters or not active or active[0] not in head.modules_to_save:
            return _resolve(head.original_module)
        return _resolve(head.modules_to_save[active[0]])
    if LoraLayer and isinstance(head, LoraLayer) and hasattr(head, "lora_A"):
        if not all(isinstance(unwrapped(m), nn.Linear) for m in head.lora_A.values()):  # e.g. AdaLoRA's SVD factors
            raise UnsupportedHeadError(
                f"the LM head is wrapped by {type(head).__module__}.{type(head).__qualname__}, a LoRA layer whose "
                "factors are not nn.Linear modules (AdaLoRA and the like); the fused loss folds in plain LoRA only"
            )
        return _resolve_lora(head, adapter)
    if TrainableTokensWrapper and isinstance(head, TrainableTokensWrapper):
        return _resolve_tokens(head.token_adapter, adapter)
    if BaseTunerLayer and isinstance(head, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
        raise UnsupportedHeadError(
            f"the LM head is wrapped by {type(head).__module__}.{type(head).__qualname__}; with the fused loss "
            "only LoRA (without variants such as DoRA) and modules_to_save are supported on the head"
        )
    if isinstance(head, nn.Linear):
        if type(head).forward is not nn.Linear.forward:
            raise UnsupportedHeadError(
                f"the LM head is a {type(head).__module__}.{type(head).__qualname__}, an nn.Linear subclass with a "
                "forward of its own; the fused loss reads the head's weight and bias and never calls it, so that "
                "forward would be skipped"
            )
        return HeadParts(head.weight, head.bias)
    raise UnsupportedHeadError(
        f"the LM head is a {type(head).__name__}, not an nn.Linear (or a PEFT LoRA / modules_to_save "
        "wrapper around one)"
    )


def _resolve_lora(layer, adapter: str | None = None) -> HeadParts:
    if layer.disable_adapters and layer.merged:
        layer.unmerge()  # what PEFT's forward does before running the base layer alone
    parts = _resolve(layer.base_layer, adapter)
    if layer.disable_adapters or layer.merged:
        return parts
    if parts.float32:  # TRL refuses it too: the adapters' dtype would be ambiguous
        raise UnsupportedHeadError("TRL's cast_lm_head_to_fp32 with LoRA adapters on the LM head is not supported")
    if getattr(layer, "fan_in_fan_out", False):
        raise UnsupportedHeadError("LoRA with fan_in_fan_out=True (Conv1D heads) is not supported on the LM head")
    adapters = list(parts.adapters)
    for name in layer.active_adapters if adapter is None else [adapter]:
        if name not in layer.lora_A:
            continue
        if name in getattr(layer, "lora_variant", {}):
            variant = type(layer.lora_variant[name]).__name__
            raise UnsupportedHeadError(
                f"LoRA adapter {name!r} on the LM head uses the variant {variant} (e.g. DoRA); the fused loss "
                "folds in plain LoRA only. Merge the adapter, or leave lm_head out of target_modules"
            )
        adapters.append(Adapter(unwrapped(layer.lora_A[name]), unwrapped(layer.lora_B[name]), layer.lora_dropout[name],
                                layer.scaling[name]))
    return HeadParts(parts.weight, parts.bias, adapters)


def _resolve_tokens(layer, adapter: str | None = None) -> HeadParts:
    """PEFT's trainable tokens on a head tied to the embedding (``trainable_token_indices``): the rows
    T of W are replaced by trained ones d, i.e. W' = W + onehot(T) (d - W[T]), a rank-|T| term beside
    W (U = (d - W[T]) x, B = onehot(T)), so no [V, D] copy.  Follows PEFT's forward_adapters, except that a
    head bias is kept (PEFT's tied path calls F.linear without it; no tied head of transformers has one)."""
    active = layer.active_adapters if adapter is None else [adapter]
    active = [name for name in active if name in layer.token_indices]  # "__base__" of a mixed batch: none
    if layer.disable_adapters or not active:
        if layer.merged:
            layer.unmerge()
        return _resolve(layer.base_layer)
    parts = _resolve(layer.base_layer)
    if layer.merged:
        return parts
    if parts.float32:
        raise UnsupportedHeadError("TRL's cast_lm_head_to_fp32 with trainable tokens on the LM head is not supported")
    getattr(layer, "_check_overlapping_tokens", lambda _: None)(active)  # PEFT's error for adapters sharing a token
    adapters = list(parts.adapters)
    w = parts.weight
    for name in active:
        index = torch.tensor(layer.token_indices[name], device=w.device)
        rows = layer.trainable_tokens_delta[name].to(w) - w[index]  # [k, D]
        onehot = torch.zeros(w.shape[0], index.numel(), dtype=w.dtype, device=w.device)
        onehot[index, torch.arange(index.numel(), device=w.device)] = 1
        adapters.append(Adapter(Factor(rows), Factor(onehot), nn.Identity(), 1.0))
    return HeadParts(parts.weight, parts.bias, adapters)


# Hooks of frameworks whose own mechanics the fused path already follows: parameter gathering around
# the call of modules that own sharded parameters (sharding.call_through), accelerate's device hooks.
_FRAMEWORK_HOOKS = ("deepspeed.", "torch.distributed.", "accelerate.")


def run_head_hooks(head: nn.Module, hidden: torch.Tensor | None) -> None:
    """The fused ops read the head's parameters and never call the head, so its hooks would not run.

    A forward pre-hook that recomputes a parameter (``torch.nn.utils.prune``, the old
    ``weight_norm`` and ``spectral_norm``) is run here on ``(hidden,)``, as the head's call would
    run it (with ``hidden`` None, at patch time, none is run).  A hook that sees the head's output,
    or a pre-hook that changes its input, cannot be honoured without the logits: UnsupportedHeadError.
    """
    for name, module in head.named_modules():
        if owns_sharded_params(module):
            continue  # called through (sharding.py): its hooks run around our loss
        where = f"the LM head{f' (its submodule {name!r})' if name else ''}"
        post = [h for h in module._forward_hooks.values() if not _framework_hook(h)]
        post += [*module._backward_hooks.values(), *module._backward_pre_hooks.values(), *_accelerate_hooks(module)]
        if post:
            raise UnsupportedHeadError(
                f"{where} has hooks {post} around its output or its gradient: the fused loss never builds the "
                "head's output (the logits), so they could not see it. Remove them (torch.nn.utils.parametrize "
                "works for reparametrized weights), or hf_mhce.unpatch(model)"
            )
        for hook_id, hook in list(module._forward_pre_hooks.items()):
            if hidden is None or _framework_hook(hook) or _adapter_names(hook) is not None:
                continue
            if hook_id in module._forward_pre_hooks_with_kwargs:
                out = hook(module, (hidden,), {})
                changed = out is not None and (out[1] or len(out[0]) != 1 or out[0][0] is not hidden)
            else:
                out = hook(module, (hidden,))
                out = out if out is None or isinstance(out, tuple) else (out,)
                changed = out is not None and (len(out) != 1 or out[0] is not hidden)
            if changed:
                raise UnsupportedHeadError(
                    f"{where} has a forward pre-hook {hook!r} that changes the head's input; the fused loss "
                    "feeds the hidden state to the head's weight directly. Remove it, or hf_mhce.unpatch(model)"
                )


def _accelerate_hooks(module: nn.Module) -> list:
    """accelerate ModelHooks on the module (``add_hook_to_module``: they replace its forward) that change
    its inputs or output; its device and offload hooks are followed (sharding.py) and pass."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    from accelerate.hooks import AlignDevicesHook, CpuOffload, ModelHook

    hooks = getattr(hook, "hooks", None) or [hook]  # a SequentialHook holds several
    return [h for h in hooks if not isinstance(h, (AlignDevicesHook, CpuOffload))
            and (type(h).pre_forward is not ModelHook.pre_forward or type(h).post_forward is not ModelHook.post_forward)]


def _instance_forward(head: nn.Module):
    """A forward put on the head instance in place of its class's (TRL's ``cast_lm_head_to_fp32`` does
    this), looking through accelerate's hook (which calls what it replaced, ``_old_forward``) and
    sharding.call_through's own (which records what it replaced); None if there is none."""
    forward = head.__dict__.get("forward")
    if forward is not None and _framework_hook(forward) and hasattr(head, "_hf_hook"):
        forward = head.__dict__.get("_old_forward")
    while forward is not None and hasattr(forward, "hf_mhce_replaced"):
        forward = forward.hf_mhce_replaced
    if forward is None or getattr(forward, "__func__", None) is type(head).forward:
        return None
    return forward


def _is_trl_fp32_forward(fn) -> bool:
    """TRL's ``cast_forward_to_fp32`` (GRPO's cast_lm_head_to_fp32): ``F.linear`` on float32 operands."""
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_name == "cast_forward_to_fp32" and (fn.__module__ or "").startswith("trl.")


def _name(fn) -> str:
    fn = getattr(fn, "func", fn)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _framework_hook(hook) -> bool:
    fn = getattr(hook, "func", hook)  # functools.partial
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return module.startswith(_FRAMEWORK_HOOKS)


def _adapter_names(hook):
    return getattr(hook, "keywords", {}).get("adapter_names")  # PEFT's functools.partial(..., adapter_names=)


def mixed_batch_adapters(head: nn.Module) -> list[str] | None:
    """The per-row adapter names of a PEFT mixed-adapter batch (``model(..., adapter_names=[...])``),
    or None.  PEFT hands them to its layers in a forward pre-hook, which the fused ops, reading the
    weights instead of calling the head, would bypass: the caller must split the batch by them."""
    for module in head.modules():
        for hook in module._forward_pre_hooks.values():
            names = _adapter_names(hook)
            if names is not None:
                return list(names)
    return None


def fused_operands(parts: HeadParts, hidden: torch.Tensor, num_heads: int, scale: float | None = None):
    """(hidden', weight, bias', low_rank) for the fused ops: scale * head(hidden) per head h is
    hidden'_h weight_h^T + U_h B^T + bias', with ``low_rank`` = (U [..., H, R], B [V, R]) holding
    every active LoRA adapter (None without one).  The base weight is passed as is, so a frozen
    one gets no dW and is never copied."""
    check_parts(parts, hidden.shape[-1])
    weight, bias = parts.weight, parts.bias
    low_rank = None
    if parts.adapters:
        low_rank, extra_bias = _lora_terms(parts, hidden, num_heads)
        if extra_bias is not None:
            bias = extra_bias if bias is None else bias + extra_bias
    if parts.float32:  # as TRL's instance forward: F.linear(x.float(), W.float(), b.float()), under any autocast
        hidden, weight = hidden.float(), weight.float()
    if bias is not None:
        bias = bias.to(weight.dtype)
    if scale is not None and scale != 1.0:
        # s * (W x + b) = W (s x) + s b: scaling the [N, D] side avoids a [V, D] copy.
        hidden = hidden * scale
        bias = bias * scale if bias is not None else None
        if low_rank is not None:
            low_rank = (low_rank[0] * scale, low_rank[1])
    return hidden, weight, bias, low_rank


def check_parts(parts: HeadParts, hidden_size: int) -> None:
    """Every tensor of the head gathered and of the shape the hidden state needs (see sharding.py)."""
    check_gathered("weight", parts.weight)  # a DTensor, meta or empty: sharding or offloading not undone
    if parts.weight.dim() != 2 or parts.weight.shape[1] != hidden_size:
        raise ValueError(
            f"the LM head's weight has shape {tuple(parts.weight.shape)}, but the hidden states it is applied to "
            f"have size {hidden_size}: the head must be a [vocab_size, {hidden_size}] linear map"
        )
    vocab = parts.weight.shape[0]
    check_gathered("bias", parts.bias, (vocab,) if vocab else None)
    for i, ad in enumerate(parts.adapters):
        rank = ad.lora_a.weight.shape[0] if ad.lora_a.weight.dim() == 2 else None
        check_gathered(f"LoRA A[{i}] weight", ad.lora_a.weight, (rank, hidden_size) if rank else None)
        check_gathered(f"LoRA B[{i}] weight", ad.lora_b.weight, (vocab, rank) if rank and vocab else None)


def _lora_terms(parts: HeadParts, hidden: torch.Tensor, num_heads: int):
    """((U [..., H, R], B [V, R]), extra bias) of the adapters, R the sum of their ranks:
    U_h = A[:, slice h] drop(x)_h and B = scaling * lora_B, so that U_h B^T is slice h's share of
    scaling * B A drop(x).  U in hidden's dtype, B in the weight's."""
    d = parts.weight.shape[1]
    dh = d // num_heads
    us, bs, bias = [], [], None
    for ad in parts.adapters:
        a = ad.lora_a.weight  # [r, D]
        x = ad.dropout(hidden.to(a.dtype))
        if num_heads == 1:
            u = F.linear(x, a).unsqueeze(-2)
        else:  # u[..., h, :] = A[:, slice h] x[slice h]
            u = torch.einsum("...hd,rhd->...hr", x.unflatten(-1, (num_heads, dh)), a.unflatten(-1, (num_heads, dh)))
        us.append(u.to(hidden.dtype))
        bs.append((ad.lora_b.weight * ad.scaling).to(parts.weight.dtype))  # [V, r]
        if ad.lora_b.bias is not None:
            extra = (ad.lora_b.bias * ad.scaling).to(parts.weight.dtype)
            bias = extra if bias is None else bias + extra
    return (torch.cat(us, dim=-1), torch.cat(bs, dim=-1)), bias


def head_rng_state(model, hidden):
    """The generator states before the loss, to replay for the logits: unpatched, one head call gives
    both, so LoRA dropout on the head draws one mask; here the loss and the logits read the head apart.
    CUDA: the devices of the hidden state and the head only (nn.DataParallel's replicas run in threads)."""
    head = model.get_output_embeddings()
    devices = {t.device for t in (hidden, *(head.parameters() if head is not None else ())) if t.device.type == "cuda"}
    return torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in devices}


def restore_rng_state(rng) -> None:
    torch.set_rng_state(rng[0])
    for device, state in rng[1].items():
        torch.cuda.set_rng_state(state, device)
