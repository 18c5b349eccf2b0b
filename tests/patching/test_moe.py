"""Mixture-of-experts causal LMs: the router's load-balancing loss rides along with the fused loss."""

import pytest
import torch
from patching_models import assert_grads_close, batch, grads, token_dataset, twin
from transformers import (AutoConfig, AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, Trainer,
                          TrainingArguments, __version__)

from hf_mhce.patching import UnsupportedModelError, apply_patch, from_pretrained
from hf_mhce.patching.families import output_type

VOCAB = 97


def mixtral(seed=0, **extra):
    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=64, router_aux_loss_coef=0.5, **extra)
    return MixtralForCausalLM(cfg)


def padded_batch():
    ids, labels = batch(seq=11)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: the balancing loss leaves these tokens out
    labels[1, :4] = -100
    return ids, mask, labels


@pytest.mark.parametrize("flag", [None, True, False])
@pytest.mark.parametrize("in_config", [True, False])
def test_router_loss_follows_output_router_logits(flag, in_config):
    """The argument decides, else config.output_router_logits; loss, aux_loss and grads match HF."""
    ref = mixtral(output_router_logits=in_config)
    model = apply_patch(twin(ref))
    ids, mask, labels = padded_batch()
    kwargs = {} if flag is None else {"output_router_logits": flag}
    r = ref(input_ids=ids, attention_mask=mask, labels=labels, **kwargs)
    o = model(input_ids=ids, attention_mask=mask, labels=labels, **kwargs)
    wanted = in_config if flag is None else flag
    assert (r.aux_loss is not None) == wanted and (o.aux_loss is not None) == wanted
    torch.testing.assert_close(o.loss, r.loss, rtol=1e-6, atol=0)
    if wanted:
        torch.testing.assert_close(o.aux_loss, r.aux_loss, rtol=1e-6, atol=0)
        assert len(o.router_logits) == 2 and o.router_logits[0].shape == (ids.numel(), 4)
    r.loss.backward()
    o.loss.backward()
    assert_grads_close(grads(ref), grads(model))


def test_router_loss_without_labels_and_in_generation():
    ref = mixtral(output_router_logits=True)
    model = apply_patch(twin(ref)).eval()
    ref.eval()
    ids, mask, _ = padded_batch()
    with torch.no_grad():
        r, o = ref(input_ids=ids, attention_mask=mask), model(input_ids=ids, attention_mask=mask)
    assert o.loss is None and r.loss is None
    torch.testing.assert_close(o.aux_loss, r.aux_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(o.logits, r.logits, rtol=1e-6, atol=1e-6)
    prompt = ids[:1, :5]
    args = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **args), ref.generate(prompt, **args))


def test_mhce_adds_the_same_router_loss():
    """MHCE replaces the CE term only: with the router loss on, the loss grows by coef * aux_loss."""
    ref = mixtral()
    model = apply_patch(twin(ref), loss="mhce", num_heads=4)
    ids, mask, labels = padded_batch()
    with torch.no_grad():
        on = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
        off = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=False)
        aux = ref(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    torch.testing.assert_close(on.loss - off.loss, 0.5 * aux, rtol=1e-5, atol=1e-6)


def test_trainer_with_router_loss_matches_unpatched(tmp_path):
    """Gradient accumulation with num_items_in_batch: HF adds coef * aux_loss to each micro-batch's loss."""
    def train(model, out):
        args = TrainingArguments(output_dir=str(out), max_steps=4, per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, learning_rate=1e-2, logging_steps=1, report_to="none",
                                 use_cpu=True, save_strategy="no", seed=0, data_seed=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=token_dataset(16, vocab=VOCAB, ragged=True))
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    ref = mixtral(output_router_logits=True)
    model = apply_patch(twin(ref))
    ref_losses, losses = train(ref, tmp_path / "ref"), train(model, tmp_path / "patched")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-3, atol=1e-5, msg=lambda m: f"{n}: {m}")


def test_save_and_reload_keeps_the_loss(tmp_path):
    model = apply_patch(mixtral(output_router_logits=True), loss="mhce", num_heads=2)
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path)
    ids, mask, labels = padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask, labels=labels).loss,
                                   model(input_ids=ids, attention_mask=mask, labels=labels).loss, rtol=1e-6, atol=0)


