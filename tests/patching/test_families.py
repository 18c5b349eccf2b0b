"""The family table and the generic path: every listed family, and an unlisted one via the probe."""

import pytest
import torch
from patching_models import assert_grads_close, batch, grads, twin
from transformers import AutoConfig, AutoModelForCausalLM

from hf_mhce.patching import FAMILIES, TESTED_FAMILIES, apply_patch
from hf_mhce.patching.families import LogitFacts

SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Make the family's logit transform matter at random init.
FACT_VALUES = {"final_logit_softcapping": 2.0, "logit_scale": 3.0, "logits_scaling": 0.25}


def tiny(model_type, **extra):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **SIZES, **extra)
    if model_type == "gpt_neox":
        cfg.rotary_pct = 1.0
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # larger head weights: softcap / scale visibly change the logits
        model.get_output_embeddings().weight.mul_(40.0)
    return model


def check_equal(ref, model):
    ids, labels = batch()
    ref.zero_grad(set_to_none=True)
    r = ref(input_ids=ids, labels=labels)
    r.loss.backward()
    o = model(input_ids=ids, labels=labels)
    o.loss.backward()
    torch.testing.assert_close(o.loss, r.loss, rtol=1e-5, atol=0)
    assert_grads_close(grads(ref), grads(model))
    with torch.no_grad():
        ref.eval(), model.eval()
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("model_type", sorted(set(FAMILIES) - set(TESTED_FAMILIES)))
def test_listed_family_matches_unpatched(model_type):
    facts = FAMILIES[model_type]
    extra = {attr: FACT_VALUES[attr] for attr in (facts.multiply_attr, facts.divide_attr, facts.softcap_attr) if attr}
    ref = tiny(model_type, **extra)
    model = apply_patch(twin(ref))
    check_equal(ref, model)
    # the fact is what makes the fused loss right: without it the loss would differ
    if facts != LogitFacts():
        plain = apply_patch(twin(ref))
        plain.__dict__["_hf_mhce_patch"].facts = LogitFacts()
        ids, labels = batch()
        assert not torch.allclose(plain(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss)


def test_unlisted_family_accepted_by_probe():
    assert "phi" not in FAMILIES
    ref = tiny("phi")  # not in the table; its head has a bias
    assert ref.get_output_embeddings().bias is not None
    model = apply_patch(twin(ref))
    assert model.training  # the probe ran in eval mode and restored the mode
    check_equal(ref, model)
