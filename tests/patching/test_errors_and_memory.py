"""Clear errors, and no [N, V] logits when a loss is asked for."""

from dataclasses import dataclass
from pathlib import Path

import numpy
import pytest
import torch
from patching_models import batch, make_model, twin
from reference import LargestOutput
from transformers import BertConfig, BertForMaskedLM, BertModel, LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from hf_mhce.patching import LossConfig, UnsupportedModelError, apply_patch, from_pretrained, is_patched, unpatch


def test_unknown_loss_and_options():
    model = make_model("llama")
    with pytest.raises(ValueError, match=r"unknown loss 'focal'.*\('ce', 'mhce'\)"):
        apply_patch(model, loss="focal")
    with pytest.raises(TypeError, match="unknown apply_patch argument.*label_smothing.*did you mean 'label_smoothing'"):
        apply_patch(model, label_smothing=0.1)
    with pytest.raises(TypeError, match=r"'heads': did you mean 'num_heads'.*valid arguments: \['loss', 'num_heads'"):
        apply_patch(model, "mhce", heads=2)
    with pytest.raises(ValueError, match="needs num_heads"):
        apply_patch(model, loss="mhce")
    with pytest.raises(ValueError, match="only applies to loss='mhce'"):
        apply_patch(model, loss="ce", num_heads=4)
    with pytest.raises(ValueError, match="positive int"):
        apply_patch(model, loss="mhce", num_heads=0)
    # every option is checked when it is given, not at the first forward
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'triton', 'torch'\).*'cuda'"):
        apply_patch(model, backend="cuda")
    with pytest.raises(TypeError, match="label_smoothing must be a number, got '0.1'"):
        apply_patch(model, label_smoothing="0.1")
    with pytest.raises(TypeError, match="z_loss must be a number"):
        apply_patch(model, z_loss=True)
    with pytest.raises(ValueError, match="z_loss must be a finite number"):
        apply_patch(model, z_loss=float("inf"))
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\], got nan"):
        apply_patch(model, label_smoothing=float("nan"))
    assert "forward" not in model.__dict__ and not hasattr(model.config, "hf_mhce")  # nothing half-done


def test_num_heads_must_divide_hidden_size():
    with pytest.raises(ValueError, match="num_heads=5 does not divide the hidden size 32 that the LM head"):
        apply_patch(make_model("llama"), loss="mhce", num_heads=5)


def test_num_heads_error_names_the_heads_input_size_where_it_is_not_hidden_size():
    """OPT projects the hidden state (word_embed_proj_dim) before its head: the check was right, and its
    message named the head's input size as "the hidden size" beside a config.hidden_size that differs."""
    from transformers import OPTConfig, OPTForCausalLM

    model = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=48, word_embed_proj_dim=40, ffn_dim=64,
                                     num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=32))
    with pytest.raises(ValueError, match=r"hidden size 40 that the LM head of OPTForCausalLM reads \(config.hidden_size is 48\)"):
        apply_patch(model, loss="mhce", num_heads=16)


@pytest.mark.parametrize("thing", ["gpt2", None, 3, Path("ckpt")], ids=["hub id", "None", "int", "path"])
def test_not_a_model_is_named(thing):
    """A hub id or None passed as the model: a bare AttributeError ('str' object has no attribute
    '__dict__') from inside apply_patch; unpatch likewise."""
    with pytest.raises(UnsupportedModelError, match=f"cannot patch {type(thing).__name__}: it is not a transformers"
                                                     f" PreTrainedModel") as info:
        apply_patch(thing, loss="ce")
    assert ("load the checkpoint first" in str(info.value)) == isinstance(thing, (str, Path))
    with pytest.raises(TypeError, match=f"unpatch expects the model apply_patch patched, got {type(thing).__name__}"):
        unpatch(thing)


@dataclass
class _OutputWithDraft(CausalLMOutputWithPast):
    draft_logits: torch.Tensor | None = None


class _ExtraOutputLlama(LlamaForCausalLM):
    """Returns a field (say, multi-token-prediction logits) the generic forward cannot compute."""

    def forward(self, *args, **kwargs) -> _OutputWithDraft:
        return _OutputWithDraft(**super().forward(*args, **kwargs))


