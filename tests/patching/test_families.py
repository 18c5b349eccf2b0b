"""The family table and the generic path: every listed family, and an unlisted one via the probe."""

import sys
from pathlib import Path

import pytest
import torch
from patching_models import assert_grads_close, batch, grads, twin
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from hf_mhce.patching import FAMILIES, TESTED_FAMILIES, apply_patch
from hf_mhce.patching.families import LogitFacts, UnsupportedModelError, output_type

SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Make the family's logit transform matter at random init.
FACT_VALUES = {"final_logit_softcapping": 2.0, "logits_soft_cap": 2.0, "output_logit_soft_cap": 2.0, "logit_scale": 3.0, "logits_scaling": 0.25, "lm_head_multiplier": 3.0}
# Mixture-of-experts families (each config reads the names it knows), with the router loss switched on.
MOE_FAMILIES = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "gpt_oss", "granitemoe", "granitemoeshared",
                "granitemoe_swa", "glm4_moe", "cohere2_moe", "beam"}
MOE_SIZES = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                 shared_expert_intermediate_size=16, output_router_logits=True)
# Families whose configs need their own names at these sizes: the family survey's overrides (data).
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
from family_survey import OVERRIDES as FAMILY_SIZES  # noqa: E402


def tiny(model_type, dtype=None, **extra):
    """``dtype``: built in it as from_pretrained would (modules a family keeps in float32 stay so)."""
    torch.manual_seed(0)
    sizes = {**SIZES, **(MOE_SIZES if model_type in MOE_FAMILIES else {}), **FAMILY_SIZES.get(model_type, {})}
    cfg = AutoConfig.for_model(model_type, **sizes, **extra)
    if model_type == "gpt_neox":
        cfg.rotary_pct = 1.0
    model = AutoModelForCausalLM.from_config(cfg, **({"dtype": dtype} if dtype else {}))
    with torch.no_grad():  # larger head weights: softcap / scale visibly change the logits
        model.get_output_embeddings().weight.mul_(40.0)
    return model


def check_equal(ref, model):
    ids, labels = batch()
    ref.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # PhiMoE's router samples in training mode: the same draws for both
    r = ref(input_ids=ids, labels=labels)
    r.loss.backward()
    torch.manual_seed(3)
    o = model(input_ids=ids, labels=labels)
    o.loss.backward()
    torch.testing.assert_close(o.loss, r.loss, rtol=1e-5, atol=0)
    if getattr(r, "aux_loss", None) is not None:
        torch.testing.assert_close(o.aux_loss, r.aux_loss, rtol=1e-6, atol=0)
    assert getattr(o, "aux_loss", None) is None or getattr(r, "aux_loss", None) is not None
    assert_grads_close(grads(ref), grads(model))
    with torch.no_grad():
        ref.eval(), model.eval()
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-6, atol=1e-6)


def records_router_logits(model):
    """Whether the decoder returns router logits when asked (transformers 5.17's GLM-4.5 MoE and Granite MoE
    families record none: the former returns no MoE output, the latter's load-balancing loss gets None)."""
    with torch.no_grad():
        out = model.get_decoder()(input_ids=batch()[0], output_router_logits=True)
    return getattr(out, "router_logits", None) is not None


VISION_LANGUAGE = {"paligemma"}  # tested with images in test_multimodal.py


@pytest.mark.parametrize("model_type", sorted(set(FAMILIES) - set(TESTED_FAMILIES) - VISION_LANGUAGE))
def test_listed_family_matches_unpatched(model_type):
    from transformers import CONFIG_MAPPING, __version__

    if model_type not in CONFIG_MAPPING:  # a family newer than the installed transformers (Inkling-2 Loop: 5.24)
        pytest.skip(f"transformers {__version__} has no model type {model_type}")
    facts = FAMILIES[model_type]
    extra = {attr: FACT_VALUES[attr] for attr in (facts.multiply_attr, facts.divide_attr, facts.softcap_attr) if attr}
    ref = tiny(model_type, **extra)
    routed = model_type not in MOE_FAMILIES or records_router_logits(ref)
    if routed:
        assert ("aux_loss" in output_type(type(ref)).__dataclass_fields__) == (model_type in MOE_FAMILIES)
    else:  # the forward cannot add the router loss (Granite MoE's crashes on the None it gets): compared without it
        ref.config.output_router_logits = False
    model = apply_patch(twin(ref))
    check_equal(ref, model)
    # each fact is what makes the fused loss right: without it the loss would differ
    state = model.__dict__["_hf_mhce_patch"]
    for fact, plain_value in (("facts", LogitFacts()), ("router", None)):
        if getattr(state, fact) == plain_value or (fact == "router" and (state.router.module is None or not routed)):
            continue  # nothing to leave out (an MoE family whose forward adds no router loss)
        plain = apply_patch(twin(ref))
        setattr(plain.__dict__["_hf_mhce_patch"], fact, plain_value)
        ids, labels = batch()
        torch.manual_seed(3)
        ours = plain(input_ids=ids, labels=labels).loss
        torch.manual_seed(3)
        assert not torch.allclose(ours, ref(input_ids=ids, labels=labels).loss), fact
    if not routed:
        pytest.skip(f"transformers {__version__}'s {model_type} records no router logits: compared without the router loss")


