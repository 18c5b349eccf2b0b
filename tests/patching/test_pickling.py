"""A patched model survives torch.save / pickle / copy: the copy is patched the same way, on itself."""

import copy
import io
import json
import pickle

import pytest
import torch
from patching_models import FAMILIES, batch, make_model, with_lora
from peft import LoraConfig

from hf_mhce.patching import add_card_section, apply_patch, is_patched, unpatch


def _torch_roundtrip(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


ROUNDTRIPS = {
    "torch.save": _torch_roundtrip,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "pickle-protocol-0": lambda m: pickle.loads(pickle.dumps(m, protocol=0)),
    "deepcopy": copy.deepcopy,
}


def _outputs(model, ids, labels):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, labels=labels).loss, model(input_ids=ids).logits


@pytest.mark.parametrize("how", list(ROUNDTRIPS))
@pytest.mark.parametrize("family,loss,heads", [(f, "mhce", 4) for f in FAMILIES] + [("llama", "ce", 1)])
def test_roundtrip_keeps_the_patch(how, family, loss, heads):
    model = apply_patch(make_model(family), loss=loss, num_heads=heads, label_smoothing=0.1)
    ids, labels = batch()
    want_loss, want_logits = _outputs(model, ids, labels)

    clone = ROUNDTRIPS[how](model)
    assert is_patched(clone) and clone.config.hf_mhce == model.config.hf_mhce
    assert clone.forward.__self__ is clone  # bound to the copy, not to the original
    assert clone.save_pretrained.__self__ is clone
    got_loss, got_logits = _outputs(clone, ids, labels)
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0)

    with torch.no_grad():  # the copy owns its weights: changing them leaves the original alone
        clone.get_output_embeddings().weight.mul_(2)
    torch.testing.assert_close(_outputs(model, ids, labels)[1], want_logits, rtol=0, atol=0)

    original_class_logits = type(clone).forward(clone, input_ids=ids).logits  # unpatch works on the copy
    unpatch(clone)
    assert "forward" not in clone.__dict__ and not hasattr(clone.config, "hf_mhce")
    torch.testing.assert_close(clone(input_ids=ids).logits, original_class_logits)


def test_copies_of_copies_and_shallow_copy():
    model = apply_patch(make_model("llama"), loss="mhce", num_heads=2)
    ids, labels = batch()
    want = _outputs(model, ids, labels)[0]
    twice = _torch_roundtrip(copy.deepcopy(_torch_roundtrip(model)))
    assert twice.forward.__self__ is twice
    torch.testing.assert_close(_outputs(twice, ids, labels)[0], want, rtol=0, atol=0)
    shallow = copy.copy(model)
    assert shallow.forward.__self__ is shallow and is_patched(shallow)
    # the pickled state carries no hf_mhce bound method: they are rebuilt on load
    state = model.__reduce_ex__(4)[2]
    assert not any(isinstance(v, type(model.forward)) for v in state.values())


def test_card_sections_are_not_pickled_but_the_card_is_still_written(tmp_path):
    model = apply_patch(make_model("gpt2"), loss="mhce", num_heads=2)
    add_card_section(model, "Live section", lambda directory: "from a closure, which pickle cannot save")
    clone = _torch_roundtrip(model)
    clone.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "hf_mhce" in card and "from a closure" not in card
    assert json.loads((tmp_path / "config.json").read_text())["hf_mhce"]["num_heads"] == 2


def test_a_peft_model_with_lora_on_the_head_roundtrips(tmp_path):
    base = make_model("llama")
    peft_model = with_lora(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]), seed=None)
    apply_patch(peft_model, loss="mhce", num_heads=4)
    ids, labels = batch()
    want_loss, want_logits = _outputs(peft_model, ids, labels)

    clone = _torch_roundtrip(peft_model)
    assert is_patched(clone) and clone.save_pretrained.__self__ is clone
    got_loss, got_logits = _outputs(clone, ids, labels)
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0)
    clone.save_pretrained(tmp_path)  # the PeftModel's own save still writes the loss config beside the adapter
    assert json.loads((tmp_path / "hf_mhce.json").read_text())["num_heads"] == 4