def test_unsupported_models_name_the_requirement():
    tiny = dict(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    cases = [
        (BertForMaskedLM(BertConfig(**tiny)), "does not reproduce its logits"),  # transform before the head
        (BertModel(BertConfig(**tiny)), "get_decoder|LM head|get_output_embeddings"),
        (_ExtraOutputLlama(LlamaConfig(**tiny)), r"fields \['draft_logits'\]"),
        (torch.nn.Linear(4, 4), "not a transformers PreTrainedModel"),
    ]
    for model, reason in cases:
        with pytest.raises(UnsupportedModelError, match=reason) as info:
            apply_patch(model)
        msg = str(info.value)
        assert "llama, mistral, gpt2" in msg and "get_output_embeddings" in msg and "get_decoder" in msg


def test_config_dataclass_round_trip():
    cfg = LossConfig(loss="mhce", num_heads=4, z_loss=1e-4, backend="torch", return_logits=True)
    saved = cfg.to_saved()
    assert "backend" not in saved and "return_logits" not in saved and saved["format"] == 1
    assert LossConfig.from_saved(saved) == LossConfig(loss="mhce", num_heads=4, z_loss=1e-4)
    # numbers of other types (numpy's here) are stored as Python floats / ints; the backend's case is free
    typed = LossConfig(label_smoothing=numpy.float32(0.25), z_loss=0, ignore_index=numpy.int64(-1), backend="Torch")
    assert typed.to_saved() == {**LossConfig().to_saved(), "label_smoothing": 0.25, "z_loss": 0.0, "ignore_index": -1}
    assert type(typed.label_smoothing) is float and type(typed.z_loss) is float and type(typed.ignore_index) is int
    heads = LossConfig(loss="mhce", num_heads=numpy.int64(4))  # integer types alike, for num_heads too
    assert type(heads.num_heads) is int and heads.to_saved()["num_heads"] == 4
    # configs saved before return_logits became a runtime field still load (the key is ignored)
    assert LossConfig.from_saved({**saved, "return_logits": False}).return_logits is None
    # a record of a later format is refused, not read as this one (a config without one is format 1)
    for fmt in (2, "1", None):
        with pytest.raises(ValueError, match=f"has format {fmt!r}, which this hf_mhce does not read"):
            LossConfig.from_saved({**saved, "format": fmt})
    assert LossConfig.from_saved({k: v for k, v in saved.items() if k != "format"}) == LossConfig.from_saved(saved)


def test_recorded_config_is_read_whole_or_refused():
    """A hand-edited model.config.hf_mhce (or hf_mhce.json): a misspelt field, loss='mhce' without num_heads or a
    bad value is refused naming the record, as apply_patch's own arguments are; none becomes a default."""
    saved = LossConfig(loss="mhce", num_heads=2, label_smoothing=0.1).to_saved()
    typo = {k if k != "label_smoothing" else "label_smothing": v for k, v in saved.items()}
    with pytest.raises(ValueError, match=r"model\.config\.hf_mhce has unknown field\(s\) \['label_smothing'\] "
                                         r"\('label_smothing': did you mean 'label_smoothing'\?\)"):
        LossConfig.from_saved(typo)
    with pytest.raises(ValueError, match="records loss='mhce' without num_heads"):
        LossConfig.from_saved({"loss": "mhce"})
    with pytest.raises(ValueError, match=r"^/ckpt/hf_mhce\.json: label_smoothing must be in \[0, 1\], got 5\.0"):
        LossConfig.from_saved({**saved, "label_smoothing": 5}, source="/ckpt/hf_mhce.json")
    assert LossConfig.from_saved({"loss": "ce"}) == LossConfig()  # fields left out of a CE record: the defaults
    model = make_model("llama")
    model.config.hf_mhce = typo
    with pytest.raises(ValueError, match="did you mean 'label_smoothing'"):
        apply_patch(model)
    assert model.config.hf_mhce == typo and not is_patched(model)  # refused before anything changed


@pytest.mark.parametrize("loss", ["ce", "mhce"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_no_full_logits_in_eval_with_labels(family, loss, monkeypatch):
    vocab = 512
    model = apply_patch(make_model(family, vocab=vocab), loss=loss, num_heads=4 if loss == "mhce" else None).eval()
    ids, labels = batch(batch_size=2, seq=40, vocab=vocab)
    n_tokens = ids.numel()

    def no_head_call(*_):
        raise AssertionError("the LM head module was called")

    # a tripwire on the call itself (a pre-hook would run: the fused path runs them; a forward put on the
    # instance is refused, since the fused path would skip it)
    head = model.get_output_embeddings()
    head.__class__ = type("UncallableLinear", (type(head),), {"__call__": no_head_call})
    monkeypatch.setenv("HF_MHCE_CHUNK_MB", "0.05")  # the op's blocks stay well below [N, V]
    for grad in (False, True):
        with torch.set_grad_enabled(grad), LargestOutput() as mode:
            out = model(input_ids=ids, labels=labels)
            if grad:
                out.loss.backward()
        assert out.logits is None
        # the head weight [V, D] and its gradient are the largest tensors (N = 80 > D): never [N, V]
        assert mode.largest <= vocab * model.config.hidden_size
        assert mode.largest < n_tokens * vocab


def test_unpatch_of_a_deepcopy_restores_the_original_forward():
    import copy

    import hf_mhce
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    hf_mhce.apply_patch(model, loss="mhce", num_heads=2)
    clone = hf_mhce.unpatch(copy.deepcopy(model))
    ids = torch.randint(0, 61, (2, 5))
    assert "forward" not in clone.__dict__ and clone(ids).logits.shape == (2, 5, 61)
    assert not hasattr(clone.config, "hf_mhce")


def test_labels_as_transformers_reads_them_with_shift_labels_or_logits_to_keep():
    """transformers ignores the shape of labels given with shift_labels, and computes the loss on the
    kept positions when the labels are sized to logits_to_keep; other shapes name both readings."""
    ref = make_model("llama")
    model = apply_patch(twin(ref))
    ids, labels = batch()
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    with torch.no_grad():
        want = ref(input_ids=ids, labels=labels[:, :1], shift_labels=shifted).loss
        torch.testing.assert_close(model(input_ids=ids, labels=labels[:, :1], shift_labels=shifted).loss, want)
        want = ref(input_ids=ids, labels=labels[:, -3:], logits_to_keep=3).loss
        torch.testing.assert_close(model(input_ids=ids, labels=labels[:, -3:], logits_to_keep=3).loss, want)
        with pytest.raises(ValueError, match=r"fit neither the input .* nor the positions logits_to_keep=3"):
            model(input_ids=ids, labels=labels[:, -2:], logits_to_keep=3)


def test_a_compiled_model_is_refused_with_the_way_round():
    model = make_model("llama")
    with pytest.raises(TypeError, match=r"torch.compile'd model: patch the model before"):
        apply_patch(torch.compile(model))
    assert not is_patched(model)


@pytest.mark.parametrize("name", ["/abs/no/such/ckpt", "./no_such_ckpt", "a/b/c"])
def test_from_pretrained_names_a_missing_local_checkpoint(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"no such checkpoint directory: {name!r}"):
        from_pretrained(name)
