"""The verification probe (probe.py) on forwards the family table does not vouch for: subclass
overrides (also behind a functools.wraps decorator), a forward replaced on the instance, options of
the forward's own, and the ways a forward can differ that a single labelled call would not show."""

from __future__ import annotations

import functools
import types
import warnings

import pytest
import torch
from patching_models import batch, make_model, twin
from transformers import LlamaForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast

import hf_mhce
from hf_mhce.patching.api import is_patched
from hf_mhce.patching.families import UnsupportedModelError

FOREIGN = "defined outside transformers"
pytestmark = pytest.mark.filterwarnings(f"ignore:hf_mhce.*{FOREIGN}:UserWarning",
                                        "ignore:hf_mhce.*instance's forward:UserWarning")


def build(cls, seed=0, dtype=None):
    config = make_model("llama").config
    torch.manual_seed(seed)
    model = cls(config)
    return model.to(dtype) if dtype else model


def assert_same(ref, model, **kwargs):
    ids, labels = batch()
    with torch.no_grad():
        a, b = ref(input_ids=ids, labels=labels, **kwargs), model(input_ids=ids, labels=labels, **kwargs)
        torch.testing.assert_close(b.loss, a.loss)
        torch.testing.assert_close(model(input_ids=ids, **kwargs).logits, ref(input_ids=ids, **kwargs).logits)


