"""What the fused path does with things attached to the head's call, and with a custom loss function.

The fused loss reads lm_head's weight instead of calling lm_head: pre-hooks that recompute the
weight (prune, the old weight_norm) must run as the call would run them; whatever needs the logits
(forward hooks, a Linear subclass's own forward, a custom loss_function) must be refused, never skipped.
"""

from __future__ import annotations

import pytest
import torch
from patching_models import assert_grads_close, batch, grads, make_model, mixture_logprobs_reference, twin
from torch import nn
from torch.nn.utils import prune
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

import hf_mhce
from hf_mhce.patching.families import UnsupportedModelError, custom_loss_function
from hf_mhce.patching.head import UnsupportedHeadError


def sgd_losses(model, steps=3, lr=0.5):
    """Losses of a few SGD steps on one batch (a stale recomputed weight shows from the second on)."""
    ids, labels = batch()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, grads(model)


def pruned(family):
    model = make_model(family)
    if family == "gpt2":  # untie so that the pruned head is not the embedding too
        model.config.tie_word_embeddings = False
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    prune.l1_unstructured(model.lm_head, "weight", amount=0.5)
    return model


def weight_normed():
    model = make_model("llama")
    torch.nn.utils.weight_norm(model.lm_head)
    return model


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pruned_head_trains_like_unpatched(family):
    """prune recomputes weight = weight_orig * mask in a pre-hook; skipping it trained on a stale
    tensor and failed on the second backward ("backward through the graph a second time").
    (Such a model cannot be deep-copied: each side is built and pruned on its own.)"""
    ref, model = pruned(family), hf_mhce.apply_patch(pruned(family))
    want, want_grads = sgd_losses(ref)
    got, got_grads = sgd_losses(model)
    assert got == pytest.approx(want, rel=1e-5)
    assert_grads_close(want_grads, got_grads)
    with torch.no_grad():  # evaluation after weight_orig changed reads the new product, not the last one
        for m in (ref, model):
            m.lm_head.weight_orig.mul_(3)
        ids, labels = batch()
        torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss)


def test_old_weight_norm_and_mhce_mixture_see_the_recomputed_weight():
    ref, model = weight_normed(), hf_mhce.apply_patch(weight_normed())
    assert sgd_losses(model)[0] == pytest.approx(sgd_losses(ref)[0], rel=1e-5)
    mhce = hf_mhce.apply_patch(weight_normed(), loss="mhce", num_heads=4)
    with torch.no_grad():
        head = mhce.lm_head
        head.weight_g.mul_(0.5)  # takes effect only through the pre-hook
        ids, _ = batch()
        got = mhce(input_ids=ids).logits
        hidden = mhce.model(input_ids=ids).last_hidden_state
        weight = head.weight_v * (head.weight_g / head.weight_v.norm(dim=1, keepdim=True))
    torch.testing.assert_close(got.double(), mixture_logprobs_reference(hidden, weight, 4), rtol=1e-5, atol=1e-5)


def test_side_effect_pre_hook_runs_once_per_fused_call():
    model = hf_mhce.apply_patch(make_model("llama"), loss="mhce", num_heads=2)
    seen = []
    model.lm_head.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    model.lm_head.register_forward_pre_hook(lambda m, args, kwargs: (args, kwargs), with_kwargs=True)  # unchanged
    ids, labels = batch()
    model(input_ids=ids, labels=labels)
    model(input_ids=ids)
    assert seen == [torch.Size([2, 12, 32])] * 2


@pytest.mark.parametrize("loss", ["ce", "mhce"])
def test_forward_hook_on_head_is_refused(loss):
    def ban_token_7(module, args, out):
        return out.index_fill(-1, torch.tensor([7]), float("-inf"))

    heads = 2 if loss == "mhce" else 1
    ref = make_model("llama")
    ref.lm_head.register_forward_hook(ban_token_7)
    with pytest.raises(UnsupportedModelError, match="hooks .*ban_token_7.*never builds the head's output"):
        hf_mhce.apply_patch(twin(ref), loss=loss, num_heads=heads)
    model = hf_mhce.apply_patch(make_model("llama"), loss=loss, num_heads=heads)
    handle = model.lm_head.register_forward_hook(ban_token_7)  # added after the patch: refused at the forward
    ids, labels = batch()
    with pytest.raises(UnsupportedHeadError, match="ban_token_7"):
        model(input_ids=ids, labels=labels)
    if loss == "mhce":  # the mixture is computed from the weights too
        with pytest.raises(UnsupportedHeadError, match="ban_token_7"):
            model(input_ids=ids)
    else:  # CE logits come from the head's own call: the hook applies, as unpatched
        assert model(input_ids=ids).logits[..., 7].eq(float("-inf")).all()
    handle.remove()
    assert model(input_ids=ids, labels=labels).loss.isfinite()


def test_pre_hook_that_changes_the_input_is_refused():
    model = hf_mhce.apply_patch(make_model("llama"))
    model.lm_head.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    ids, labels = batch()
    with pytest.raises(UnsupportedHeadError, match="pre-hook .* changes the head's input"):
        model(input_ids=ids, labels=labels)


