"""loss="mhce": loss, logits (mixture log-probs), generation, and the saved config round trip."""

from pathlib import Path

import pytest
import torch
from patching_models import FAMILIES, batch, make_model, mixture_logprobs_reference, twin
from transformers import AutoModelForCausalLM

import hf_mhce
from hf_mhce.patching import CONFIG_KEY, apply_patch, unpatch

H = 4


def _final_hidden(model, ids):
    return model.get_decoder()(input_ids=ids).last_hidden_state


@pytest.mark.parametrize("family", FAMILIES)
def test_mhce_loss_logits_and_gradients(family):
    model = apply_patch(make_model(family), loss="mhce", num_heads=H)
    ids, labels = batch()
    hidden = _final_hidden(model, ids)
    weight = model.get_output_embeddings().weight
    ref_logp = mixture_logprobs_reference(hidden, weight, H)
    # without labels: the logits are the mixture's (normalised) log-probs
    logits = model(input_ids=ids).logits
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits.exp().sum(-1), torch.ones(ids.shape), rtol=1e-5, atol=1e-5)
    # with labels: -log pbar of the shifted targets, averaged
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    valid = shift != -100
    ref_loss = -ref_logp[valid].gather(-1, shift[valid].unsqueeze(-1)).mean()
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    # gradients against autograd through the reference
    params = [p for p in model.parameters()]
    g_fused = torch.autograd.grad(out.loss, params)
    hidden = _final_hidden(model, ids)
    ref = -mixture_logprobs_reference(hidden, weight, H)[valid].gather(-1, shift[valid].unsqueeze(-1)).mean()
    g_ref = torch.autograd.grad(ref, params)
    for a, b in zip(g_fused, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * b.abs().max().item() + 1e-9)


def test_mhce_one_head_is_ce():
    ref = make_model("llama")
    model = apply_patch(twin(ref), loss="mhce", num_heads=1)
    ids, labels = batch()
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss)
    torch.testing.assert_close(model(ids).logits, torch.log_softmax(ref(ids).logits, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_mhce_generate_follows_the_mixture(family):
    model = apply_patch(make_model(family), loss="mhce", num_heads=H).eval()
    ids, _ = batch(seq=5)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    # greedy step by step without the cache: each new token is the argmax of log pbar
    seq = ids
    with torch.no_grad():
        for _ in range(6):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(out, seq)
    sampled = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=True,
                             top_k=0, pad_token_id=0)
    assert sampled.shape == (ids.shape[0], ids.shape[1] + 4)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_load_round_trip(family, tmp_path):
    model = apply_patch(make_model(family), loss="mhce", num_heads=H, label_smoothing=0.05).eval()
    ids, _ = batch()
    with torch.no_grad():
        before = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = hf_mhce.from_pretrained(tmp_path).eval()
    assert getattr(loaded.config, CONFIG_KEY)["loss"] == "mhce"
    assert getattr(loaded.config, CONFIG_KEY)["label_smoothing"] == 0.05
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, before, rtol=1e-6, atol=1e-6)
    # plain transformers loading + apply_patch() with no arguments restores it as well
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    apply_patch(plain)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, before, rtol=1e-6, atol=1e-6)


def test_changing_a_recorded_loss_needs_override(tmp_path):
    make_model("llama").save_pretrained(tmp_path / "plain")
    apply_patch(make_model("llama"), loss="mhce", num_heads=H).save_pretrained(tmp_path / "mhce")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "mhce")
    with pytest.raises(ValueError, match="override_saved"):
        apply_patch(loaded, loss="ce")
    with pytest.raises(ValueError, match="override_saved"):
        apply_patch(loaded, loss="mhce", num_heads=2)
    with pytest.raises(ValueError, match="override_saved"):
        hf_mhce.from_pretrained(tmp_path / "mhce", loss="ce")
    with pytest.raises(TypeError, match="override_saved must be a bool"):  # "no" is truthy
        apply_patch(loaded, loss="ce", override_saved="no")
    apply_patch(loaded, loss="mhce")  # same loss, heads from the config: fine
    assert loaded.config.hf_mhce["num_heads"] == H
    apply_patch(loaded, loss="ce", override_saved=True)
    assert loaded.config.hf_mhce["loss"] == "ce" and loaded.config.hf_mhce["num_heads"] == 1
    # the reverse: a CE-recorded checkpoint patched as MHCE
    ce = apply_patch(make_model("llama"), loss="ce")
    with pytest.raises(ValueError, match="override_saved"):
        apply_patch(ce, loss="mhce", num_heads=H)
    # a checkpoint without a record: from_pretrained patches it with "ce", or as asked
    plain = hf_mhce.from_pretrained(tmp_path / "plain")
    assert plain.config.hf_mhce["loss"] == "ce"
    plain = hf_mhce.from_pretrained(tmp_path / "plain", loss="mhce", num_heads=H)
    assert plain.config.hf_mhce["num_heads"] == H