def halve_logits(forward):
    @functools.wraps(forward)  # copies __module__: the function looks like transformers' own
    def wrapper(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits = out.logits * 0.5
        return out
    return wrapper


class Decorated(LlamaForCausalLM):
    forward = halve_logits(LlamaForCausalLM.forward)


class Same(LlamaForCausalLM):
    def forward(self, *args, **kwargs) -> CausalLMOutputWithPast:
        return super().forward(*args, **kwargs)


def test_decorated_forward_is_probed_not_trusted():
    with pytest.raises(UnsupportedModelError, match=f"Decorated.forward is {FOREIGN}.*logits differ"):
        hf_mhce.apply_patch(build(Decorated))


def test_identical_subclass_is_patched_with_a_warning_saying_what_the_check_cannot_see():
    ref = build(Same)
    with pytest.warns(UserWarning, match=f"Same.forward is {FOREIGN}.*only in training, on longer inputs or later"):
        model = hf_mhce.apply_patch(twin(ref))
    assert_same(ref, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_mhce.apply_patch(make_model("llama"))  # transformers' own forward: no warning


def test_forward_replaced_on_the_instance_is_probed():
    def temperature(self, *args, **kwargs):
        out = LlamaForCausalLM.forward(self, *args, **kwargs)
        out.logits = out.logits / 2
        return out

    model = make_model("llama")
    model.forward = types.MethodType(temperature, model)
    with pytest.raises(UnsupportedModelError, match="instance's forward was replaced by 'test_forward_replaced.*temperature'"):
        hf_mhce.apply_patch(model)
    passthrough = make_model("llama")
    passthrough.forward = types.MethodType(lambda self, **kw: LlamaForCausalLM.forward(self, **kw), passthrough)
    with pytest.warns(UserWarning, match="instance's forward was replaced"):
        hf_mhce.apply_patch(passthrough)
    assert_same(make_model("llama"), passthrough)
    hf_mhce.unpatch(passthrough)
    assert passthrough.forward.__func__.__name__ == "<lambda>"


class DoubledLoss(LlamaForCausalLM):
    @property
    def loss_function(self):
        return lambda *args, **kwargs: 2 * ForCausalLMLoss(*args, **kwargs)


def test_loss_function_property_of_a_subclass_is_refused():
    with pytest.raises(UnsupportedModelError, match="DoubledLoss.loss_function is .*not transformers' ForCausalLMLoss"):
        hf_mhce.apply_patch(build(DoubledLoss))


class Temperature(LlamaForCausalLM):
    """An option of the subclass's own: identity at its default, which is all the probe sees."""

    def forward(self, input_ids=None, labels=None, temperature: float = 1.0, **kwargs) -> CausalLMOutputWithPast:
        out = super().forward(input_ids=input_ids, **kwargs)
        out.logits = out.logits / temperature
        if labels is not None:
            out.loss = self.loss_function(out.logits, labels, self.config.vocab_size, **kwargs)
        return out


def test_an_option_of_the_replaced_forward_is_refused_unless_at_its_default():
    ref = build(Temperature)
    model = hf_mhce.apply_patch(twin(ref))
    assert_same(ref, model)
    assert_same(ref, model, temperature=1.0)
    ids, labels = batch()
    with pytest.raises(TypeError, match="'temperature' is an option of the forward hf_mhce replaced.*default 1.0"):
        model(input_ids=ids, labels=labels, temperature=2.0)


class IgnoresItemCount(LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, **kwargs) -> CausalLMOutputWithPast:
        kwargs.pop("num_items_in_batch", None)  # a mean over this batch, whatever the Trainer counted
        return super().forward(input_ids=input_ids, labels=labels, **kwargs)


class NoGrad(LlamaForCausalLM):
    @torch.no_grad()
    def forward(self, *args, **kwargs) -> CausalLMOutputWithPast:
        return super().forward(*args, **kwargs)


class InferenceTemperature(LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, **kwargs) -> CausalLMOutputWithPast:
        out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
        if labels is None:
            out.logits = out.logits / 2
        return out


class RowMean(LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, **kwargs) -> CausalLMOutputWithPast:
        out = super().forward(input_ids=input_ids, **kwargs)
        if labels is not None:  # the mean of each row's mean: differs once rows count different targets
            out.loss = torch.stack([self.loss_function(out.logits[i:i + 1], labels[i:i + 1], self.config.vocab_size)
                                    for i in range(len(labels))]).mean()
        return out


@pytest.mark.parametrize("cls, why", [
    (IgnoresItemCount, "given num_items_in_batch, its loss differs"),
    (NoGrad, "its loss does not require grad"),
    (InferenceTemperature, "without labels, its logits differ"),
    (RowMean, "with labels, its loss differs"),
])
def test_differences_one_labelled_call_would_miss(cls, why):
    with pytest.raises(UnsupportedModelError, match=why):
        hf_mhce.apply_patch(build(cls))


class NoUseCache(LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, attention_mask=None) -> CausalLMOutputWithPast:
        return super().forward(input_ids=input_ids, labels=labels, attention_mask=attention_mask)


class RequiredOption(LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, *, scale, **kwargs) -> CausalLMOutputWithPast:
        return super().forward(input_ids=input_ids, labels=labels, **kwargs)


def test_the_check_passes_only_what_the_forward_takes_and_names_what_failed():
    ref = build(NoUseCache)
    assert_same(ref, hf_mhce.apply_patch(twin(ref)))  # use_cache is not passed to a forward without it
    with pytest.raises(UnsupportedModelError, match="the check's forward raised TypeError: .*scale"):
        hf_mhce.apply_patch(build(RequiredOption))


class Counting(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, *args, **kwargs) -> CausalLMOutputWithPast:
        self.calls += 1
        return super().forward(*args, **kwargs)


def test_the_check_leaves_buffers_and_mode_as_found():
    model = build(Counting)
    hf_mhce.apply_patch(model)
    assert int(model.calls) == 0 and model.training


def test_bf16_logits_of_trained_size_are_not_refused_for_their_rounding():
    """HF's loss comes from bf16-rounded logits, the fused one from float32 sums: not a mismatch."""
    ref = build(Same, dtype=torch.bfloat16)
    with torch.no_grad():
        ref.lm_head.weight.mul_(200)  # logits in the tens, as a trained model's
    hf_mhce.apply_patch(twin(ref))


class Scaled(LlamaForCausalLM):
    def forward(self, *args, **kwargs) -> CausalLMOutputWithPast:
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * self.config.extra_scale
        return out


def test_a_patch_that_no_longer_holds_is_undone_when_asked_again():
    model = build(Scaled)
    model.config.extra_scale = 1.0
    hf_mhce.apply_patch(model)
    model.config.extra_scale = 3.0  # the generic forward no longer reproduces it
    with pytest.raises(UnsupportedModelError, match="logits differ.*patched before and is unpatched now"):
        hf_mhce.apply_patch(model)
    assert not is_patched(model) and "hf_mhce" not in model.config.to_dict()
    ids, _ = batch()
    assert model(input_ids=ids).logits is not None  # the class's own forward again


class HandsOnCachePosition(LlamaForCausalLM):
    """Written for transformers 4.x: names cache_position and hands it on."""

    def forward(self, input_ids=None, labels=None, cache_position=None, **kwargs) -> CausalLMOutputWithPast:
        return super().forward(input_ids=input_ids, labels=labels, cache_position=cache_position, **kwargs)


def test_arguments_handed_on_are_not_refused_and_the_warning_comes_once():
    ref = build(HandsOnCachePosition)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = hf_mhce.apply_patch(twin(ref))
        hf_mhce.apply_patch(model, return_logits=False)  # updating options: no second warning
    assert len([w for w in caught if FOREIGN in str(w.message)]) == 1
    ids, labels = batch()
    assert model(input_ids=ids, labels=labels, cache_position=torch.arange(ids.shape[1])).loss.isfinite()


def test_a_partial_as_instance_forward_is_named_briefly():
    model = make_model("llama")
    model.forward = functools.partial(LlamaForCausalLM.forward, model)
    with pytest.warns(UserWarning, match="replaced by 'partial'") as caught:
        hf_mhce.apply_patch(model)
    assert all(len(str(w.message)) < 500 for w in caught)  # not the repr of the model the partial holds


def test_accelerate_mixed_precision_wrapper_keeps_its_autocast(fresh_accelerator_state):
    """A Trainer(bf16=True) wraps the forward in accelerate's autocast at its first evaluate: patching
    afterwards goes inside that wrapper (replacing it dropped autocast for the rest of the run)."""
    from accelerate import Accelerator

    ref, model = (Accelerator(mixed_precision="bf16", cpu=True).prepare(make_model("llama")) for _ in range(2))
    wrapper = model.forward
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # transformers' own forward inside: no probe warning
        hf_mhce.apply_patch(model)
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(torch.is_autocast_enabled("cpu")))
    ids, labels = batch()
    got, want = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert seen == [True] and got.loss.dtype == torch.float32
    torch.testing.assert_close(got.loss, want.loss, rtol=2e-2, atol=0)
    assert is_patched(model)
    hf_mhce.unpatch(model)
    assert model.forward == wrapper


def test_prepared_after_the_patch_keeps_its_autocast_through_repatch_and_unpatch(fresh_accelerator_state):
    """apply_patch, then Accelerator.prepare with bf16 (a Trainer's first train or evaluate): accelerate's
    wrapper holds the patched forward.  Calling apply_patch again (new options; README: TRL's peft_config) and
    unpatch each replaced that wrapper by a forward without autocast: the run went on in float32."""
    from accelerate import Accelerator

    def autocast_seen(model):
        seen = []
        handle = model.model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(torch.is_autocast_enabled("cpu")))
        with torch.no_grad():
            loss = model(input_ids=ids, labels=labels).loss
        handle.remove()
        return seen == [True], loss

    ids, labels = batch()
    unpatched = Accelerator(mixed_precision="bf16", cpu=True).prepare(make_model("llama"))
    for repatch in (False, True):
        model = Accelerator(mixed_precision="bf16", cpu=True).prepare(hf_mhce.apply_patch(make_model("llama")))
        assert autocast_seen(model)[0]
        if repatch:
            hf_mhce.apply_patch(model, z_loss=1e-4)
            assert is_patched(model) and autocast_seen(model)[0]
        hf_mhce.unpatch(model)
        on, loss = autocast_seen(model)
        assert on and not is_patched(model)
        assert loss.dtype == torch.float32 and torch.equal(loss, autocast_seen(unpatched)[1])  # as never patched
        assert model._original_forward.__func__ is type(model).forward  # what accelerate unwraps to