@pytest.mark.parametrize("model_type", ["cohere", "cohere2", "cohere2_moe", "falcon_h1"])
def test_a_scale_is_read_where_the_forward_reads_it(model_type):
    """Cohere's forward multiplies by model.logit_scale, Falcon-H1's by model.model.lm_head_multiplier:
    copies of the config value made at __init__.  The patched model read the config, so an edit of either
    one gave another loss and other logits than the model's own, silently."""
    attr = FAMILIES[model_type].multiply_attr
    ref = tiny(model_type, **{attr: 3.0})
    model = apply_patch(twin(ref))
    for m in (ref, model):
        setattr(m.model if model_type == "falcon_h1" else m, attr, 0.5)  # what the forward multiplies by
        setattr(m.config, attr, 7.0)  # which that forward no longer reads
    check_equal(ref, model)


@pytest.mark.parametrize("model_type", ["cohere", "granite"])
def test_lora_with_bias_on_a_scaled_head(model_type):
    """A scaled family scales every term of its head: the base weight's, the LoRA adapter's low-rank term and the
    adapter's bias (PEFT lora_bias=True).  Loss, every gradient and the logits equal the unpatched model's."""
    from patching_models import with_lora
    from peft import LoraConfig

    facts = FAMILIES[model_type]
    attr = facts.multiply_attr or facts.divide_attr
    ref = with_lora(tiny(model_type, **{attr: FACT_VALUES[attr]}),
                    LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"], lora_bias=True))
    check_equal(ref, apply_patch(twin(ref)))


@pytest.mark.parametrize("model_type", ["cohere", "granite"])
def test_mhce_logits_of_a_scaled_family(model_type):
    """loss="mhce" on a family that multiplies (Cohere) or divides (Granite) its logits: the logits are log pbar of
    the scaled heads (float64 reference), and -log pbar at the targets averages to the loss."""
    from patching_models import mixture_logprobs_reference

    facts = FAMILIES[model_type]
    attr = facts.multiply_attr or facts.divide_attr
    value = FACT_VALUES[attr]
    model = apply_patch(tiny(model_type, **{attr: value}), loss="mhce", num_heads=2).eval()
    ids, labels = batch()
    with torch.no_grad():
        loss = model(input_ids=ids, labels=labels).loss
        logp = model(input_ids=ids).logits
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
    scale = value if facts.multiply_attr else 1.0 / value
    want = mixture_logprobs_reference(hidden * scale, model.get_output_embeddings().weight, 2)
    torch.testing.assert_close(logp.double(), want, rtol=1e-5, atol=1e-5)
    target = labels[:, 1:]
    valid = target != -100
    nll = -logp[:, :-1][valid].gather(-1, target[valid][:, None]).mean()
    torch.testing.assert_close(nll, loss, rtol=1e-5, atol=0)


@pytest.mark.parametrize("model_type", ["beam", "xlstm", "inkling2_text", "inkling2_loop_text"])
def test_float32_logits_where_the_family_computes_them(model_type):
    """BEAM soft-caps in float32, xLSTM and Inkling-2 (and its Loop) return float32 logits: a bf16 model's patched
    logits were bf16, capped by a bf16 tanh (other values, other greedy tokens)."""
    from transformers import CONFIG_MAPPING, __version__

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {__version__} has no model type {model_type}")
    ref = tiny(model_type, torch.bfloat16, **{FAMILIES[model_type].softcap_attr: 2.0}).eval()  # Inkling: router in float32
    ids = batch()[0]
    with torch.no_grad():
        try:
            want = ref(ids).logits
        except RuntimeError as err:  # transformers 5.23's Inkling-2 meets its float32 router with bf16 states
            pytest.skip(f"the unpatched {model_type} does not run in bfloat16 with transformers {__version__}: {err}")
        got = apply_patch(twin(ref))(ids).logits
    assert want.dtype == got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


# Outside the table: Phi's head has a bias, Mamba's output carries cache_params, Llama-4's decoder is
# not found by get_decoder() (decoder_of falls back on .model) and it returns router logits.
PROBED = {"phi": {}, "mamba": dict(state_size=8), "falcon_mamba": dict(state_size=8),
          "llama4_text": dict(intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1,
                              output_router_logits=True)}


@pytest.mark.parametrize("model_type", sorted(PROBED))
def test_unlisted_family_accepted_by_probe(model_type):
    assert model_type not in FAMILIES
    ref = tiny(model_type, **PROBED[model_type])
    assert model_type != "phi" or ref.get_output_embeddings().bias is not None
    model = apply_patch(twin(ref))
    assert model.training  # the probe ran in eval mode and restored the mode
    check_equal(ref, model)
    ids = batch()[0][:1, :5]
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0),
                       ref.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0))