def test_unpatch_restores_the_config_it_found(tmp_path):
    apply_patch(make_model("llama"), loss="mhce", num_heads=H).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    saved = dict(loaded.config.hf_mhce)
    apply_patch(loaded, z_loss=1e-4)
    unpatch(loaded)
    assert loaded.config.hf_mhce == saved


def test_models_sharing_a_config_object_keep_their_own_loss(tmp_path):
    """Two models built from one config object: patching one must not label the other."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    patched, sibling = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg)
    apply_patch(patched, loss="mhce", num_heads=H)
    assert not hasattr(cfg, CONFIG_KEY) and not hasattr(sibling.config, CONFIG_KEY)
    sibling.save_pretrained(tmp_path / "sibling")  # never patched: saves a plain checkpoint
    assert CONFIG_KEY not in (tmp_path / "sibling" / "config.json").read_text()
    apply_patch(sibling, loss="ce")  # its own first patch, not a change of a recorded loss
    assert sibling.config.hf_mhce["loss"] == "ce" and patched.config.hf_mhce["loss"] == "mhce"
    # the patched model's submodules follow its config, so later edits still reach its decoder
    assert all(m.config is patched.config for m in patched.modules() if "config" in m.__dict__)
    patched.config.use_cache = False
    assert patched.get_decoder().config.use_cache is False


def test_card_loads_by_an_absolute_path(tmp_path, monkeypatch):
    """The card's loading line works from any directory: a relative save path is written absolute."""
    monkeypatch.chdir(tmp_path)
    apply_patch(make_model("llama"), loss="mhce", num_heads=H).save_pretrained("out")
    card = (tmp_path / "out" / "README.md").read_text()
    line = next(ln for ln in card.splitlines() if "hf_mhce.from_pretrained(" in ln)
    path = line.split('"')[1]
    assert path == str(tmp_path / "out")
    monkeypatch.chdir("/")
    assert hf_mhce.from_pretrained(path).config.hf_mhce["loss"] == "mhce"


def test_card_reaches_the_hub_on_push(tmp_path, monkeypatch):
    """transformers' pushes replace README.md with the Hub's card after save_pretrained wrote ours: the MHCE
    notice must still be in what is uploaded, loading by the repo id (the Hub calls are stubbed)."""
    from unittest import mock

    from huggingface_hub import ModelCard
    from transformers import modeling_utils
    from transformers.utils import hub

    uploaded = []

    def upload(self, folder, *args, **kwargs):  # the last step of a push: what README.md says then
        uploaded.append(Path(folder, "README.md").read_text())

    api = mock.Mock()
    api.create_repo.return_value.repo_id = "user/tiny"
    monkeypatch.setattr(hub.PushToHubMixin, "_upload_modified_files", upload)
    for module in (hub, modeling_utils):
        monkeypatch.setattr(module, "hf_api", lambda: api)
        monkeypatch.setattr(module, "create_and_tag_model_card",
                            lambda *a, **k: ModelCard("---\nlibrary_name: transformers\n---\n# Model\n"))
    model = apply_patch(make_model("llama"), loss="mhce", num_heads=H)
    model.push_to_hub("user/tiny")
    model.save_pretrained(tmp_path, push_to_hub=True, repo_id="user/tiny")
    assert len(uploaded) == 2
    for readme in uploaded:
        assert "# Model" in readme and "predicts with a mixture of 4 softmaxes" in readme
        assert 'hf_mhce.from_pretrained("user/tiny")' in readme
    unpatch(model)  # the upload method goes with the patch
    assert "_upload_modified_files" not in model.__dict__
