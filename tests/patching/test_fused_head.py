"""TRL's fused-LM-head protocol answered by the patched forward: ``model(..., labels=..., fused_lm_head=True)``
gives per-token log p(label), entropy, top-1, log sum p^2 and mean logit under the model's own
distribution (the mixture for "mhce"), 0 where the label is -100, against float64 references from the
unpatched logits; the loss and the entropy carry gradients."""

import copy

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_mhce
from hf_mhce.patching.forward import STATE_ATTR

ALL = ("log_probs", "entropy", "is_top1", "log_sum_sq_probs", "mean_logits")
SIZES = dict(vocab_size=101, hidden_size=24, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=6)


def _model(family="llama"):
    torch.manual_seed(0)
    if family == "gemma2":  # soft-capped logits
        model = Gemma2ForCausalLM(Gemma2Config(**SIZES, final_logit_softcapping=3.0)).double()
    else:
        model = LlamaForCausalLM(LlamaConfig(**SIZES)).double()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked distributions: top-1 and the soft-cap matter
    return model


def _reference(model, ids, num_heads):
    """float64 per-token log-probabilities of the model's distribution (mixture of head softmaxes)."""
    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    w = model.lm_head.weight
    cap = getattr(model.config, "final_logit_softcapping", None)
    d = hidden.shape[-1] // num_heads
    heads = []
    for h in range(num_heads):
        z = hidden[..., h * d:(h + 1) * d] @ w[:, h * d:(h + 1) * d].T
        if cap:
            z = torch.tanh(z / cap) * cap
        heads.append(z.log_softmax(-1))
    lp = torch.logsumexp(torch.stack(heads), 0) - torch.log(torch.tensor(float(num_heads), dtype=torch.float64))
    one_head_logits = z if num_heads == 1 else None
    return lp, one_head_logits


@pytest.mark.parametrize("family,loss,num_heads", [("llama", "ce", 1), ("llama", "mhce", 2), ("gemma2", "ce", 1),
                                                   ("gemma2", "mhce", 4)])
def test_every_field_matches_the_model_distribution(family, loss, num_heads):
    ref_model = _model(family)
    model = hf_mhce.apply_patch(copy.deepcopy(ref_model), loss=loss, num_heads=num_heads)
    model.__dict__[STATE_ATTR].fused_head = {"outputs": ALL, "temperature": 1.0}
    ids = torch.randint(0, 101, (3, 7), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt
    labels[2, :] = -100  # a row with nothing to learn
    lp, z = _reference(ref_model, ids, num_heads)
    labels[1, 1:4] = lp.argmax(-1)[1, :3]  # some labels the model ranks first
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    target, mask = labels[:, 1:], labels[:, 1:] != -100
    want = lp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
    zero = torch.zeros((), dtype=torch.float64)
    torch.testing.assert_close(out.log_probs.double(), torch.where(mask, want, zero))
    torch.testing.assert_close(out.loss.double(), -want[mask].sum() / mask.sum())
    torch.testing.assert_close(out.label_mask, mask)
    torch.testing.assert_close(out.entropy.double(), torch.where(mask, -(lp.exp() * lp).sum(-1), zero))
    torch.testing.assert_close(out.is_top1, (lp.argmax(-1) == target) & mask)
    assert out.is_top1[1, :3].all() and not out.is_top1.all()  # the test can tell a wrong top-1
    torch.testing.assert_close(out.log_sum_sq_probs.double(), torch.where(mask, torch.logsumexp(2 * lp, -1), zero))
    mean = z.mean(-1) if num_heads == 1 else lp.mean(-1)  # a mixture's only logits are its log-probs
    torch.testing.assert_close(out.mean_logits.double(), torch.where(mask, mean, zero))

    # gradients of the loss and of the entropy (GRPO's entropy bonus), against autograd on the reference
    (out.loss + 0.3 * out.entropy.sum()).backward()
    lp_ref, _ = _reference(ref_model, ids, num_heads)
    want_ref = lp_ref.gather(-1, target.clamp(min=0)[..., None])[..., 0]
    (-want_ref[mask].sum() / mask.sum() + 0.3 * (-(lp_ref.exp() * lp_ref).sum(-1))[mask].sum()).backward()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_defaults_shift_labels_count_and_odd_sizes(monkeypatch):
    """TRL's default fields (log_probs only), pre-shifted labels, a count over a larger batch, one row of
    one token, and token blocks of one row each (HF_MHCE_CHUNK_MB tiny)."""
    monkeypatch.setenv("HF_MHCE_CHUNK_MB", "0.0001")
    ref_model = _model()
    model = hf_mhce.apply_patch(copy.deepcopy(ref_model), loss="mhce", num_heads=2)
    ids = torch.randint(0, 101, (2, 5), generator=torch.Generator().manual_seed(2))
    out = model(input_ids=ids, labels=ids, fused_lm_head=True, num_items_in_batch=torch.tensor(20))
    assert out.entropy is None and out.is_top1 is None and out.log_probs.shape == (2, 4)
    lp, _ = _reference(ref_model, ids, 2)
    want = lp.gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(out.loss.double(), -want.sum() / 20)
    model.__dict__[STATE_ATTR].fused_head = {"outputs": ALL, "temperature": 1.0}
    shifted = model(input_ids=ids, shift_labels=torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1), fused_lm_head=True)
    torch.testing.assert_close(shifted.log_probs[:, :-1].double(), want)
    torch.testing.assert_close(shifted.entropy[:, :-1].double(), -(lp.exp() * lp).sum(-1))
    assert shifted.log_probs.shape == (2, 5) and shifted.entropy[:, -1].eq(0).all()
    one = model(input_ids=ids[:1, :1], labels=ids[:1, :1], fused_lm_head=True)  # nothing to predict
    assert one.log_probs.shape == (1, 0) and one.loss.item() == 0


def test_options_it_cannot_honour_are_refused():
    model = hf_mhce.apply_patch(_model(), loss="mhce", num_heads=2)
    ids = torch.randint(0, 101, (1, 4))
    with pytest.raises(ValueError, match="needs labels"):
        model(input_ids=ids, fused_lm_head=True)
    model.__dict__[STATE_ATTR].fused_head = {"outputs": ("log_probs",), "temperature": 0.7}
    with pytest.raises(ValueError, match=r"temperature=0.7.*mixture of softmaxes"):
        model(input_ids=ids, labels=ids, fused_lm_head=True)
    smoothed = hf_mhce.apply_patch(_model(), label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"label_smoothing=0.1 .*silently"):
        smoothed(input_ids=ids, labels=ids, fused_lm_head=True)


def test_temperature_of_a_single_head():
    ref_model = _model()
    model = hf_mhce.apply_patch(copy.deepcopy(ref_model))
    model.__dict__[STATE_ATTR].fused_head = {"outputs": ("log_probs", "entropy"), "temperature": 0.5}
    ids = torch.randint(0, 101, (2, 6), generator=torch.Generator().manual_seed(3))
    out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    lp = (ref_model(input_ids=ids).logits[:, :-1] / 0.5).log_softmax(-1)
    torch.testing.assert_close(out.log_probs.double(), lp.gather(-1, ids[:, 1:, None])[..., 0])
    torch.testing.assert_close(out.entropy.double(), -(lp.exp() * lp).sum(-1))