class _ScaledConfig(LlamaConfig):
    model_type = "hf_mhce_test_scaled_llama"  # not in the table: patched only through the probe


class _ScaledLlama(LlamaForCausalLM):
    """A family outside the table whose logits depend on a config value (like HyperCLOVAX's scale)."""

    config_class = _ScaledConfig

    def forward(self, *args, **kwargs) -> CausalLMOutputWithPast:
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * self.config.extra_scale
        return out


def test_probe_runs_per_instance_not_per_class():
    """The probe's verdict holds for one instance's config: a scale of 1 makes this family fit the generic
    forward, a scale of 4 does not, even after an instance of the same class was accepted.  The patched
    forward(*args, **kwargs) takes positional arguments as the Llama forward it extends does."""
    def scaled(scale):
        torch.manual_seed(0)
        return _ScaledLlama(_ScaledConfig(**SIZES, extra_scale=scale))

    ref = scaled(1.0)
    check_equal(ref, apply_patch(twin(ref)))  # check_equal calls model(ids) positionally
    with pytest.raises(UnsupportedModelError, match="does not reproduce its logits"):
        apply_patch(scaled(4.0))


def test_a_listed_transform_this_release_does_not_apply_is_left_out(monkeypatch):
    """The table follows recent transformers; an older release's forward may lack a transform it lists
    (PaliGemma 2's soft-cap is absent from transformers 5.17's forward, whose logits then came out capped
    by the patch alone). Simulated: Llama listed with a soft-cap its forward never applies, and a config
    value for it. The patch leaves the cap out (checked by the probe), so logits and loss match."""
    monkeypatch.setitem(FAMILIES, "llama", LogitFacts(softcap_attr="final_logit_softcapping"))
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(**SIZES))
    ref.config.final_logit_softcapping = 0.5  # would visibly change the logits if applied
    check_equal(ref, apply_patch(twin(ref)))
    monkeypatch.setitem(FAMILIES, "llama", LogitFacts(multiply_attr="logit_scale", scale_owner=""))
    ref.config.logit_scale = 3.0
    check_equal(ref, apply_patch(twin(ref)))


class _AuxLossLlama(LlamaForCausalLM):
    """A user subclass of a listed family whose forward adds to the loss: the fused forward would skip it."""

    def forward(self, input_ids=None, labels=None, **kwargs) -> CausalLMOutputWithPast:
        out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
        if out.loss is not None:
            out.loss = out.loss + self.model.embed_tokens.weight.square().sum()  # e.g. a regulariser
        return out


class _LoggingLlama(LlamaForCausalLM):
    """A subclass whose forward override changes nothing the loss or logits see."""

    def forward(self, input_ids=None, **kwargs) -> CausalLMOutputWithPast:
        return super().forward(input_ids=input_ids, **kwargs)


def test_overridden_forward_of_a_listed_family_is_verified():
    torch.manual_seed(0)
    cfg = LlamaConfig(**SIZES)
    with pytest.raises(UnsupportedModelError, match="_AuxLossLlama.forward is defined outside transformers"):
        apply_patch(_AuxLossLlama(cfg))
    torch.manual_seed(0)
    ref = _LoggingLlama(cfg)
    check_equal(ref, apply_patch(twin(ref)))


def test_an_input_only_handed_to_the_decoder_is_not_dropped():
    """`name=name` into self.<decoder>(...) reaches the decoder's **kwargs in the generic forward too;
    the same name used any other way (or re-bound) is read by the original and counts as dropped."""
    from hf_mhce.patching.families import _handed_to

    class Model:
        def forward(self, kept=None, used=None, rebound=None, elsewhere=None, **kwargs):
            out = self.model(kept=kept, used=used, rebound=rebound, **kwargs)
            rebound = used * 2
            return self.other(elsewhere=elsewhere, out=out, rebound=rebound)

    assert _handed_to(Model.forward, frozenset({"model"})) == {"kept"}
    assert _handed_to(Model.forward, frozenset({"other"})) == {"elsewhere"}
    assert _handed_to(len, frozenset({"model"})) == frozenset()  # no source: nothing counts as handed on