def test_accelerate_autocast_wraps_and_unwraps_our_forward(fresh_accelerator_state):
    """accelerate rewraps ``forward.__func__`` for mixed precision and rebinds it on unwrap."""
    from accelerate import Accelerator

    model = apply_patch(make_model("llama"), loss="mhce", num_heads=4)
    ids, labels = batch()
    want = model(input_ids=ids, labels=labels).loss
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    wrapped = accelerator.prepare(model)
    with_autocast = wrapped(input_ids=ids, labels=labels).loss
    assert with_autocast.dtype == torch.float32 and with_autocast != want  # bf16 decoder, fused loss
    torch.testing.assert_close(with_autocast, want, rtol=2e-2, atol=0)

    plain = accelerator.unwrap_model(wrapped, keep_fp32_wrapper=False)
    assert getattr(plain.forward.__func__, "hf_mhce_patched", False) and plain.forward.__self__ is plain
    torch.testing.assert_close(plain(input_ids=ids, labels=labels).loss, want, rtol=0, atol=0)
    clone = pickle.loads(pickle.dumps(plain))
    torch.testing.assert_close(clone(input_ids=ids, labels=labels).loss, want, rtol=0, atol=0)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_a_model_prepared_after_the_patch_keeps_the_autocast(how, fresh_accelerator_state):
    """Patch, then Accelerator.prepare(mixed_precision="bf16") (a Trainer with bf16=True), then a copy (EMA, a
    reference model): the copy's forward was the bare patched one, so it ran in float32, silently."""
    from accelerate import Accelerator

    model = apply_patch(make_model("llama").float(), loss="mhce", num_heads=4)
    ids, labels = batch()
    prepared = Accelerator(mixed_precision="bf16", cpu=True).prepare(model)
    want = prepared(input_ids=ids, labels=labels).loss
    fp32 = apply_patch(make_model("llama").float(), loss="mhce", num_heads=4)(input_ids=ids, labels=labels).loss
    assert want != fp32  # under bf16 autocast
    clone = ROUNDTRIPS[how](prepared)
    torch.testing.assert_close(clone(input_ids=ids, labels=labels).loss, want, rtol=0, atol=0)
    assert model._hf_mhce_patch.autocast is None  # the original's record is left as it was (its wrapper holds it)
    unpatch(clone)  # keeps the autocast, as the README promises of the prepared model itself
    clone.eval()
    with torch.no_grad():
        plain = clone(input_ids=ids, labels=labels).loss
    assert plain.dtype == torch.float32 and plain != make_model("llama").float()(input_ids=ids, labels=labels).loss


def test_a_shallow_copy_shares_the_patch_and_a_save_records_the_loss_computed(tmp_path):
    """copy.copy shares the modules, config, hooks and patch record with the original, as any module's shallow copy
    does. unpatch of the copy took hf_mhce's entry out of the shared config while the original still computed MHCE,
    and its save_pretrained wrote a config.json that reloaded as CE: a save now records the loss computed."""
    model = apply_patch(make_model("llama"), loss="mhce", num_heads=4)
    shallow = copy.copy(model)
    assert shallow._hf_mhce_patch is model._hf_mhce_patch and shallow.config is model.config
    unpatch(shallow)
    assert is_patched(model) and not is_patched(shallow)
    ids, labels = batch()
    want = _outputs(model, ids, labels)[0]
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["hf_mhce"]
    assert (saved["loss"], saved["num_heads"]) == ("mhce", 4)
    from hf_mhce import from_pretrained

    torch.testing.assert_close(_outputs(from_pretrained(tmp_path), ids, labels)[0], want, rtol=0, atol=0)


def test_a_deleted_patched_model_is_freed_by_unpatch_or_a_collection():
    """What the README says of freeing a patched model: no registry keeps it; the forward bound to it is a
    reference cycle that unpatch breaks and a cyclic collection frees."""
    import gc
    import weakref

    for loss, heads in (("ce", 1), ("mhce", 4)):
        model = apply_patch(make_model("llama"), loss=loss, num_heads=heads)
        model(*batch()[:1], labels=batch()[1]).loss.backward()
        alive = weakref.ref(model)
        unpatch(model)
        del model
        assert alive() is None  # by reference counting alone
        model = apply_patch(make_model("llama"), loss=loss, num_heads=heads)
        alive = weakref.ref(model)
        del model
        gc.collect()
        assert alive() is None