def test_linear_subclass_with_its_own_forward_is_refused():
    class Halved(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 0.5

    class Plain(nn.Linear):  # no forward of its own: accepted
        pass

    def head(cls, model):
        new = cls(model.config.hidden_size, model.config.vocab_size, bias=False)
        new.weight = model.lm_head.weight
        return new

    model = make_model("llama")
    model.lm_head = head(Halved, model)
    with pytest.raises(UnsupportedModelError, match="Halved, an nn.Linear subclass with a forward of its own"):
        hf_mhce.apply_patch(model)
    model = hf_mhce.apply_patch(make_model("llama"))
    ids, labels = batch()
    model.set_output_embeddings(head(Plain, model))
    assert model(input_ids=ids, labels=labels).loss.isfinite()
    model.set_output_embeddings(head(Halved, model))
    with pytest.raises(UnsupportedHeadError, match="forward of its own"):
        model(input_ids=ids, labels=labels)


@pytest.mark.parametrize("loss", ["ce", "mhce"])
def test_head_of_the_wrong_width_names_both_sizes(loss):
    model = hf_mhce.apply_patch(make_model("llama"), loss=loss, num_heads=2 if loss == "mhce" else 1)
    model.set_output_embeddings(nn.Linear(40, 97, bias=False))
    ids, labels = batch()
    for kwargs in ({"labels": labels}, {}) if loss == "mhce" else ({"labels": labels},):
        with pytest.raises(ValueError, match=r"weight has shape \(97, 40\), but the hidden states .* size 32"):
            model(input_ids=ids, **kwargs)


def doubled(logits, labels, vocab_size, **kwargs):
    return 2 * ForCausalLMLoss(logits, labels, vocab_size, **kwargs)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_stock_models_have_the_stock_loss(family):
    assert custom_loss_function(make_model(family)) is None


def test_custom_loss_function_is_refused_not_replaced(monkeypatch):
    ref = make_model("llama")
    ref.loss_function = doubled
    with pytest.raises(UnsupportedModelError, match="loss_function is 'doubled'"):
        hf_mhce.apply_patch(twin(ref))
    model = hf_mhce.apply_patch(make_model("llama"))
    ids, labels = batch()
    model.loss_function = doubled  # set after the patch: refused at the first forward with labels
    with pytest.raises(UnsupportedModelError, match="not transformers' ForCausalLMLoss"):
        model(input_ids=ids, labels=labels)
    assert model(input_ids=ids).loss is None  # without labels no loss is involved: generation still works
    del model._loss_function
    assert model(input_ids=ids, labels=labels).loss.isfinite()
    monkeypatch.setitem(LOSS_MAPPING, "Doubled", doubled)
    model.loss_type = "Doubled"  # the other way transformers chooses a loss
    with pytest.raises(UnsupportedModelError, match="'doubled'"):
        model(input_ids=ids, labels=labels)
    model.loss_type = "NoSuchLoss"  # transformers falls back to ForCausalLMLoss then
    assert model(input_ids=ids, labels=labels).loss.isfinite()


def test_labels_of_another_shape_are_named():
    model = hf_mhce.apply_patch(make_model("llama"))
    ids, labels = batch(batch_size=1)
    with pytest.raises(ValueError, match=r"labels has shape \(12,\), but the input has shape \(1, 12\).*labels\[None\]"):
        model(input_ids=ids, labels=labels[0])
    with pytest.raises(ValueError, match=r"shift_labels has shape \(1, 11\)"):
        model(input_ids=ids, labels=labels, shift_labels=labels[:, 1:])


def test_backward_hooks_and_accelerate_hooks_on_the_head_are_refused():
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Scale(ModelHook):
        def post_forward(self, module, output):
            return output * 2

    model = hf_mhce.apply_patch(make_model("llama"))
    ids, labels = batch()
    handle = model.lm_head.register_full_backward_hook(lambda m, grad_in, grad_out: None)
    with pytest.raises(UnsupportedHeadError, match="around its output or its gradient"):
        model(input_ids=ids, labels=labels)
    handle.remove()
    add_hook_to_module(model.lm_head, Scale())  # replaces lm_head.forward: no torch hook dictionary shows it
    with pytest.raises(UnsupportedHeadError, match="Scale"):
        model(input_ids=ids, labels=labels)


@pytest.mark.parametrize("loss", ["ce", "mhce"])
def test_a_forward_put_on_the_head_instance_is_refused(loss):
    """``lm_head.forward = f`` (what TRL's cast_lm_head_to_fp32 does, tested in test_trl.py) is never called by
    the fused loss: any other such forward is refused at apply_patch and at the call, not skipped; a forward
    accelerate's hooks leave behind (the class's own, bound) is fine."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module

    def doubled_head(model):
        def forward(x):
            return nn.functional.linear(x, model.lm_head.weight) * 2

        return forward

    options = dict(loss=loss, num_heads=2 if loss == "mhce" else None)
    model = make_model("llama")
    model.lm_head.forward = doubled_head(model)
    with pytest.raises(UnsupportedModelError, match="forward was replaced on the instance by .*doubled_head"):
        hf_mhce.apply_patch(model, **options)
    model = hf_mhce.apply_patch(make_model("llama"), **options)
    ids, labels = batch()
    want = model(input_ids=ids, labels=labels).loss
    add_hook_to_module(model.lm_head, AlignDevicesHook(execution_device="cpu"))  # calls the class's forward
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, want, rtol=0, atol=0)
    remove_hook_from_module(model.lm_head)
    assert "forward" in model.lm_head.__dict__  # accelerate leaves the class's forward, bound, on the instance
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, want, rtol=0, atol=0)
    model.lm_head.forward = doubled_head(model)
    with pytest.raises(UnsupportedHeadError, match="forward was replaced on the instance"):
        model(input_ids=ids, labels=labels)
