"""The patched forward after apply_patch: accelerate hooks added or removed later move it between
``forward`` and ``_old_forward`` (unpatch, copies and is_patched follow it), and a forward replaced
by another library (Liger's instance patch, as a Trainer with use_liger_kernel=True applies it) is an
error at the next call instead of a silent change of loss."""

import copy
import types

import pytest
import torch
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from patching_models import batch, make_model

import hf_mhce
from hf_mhce.patching import PatchBypassedError, is_patched


class CountingHook(ModelHook):
    def __init__(self):
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        return args, kwargs


def is_mixture(model, ids):
    with torch.no_grad():
        return torch.allclose(model(input_ids=ids).logits.exp().sum(-1), torch.ones(ids.shape), atol=1e-5)


def unpatched_logits(ids):
    with torch.no_grad():
        return make_model("llama")(input_ids=ids).logits


def test_hook_removed_after_patching():
    """PEFT's from_pretrained removes accelerate's hooks of offloaded models: the forward moves to
    ``forward``; unpatch restored the wrong attribute and every later forward raised a KeyError, and a
    deepcopy ran the class's forward while is_patched said True."""
    ids, _ = batch()
    model = make_model("llama")
    add_hook_to_module(model, CountingHook())
    hf_mhce.apply_patch(model, loss="mhce", num_heads=2)
    remove_hook_from_module(model)
    assert is_mixture(model, ids) and is_patched(model)
    twin = copy.deepcopy(model)
    assert is_patched(twin) and is_mixture(twin, ids)
    hf_mhce.unpatch(model)
    assert not is_patched(model) and "forward" not in model.__dict__ and "_old_forward" not in model.__dict__
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, unpatched_logits(ids))


def test_hook_added_after_patching():
    """dispatch_model / cpu_offload after apply_patch: the hook wraps the patched forward; copies keep the
    hook running around it, and unpatch leaves the hook in place around the class's forward."""
    ids, _ = batch()
    model = hf_mhce.apply_patch(make_model("llama"), loss="mhce", num_heads=2)
    hook = CountingHook()
    add_hook_to_module(model, hook)
    assert is_patched(model) and is_mixture(model, ids) and hook.calls == 1
    twin = copy.deepcopy(model)
    assert is_mixture(twin, ids) and twin._hf_hook.calls == 2  # the copy's own hook ran (copied count 1)
    hf_mhce.unpatch(model)
    assert not is_patched(model)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, unpatched_logits(ids))
    assert hook.calls == 2  # still running: unpatch did not drop accelerate's wrapper


def _replace_forward_like_liger(model):
    """What liger_kernel's apply_liger_kernel_to_llama(model=...) does with fused_linear_cross_entropy."""
    def lce_forward(self, *args, **kwargs):
        return type(self).forward(self, *args, **kwargs)

    model.forward = types.MethodType(lce_forward, model)


@pytest.mark.parametrize("peft", [False, True])
def test_forward_replaced_by_another_library_is_an_error(peft):
    ids, labels = batch()
    model = hf_mhce.apply_patch(make_model("llama"), loss="mhce", num_heads=2)
    outer = model
    if peft:
        from peft import LoraConfig, get_peft_model

        outer = hf_mhce.apply_patch(get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])))
    _replace_forward_like_liger(model)
    assert not is_patched(outer)
    with pytest.raises(PatchBypassedError, match=r"replaced after hf_mhce.apply_patch by .*lce_forward.*'mhce' loss"
                                                 r".*fused_linear_cross_entropy': False"):
        outer(input_ids=ids, labels=labels)
    hf_mhce.apply_patch(outer)  # asked again: hf_mhce's forward is put back
    assert is_patched(outer) and is_mixture(outer, ids)
    hf_mhce.unpatch(outer)  # and unpatch removes the guard with the rest
    _replace_forward_like_liger(model)
    outer(input_ids=ids, labels=labels)