def test_a_soft_cap_the_table_does_not_know_is_refused(monkeypatch):
    """A fresh model's logits are small, where c * tanh(z / c) is z to the probe's tolerance: the probe
    also compares them scaled to |logit| ~ 50, so a soft-capping family outside the table is refused
    instead of patched without its cap (gemma3n_text, beam and PaliGemma 2 were, before the table had them)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from hf_mhce.patching import families

    monkeypatch.delitem(families.FAMILIES, "gemma2")
    torch.manual_seed(0)
    capped = Gemma2ForCausalLM(Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                            final_logit_softcapping=30.0))
    with pytest.raises(UnsupportedModelError, match=r"with large logits .*soft-cap.*logits differ"):
        hf_mhce.apply_patch(capped)
    capped.config.final_logit_softcapping = None  # no cap: the generic forward is exact
    assert is_patched(hf_mhce.apply_patch(capped))


def test_the_check_runs_inside_inference_mode():
    """The probe needs a graph: under a caller's inference_mode it ran on inference tensors and
    refused a faithful override ("cannot be saved for backward"); a re-check there unpatched an MHCE model."""
    ref, model = build(LlamaForCausalLM), build(Same)
    with torch.inference_mode():
        hf_mhce.apply_patch(model, loss="mhce", num_heads=2)
        hf_mhce.apply_patch(model, return_logits=False)  # asked again: checked again, kept
    assert is_patched(model) and model.config.hf_mhce["loss"] == "mhce"
    hf_mhce.unpatch(model)
    with torch.inference_mode():
        hf_mhce.apply_patch(model)
    assert_same(ref, model)


def test_a_forward_replaced_on_transformers_class_is_probed(monkeypatch):
    """A wrapper put on LlamaForCausalLM itself (functools.wraps copies the name and module of transformers'
    forward) was taken for transformers' own: patched unchecked, with a loss the model no longer computes."""
    monkeypatch.setattr(LlamaForCausalLM, "forward", halve_logits(LlamaForCausalLM.forward))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM.forward is not transformers' own: the class's "
                       "forward was replaced by halve_logits.<locals>.wrapper in .*test_probe.py.*logits differ"):
        hf_mhce.apply_patch(build(LlamaForCausalLM))
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_mhce.apply_patch(build(LlamaForCausalLM))  # transformers' own again: no check, no warning