def test_unlisted_moe_family_accepted_by_probe():
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("ernie4_5_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                               moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, output_router_logits=True,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ref = AutoModelForCausalLM.from_config(cfg)
    model = apply_patch(twin(ref))
    ids, mask, labels = padded_batch()
    r = ref(input_ids=ids, attention_mask=mask, labels=labels)
    o = model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(o.loss, r.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(o.aux_loss, r.aux_loss, rtol=1e-6, atol=0)


def test_moe_family_without_router_loss_returns_router_logits():
    """Hunyuan MoE (outside the table) records router logits but adds no loss term."""
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("hunyuan_v1_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               num_experts=4, moe_topk=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ref = AutoModelForCausalLM.from_config(cfg)
    if "router_logits" not in output_type(type(ref)).__dataclass_fields__:
        pytest.skip(f"transformers {__version__}'s Hunyuan MoE returns no router logits (a plain CausalLMOutputWithPast)")
    model = apply_patch(twin(ref))
    assert model.__dict__["_hf_mhce_patch"].router.module is None
    ids, mask, labels = padded_batch()
    r = ref(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    o = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    assert r.aux_loss is None and o.aux_loss is None
    torch.testing.assert_close(o.loss, r.loss, rtol=1e-6, atol=0)
    assert len(o.router_logits) == len(r.router_logits) == 2
    for got, want in zip(o.router_logits, r.router_logits):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


class _DoubledRouterLoss(MixtralForCausalLM):
    """A subclass that weights the router loss its own way: the generic forward would not."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if out.loss is not None and out.aux_loss is not None:
            out.loss = out.loss + self.router_aux_loss_coef * out.aux_loss
        return out


def test_router_loss_computed_otherwise_is_refused():
    model = mixtral()
    with pytest.raises(UnsupportedModelError, match="does not reproduce its logits and loss"):
        apply_patch(_DoubledRouterLoss(model.config))


def test_router_loss_without_its_counts_is_refused():
    model = mixtral()
    model.num_experts = None  # where the family's forward reads it
    with pytest.raises(UnsupportedModelError, match="has no attribute num_experts"):
        apply_patch(model)


def test_decoder_without_router_logits_names_the_problem():
    model = apply_patch(mixtral())
    ids, mask, labels = padded_batch()
    decoder = model.get_decoder()
    decoder.forward = lambda **kw: type(decoder).forward(decoder, **{**kw, "output_router_logits": False})
    with pytest.raises(ValueError, match="returned no router_logits"):
        model(input_ids=ids, labels=labels, output_router_logits=True)


class _ForwardingMixtral(MixtralForCausalLM):
    """An unannotated override that changes nothing: it returns what Mixtral's forward returns."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


def test_unannotated_subclass_keeps_the_router_loss():
    ref = _ForwardingMixtral(mixtral().config)
    model = apply_patch(twin(ref))
    ids, mask, labels = padded_batch()
    r = ref(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    o = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    assert type(o) is type(r)
    torch.testing.assert_close(o.loss, r.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(o.aux_loss, r.aux_loss, rtol=1e-6, atol=0)


def test_probe_leaves_no_hooks_behind():
    """The probe asks for router logits, on which transformers installs output-capturing hooks (local
    closures pickle cannot save): a model that pickled before apply_patch still pickles."""
    import pickle

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("ernie4_5_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                               moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg)
    pickle.dumps(model)
    apply_patch(model)  # outside the table: probed
    copy = pickle.loads(pickle.dumps(model))
    ids, mask, labels = padded_batch()
    with torch.no_grad():  # recording router logits afterwards still works, in the copy too
        for m in (model, copy):
            out = m(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
            assert len(out.router_logits) >= 1 and out.aux_loss is not None


def _ernie_vl(output_router_logits):
    """Ernie-4.5-VL-MoE: a vision-language MoE whose forward reads config.text_config.output_router_logits."""
    import transformers as T

    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, moe_intermediate_size=[16, 16], moe_k=2, moe_num_experts=4,
                moe_num_shared_experts=1, router_aux_loss_coef=0.5, output_router_logits=output_router_logits,
                pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 1, 2]})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2, spatial_merge_size=2)
    torch.manual_seed(0)
    return T.Ernie4_5_VLMoeForConditionalGeneration(T.Ernie4_5_VLMoeConfig(
        text_config=text, vision_config=vision, image_token_id=90, image_start_token_id=91, image_end_token_id=92,
        video_token_id=93, video_start_token_id=94, video_end_token_id=95))


@pytest.mark.parametrize("in_text_config", [True, False])
def test_vision_language_moe_reads_the_text_configs_flag(in_text_config):
    """Without the argument, the router loss follows config.text_config.output_router_logits there (the
    top-level config has no such attribute): with it set, the loss holds coef * aux_loss as in HF."""
    ref = _ernie_vl(in_text_config)
    model = apply_patch(twin(ref))
    ids, mask, labels = padded_batch()
    r = ref(input_ids=ids, attention_mask=mask, labels=labels)
    o = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert (r.aux_loss is not None) == in_text_config and (o.aux_loss is not None) == in_text_config
    torch.testing.assert_close(o.loss, r.loss, rtol=1e-6, atol=0)
    r.loss.backward()
    o.loss.backward()
    assert_grads_close(grads(ref), grads(model))
