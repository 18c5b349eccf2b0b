"""PEFT: LoRA on attention/MLP, LoRA on lm_head (exact A/B gradients), modules_to_save."""

import contextlib

import pytest
import torch
from patching_models import (assert_grads_close, batch, grads, make_model, mixture_logprobs_reference, saved_base,
                            with_lora)
from peft import LoraConfig, get_peft_model

from hf_mhce.patching import UnsupportedModelError, apply_patch, is_patched, unpatch

LLAMA_TARGETS = ["q_proj", "v_proj", "gate_proj"]


def _lora(model, targets, **kw):
    return with_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                       lora_dropout=kw.pop("lora_dropout", 0.0), **kw))


def _step(model, ids, labels, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks in both models
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), grads(model)


@pytest.mark.parametrize("order", ["patch-then-peft", "peft-then-patch"])
@pytest.mark.parametrize("family,targets", [("llama", LLAMA_TARGETS), ("gpt2", ["c_attn"])])
def test_lora_attention(order, family, targets):
    kw = {"fan_in_fan_out": True} if family == "gpt2" else {}
    ref = _lora(make_model(family), targets, **kw)
    if order == "patch-then-peft":
        model = _lora(apply_patch(make_model(family)), targets, **kw)
    else:
        model = apply_patch(_lora(make_model(family), targets, **kw))
    assert is_patched(model)
    ids, labels = batch()
    ref_loss, ref_grads = _step(ref, ids, labels)
    loss, got = _step(model, ids, labels)
    assert any("lora_A" in n for n in got) and not any("q_proj.base_layer" in n for n in got)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert_grads_close(ref_grads, got)
    unpatch(model)
    assert not is_patched(model)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("order", ["patch-then-peft", "peft-then-patch"])
def test_lora_on_lm_head_exact_gradients(order, dropout):
    targets = ["q_proj", "lm_head"]
    ref = _lora(make_model("llama"), targets, lora_dropout=dropout, lora_bias=False)
    if order == "patch-then-peft":
        model = _lora(apply_patch(make_model("llama")), targets, lora_dropout=dropout)
    else:
        model = apply_patch(_lora(make_model("llama"), targets, lora_dropout=dropout))
    ids, labels = batch()
    ref_loss, ref_grads = _step(ref, ids, labels)
    loss, got = _step(model, ids, labels)
    head = [n for n in got if "lm_head.lora" in n]
    assert len(head) == 2  # A and B of the head adapter are trained...
    assert all(got[n].abs().sum() > 0 for n in head)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert_grads_close(ref_grads, got)  # ...with exactly the unpatched model's gradients
    with torch.no_grad():
        model.eval(), ref.eval()
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)


@pytest.mark.parametrize("loss", ["ce", "mhce"])
def test_lora_on_lm_head_leaves_frozen_base_weight_alone(loss, monkeypatch):
    """The adapter reaches the ops as their low-rank term: the base weight itself (no widened
    [V, D + H*r] copy) and no dW requested for it, only dU and dB of the adapter."""
    from hf_mhce.losses import dispatch

    seen = []
    real = dispatch.resolve

    def spy(*a, **k):
        ops = real(*a, **k)

        def backward(x, w, *args, low_rank=None):
            seen.append((w, args[9], low_rank))  # needs
            return ops.backward(x, w, *args, low_rank=low_rank)
        return type(ops)(**{**vars(ops), "backward": backward})

    monkeypatch.setattr(dispatch, "resolve", spy)
    heads = 2 if loss == "mhce" else 1
    model = apply_patch(_lora(make_model("llama"), ["q_proj", "lm_head"]), loss=loss, num_heads=heads)
    base = model.get_base_model().lm_head.base_layer.weight
    ids, labels = batch()
    _step(model, ids, labels)
    (w, needs, low_rank), = seen
    assert w.data_ptr() == base.data_ptr() and w.shape == base.shape
    assert needs == (True, False, False, True, True)  # dX, no dW, no bias; dU, dB
    assert low_rank[0].shape[-2:] == (heads, 4)


def test_lora_on_lm_head_with_mhce_and_disabled_adapter():
    model = apply_patch(_lora(make_model("llama"), ["lm_head"]), loss="mhce", num_heads=4)
    ids, labels = batch()
    head = model.get_base_model().lm_head
    eff = head.base_layer.weight + head.scaling["default"] * head.lora_B["default"].weight @ head.lora_A["default"].weight
    hidden = model.get_base_model().get_decoder()(input_ids=ids).last_hidden_state
    torch.testing.assert_close(model(input_ids=ids).logits.double(), mixture_logprobs_reference(hidden, eff, 4),
                               rtol=1e-5, atol=1e-5)
    loss = model(input_ids=ids, labels=labels).loss
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    valid = shift != -100
    ref = -mixture_logprobs_reference(hidden, eff, 4)[valid].gather(-1, shift[valid, None]).mean()
    lora = [head.lora_A["default"].weight, head.lora_B["default"].weight]
    got, want = torch.autograd.grad(loss, lora), torch.autograd.grad(ref, lora)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)
    with model.disable_adapter():  # the base head alone
        hidden = hidden.detach()
        torch.testing.assert_close(model(input_ids=ids).logits.double(),
                                   mixture_logprobs_reference(hidden, head.base_layer.weight, 4), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_in_modules_to_save(tied):
    def build(patch):
        m = make_model("llama", tied=tied)
        m = apply_patch(m) if patch else m
        return get_peft_model(m, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))

    ref, model = build(False), build(True)
    ids, labels = batch()
    ref_loss, ref_grads = _step(ref, ids, labels)
    loss, got = _step(model, ids, labels)
    trained = [n for n in got if "lm_head" in n]
    assert trained and all("modules_to_save" in n for n in trained)  # the trainable copy
    assert model.get_base_model().lm_head.original_module.weight.grad is None or tied
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert_grads_close(ref_grads, got)


@pytest.mark.parametrize("order", ["patch-then-peft", "peft-then-patch"])
def test_trainable_tokens_on_a_tied_head(order):
    """trainable_token_indices on a tied embedding wraps the head too (PEFT replaces those rows of the
    tied weight): they enter the fused loss as a low-rank term, with PEFT's loss, gradients and logits."""
    def build(patch, loss="ce", heads=1):
        m = make_model("llama", tied=True)
        m = apply_patch(m, loss=loss, num_heads=heads) if patch and order == "patch-then-peft" else m
        torch.manual_seed(1)
        m = get_peft_model(m, LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[3, 5, 7]))
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "trainable_tokens_delta" in n:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
        return apply_patch(m, loss=loss, num_heads=heads) if patch and order == "peft-then-patch" else m

    ref, model = build(False), build(True)
    ids, labels = batch()
    ref_loss, ref_grads = _step(ref, ids, labels)
    loss, got = _step(model, ids, labels)
    assert any("trainable_tokens_delta" in n for n in got)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert_grads_close(ref_grads, got)
    with torch.no_grad(), model.disable_adapter(), ref.disable_adapter():
        torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss)
    mhce = build(True, "mhce", 4).eval()
    head = mhce.get_base_model().lm_head.token_adapter
    hidden = mhce.get_base_model().get_decoder()(input_ids=ids).last_hidden_state
    torch.testing.assert_close(mhce(input_ids=ids).logits.double(), mixture_logprobs_reference(
        hidden, head.get_merged_weights(["default"]), 4), rtol=1e-5, atol=1e-5)


def test_peft_generate_and_unsupported_head_variant():
    ref = _lora(make_model("llama"), ["q_proj", "lm_head"]).eval()
    model = apply_patch(_lora(make_model("llama"), ["q_proj", "lm_head"])).eval()
    ids, _ = batch(seq=5)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(input_ids=ids, **kw), ref.generate(input_ids=ids, **kw))
    dora = get_peft_model(make_model("llama"), LoraConfig(r=4, target_modules=["lm_head"], use_dora=True))
    with pytest.raises(UnsupportedModelError, match="DoRA"):
        apply_patch(dora)


def test_other_tuners_on_the_head_are_refused_by_name():
    """Tuners whose head is not base + plain LoRA are refused when patched (never ignored, never a crash
    inside the forward): AdaLoRA subclasses LoraLayer but keeps SVD factors as Parameters."""
    from peft import AdaLoraConfig, IA3Config

    adalora = AdaLoraConfig(init_r=4, target_r=2, target_modules=["lm_head"], total_step=10)
    ia3 = IA3Config(target_modules=["lm_head"], feedforward_modules=["lm_head"])
    for config, name in ((adalora, r"peft\.tuners\.adalora\.layer\.SVDLinear.*plain LoRA only"),
                         (ia3, r"peft\.tuners\.ia3\.layer\.Linear")):
        with pytest.raises(UnsupportedModelError, match=name):
            apply_patch(get_peft_model(make_model("llama"), config))
        patched_first = apply_patch(make_model("llama"))
        wrapped = get_peft_model(patched_first, config)
        with pytest.raises(TypeError, match=name):  # UnsupportedHeadError, at the first forward
            wrapped(input_ids=batch()[0], labels=batch()[1])


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "lm_head"]])
def test_adapter_saved_alone_keeps_its_loss(tmp_path, targets):
    """PeftModel.save_pretrained writes no config.json: the MHCE config goes beside the adapter, and
    hf_mhce.from_pretrained(adapter_dir) gives back the same distribution (logits and loss)."""
    import hf_mhce
    from hf_mhce.patching.config import ADAPTER_CONFIG_FILE

    model = apply_patch(_lora(saved_base(tmp_path), targets), loss="mhce", num_heads=2, z_loss=1e-3).eval()
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / ADAPTER_CONFIG_FILE).is_file()
    assert not (tmp_path / "adapter" / "config.json").exists()  # PEFT's layout is unchanged

    loaded = hf_mhce.from_pretrained(tmp_path / "adapter").eval()
    assert is_patched(loaded) and type(loaded).__name__.startswith("Peft")
    assert loaded.get_base_model().config.hf_mhce["num_heads"] == 2
    assert loaded.get_base_model().config.hf_mhce["z_loss"] == 1e-3
    ids, labels = batch()
    with torch.no_grad():
        want, got = model(input_ids=ids), loaded(input_ids=ids)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(loaded(input_ids=ids, labels=labels).loss, model(input_ids=ids, labels=labels).loss)

    # Without hf_mhce.json (an adapter saved before hf_mhce patched it): the base's record, else CE.
    plain = _lora(saved_base(tmp_path / "again"), targets)
    plain.save_pretrained(tmp_path / "plain_adapter")
    assert not (tmp_path / "plain_adapter" / ADAPTER_CONFIG_FILE).exists()
    assert hf_mhce.from_pretrained(tmp_path / "plain_adapter").get_base_model().config.hf_mhce["loss"] == "ce"
    with pytest.raises(ValueError, match="override_saved"):  # the adapter's record guards like config.json's
        hf_mhce.from_pretrained(tmp_path / "adapter", loss="ce")


def test_named_adapters_each_keep_the_loss(tmp_path):
    """PEFT saves an adapter not named "default" in <dir>/<name>: hf_mhce.json goes there too (was: in <dir>
    only, so loading <dir>/<name> silently gave CE), and <dir> itself gets an error that names them."""
    import hf_mhce

    base = saved_base(tmp_path)
    torch.manual_seed(1)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "lm_head"]), adapter_name="code")
    model.add_adapter("chat", LoraConfig(r=2, target_modules=["v_proj"]))
    apply_patch(model, loss="mhce", num_heads=4).eval()
    model.save_pretrained(tmp_path / "adapters")
    ids, labels = batch()
    for name in ("code", "chat"):
        model.set_adapter(name)
        loaded = hf_mhce.from_pretrained(tmp_path / "adapters" / name).eval()
        assert loaded.get_base_model().config.hf_mhce["num_heads"] == 4
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids, labels=labels).loss, model(input_ids=ids, labels=labels).loss)
    with pytest.raises(ValueError, match=r"PEFT adapters in the subdirectories \['chat', 'code'\]"):
        hf_mhce.from_pretrained(tmp_path / "adapters")


def test_patched_before_get_peft_model_warns_until_the_peft_model_is_patched(tmp_path):
    """PEFT's save_pretrained is the PeftModel's: a model patched only before get_peft_model saves its
    adapter without hf_mhce.json.  The first forward says so (once); patching the PeftModel fixes it."""
    import warnings

    import hf_mhce
    from hf_mhce.patching.config import ADAPTER_CONFIG_FILE

    ids, labels = batch()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="hf_mhce")  # plain CE, default options: nothing lost, silent
        _lora(apply_patch(saved_base(tmp_path / "ce")), ["q_proj"])(input_ids=ids, labels=labels)

    model = _lora(apply_patch(saved_base(tmp_path / "mhce"), loss="mhce", num_heads=2), ["q_proj"])
    with pytest.warns(UserWarning, match=r"patched before get_peft_model.*apply_patch\(peft_model\)"):
        model(input_ids=ids, labels=labels)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="hf_mhce")
        model(input_ids=ids, labels=labels)  # once
    model.save_pretrained(tmp_path / "lost")
    assert not (tmp_path / "lost" / ADAPTER_CONFIG_FILE).exists()  # what the warning was about

    assert apply_patch(model) is model  # no arguments: the same config, now saved with the adapter
    model.save_pretrained(tmp_path / "kept")
    loaded = hf_mhce.from_pretrained(tmp_path / "kept")
    assert loaded.get_base_model().config.hf_mhce["loss"] == "mhce"
    assert loaded.get_base_model().config.hf_mhce["num_heads"] == 2


@pytest.mark.parametrize("loss,heads", [("ce", 1), ("mhce", 4)])
def test_mixed_adapter_batch_routes_each_row_through_its_adapter(loss, heads):
    """model(..., adapter_names=[...]) (PEFT's mixed-adapter inference) reaches LoRA layers through a
    forward pre-hook, which the fused ops, reading the head's weights, would bypass: each row group is
    now computed with its own adapter (was: the active adapter for every row, a silently wrong loss)."""
    def build():
        torch.manual_seed(1)
        model = get_peft_model(make_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]),
                               adapter_name="one")
        model.add_adapter("two", LoraConfig(r=2, lora_alpha=8, target_modules=["q_proj", "lm_head"]))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.2)
        return model.eval()

    names = ["two", "__base__", "one"]
    ids, labels = batch(batch_size=3)
    model = apply_patch(build(), loss=loss, num_heads=heads)
    with torch.no_grad():
        mixed = model(input_ids=ids, labels=labels, adapter_names=names).loss
        logits = model(input_ids=ids, adapter_names=names).logits
        active_only = model(input_ids=ids, labels=labels).loss  # what the bypassed hook used to give
        row_sums, row_logits = [], []
        for i, name in enumerate(names):  # each row alone, with its adapter active
            with contextlib.ExitStack() as stack:
                if name == "__base__":
                    stack.enter_context(model.disable_adapter())
                else:
                    model.set_adapter(name)
                row = dict(input_ids=ids[i:i + 1])
                row_sums.append(model(**row, labels=labels[i:i + 1], num_items_in_batch=1).loss)
                row_logits.append(model(**row).logits)
        count = (labels[:, 1:] != -100).sum()
        torch.testing.assert_close(mixed, sum(row_sums) / count, rtol=1e-5, atol=0)
        torch.testing.assert_close(logits, torch.cat(row_logits), rtol=1e-5, atol=1e-6)
        assert abs(mixed - active_only) > 1e-3  # the test can tell the routing apart
        if loss == "ce":  # and the unpatched PEFT model agrees
            ref = build()
            torch.testing.assert_close(mixed, ref(input_ids=ids, labels=labels, adapter_names=names).loss)


def _integration_refuses_installed_peft() -> str | None:
    """Why transformers' own PEFT integration cannot run here, if it cannot: transformers 5.24 asks for
    peft >= 0.22 (model.add_adapter raises its own ValueError), which the package index may not have yet."""
    import peft
    import transformers
    from packaging.version import Version
    from transformers.integrations import peft as integration

    needed = getattr(integration, "MIN_PEFT_VERSION", "0")
    if Version(peft.__version__) < Version(needed):
        return f"transformers {transformers.__version__}'s PEFT integration needs peft >= {needed}, installed {peft.__version__}"
    return None


@pytest.mark.parametrize("task_type", ["CAUSAL_LM", None])
def test_transformers_integrated_adapter_saved_alone_keeps_its_loss(tmp_path, task_type):
    """transformers' own PEFT integration (model.add_adapter) makes save_pretrained write the active
    adapter alone, without config.json: hf_mhce.json goes beside it (was: none, so the MHCE model came
    back as CE with other logits), and an adapter without a task_type, which PEFT's auto classes refuse,
    loads through transformers' integration."""
    import warnings

    import hf_mhce
    from hf_mhce.patching.config import ADAPTER_CONFIG_FILE

    refused = _integration_refuses_installed_peft()
    if refused:
        pytest.skip(refused)
    model = apply_patch(saved_base(tmp_path), loss="mhce", num_heads=4)
    torch.manual_seed(1)
    model.add_adapter(LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False, task_type=task_type))
    model.eval()
    ids, labels = batch()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="hf_mhce")  # no advice to patch a PeftModel: there is none
        with torch.no_grad():
            want, want_loss = model(input_ids=ids).logits, model(input_ids=ids, labels=labels).loss
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / ADAPTER_CONFIG_FILE).is_file()
    assert not (tmp_path / "adapter" / "config.json").exists()  # transformers' layout is unchanged
    assert "beside the adapter" in (tmp_path / "adapter" / "README.md").read_text()

    loaded = hf_mhce.from_pretrained(tmp_path / "adapter").eval()
    base = loaded.get_base_model() if hasattr(loaded, "get_base_model") else loaded
    assert is_patched(loaded) and base.config.hf_mhce["num_heads"] == 4
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(loaded(input_ids=ids, labels=labels).loss, want_loss)
    torch.testing.assert_close(want.exp().sum(-1), torch.ones(want.shape[:-1]))  # a mixture, not softmax(W x)


def test_lora_dropout_on_the_head_draws_one_mask_for_loss_and_logits():
    """With return_logits in training the loss and the logits read the head apart: both must use the
    one dropout mask the unpatched head call draws (and leave the generator where it leaves it)."""
    ref = _lora(make_model("llama"), ["q_proj", "lm_head"], lora_dropout=0.5).train()
    model = apply_patch(_lora(make_model("llama"), ["q_proj", "lm_head"], lora_dropout=0.5), return_logits=True).train()
    ids, labels = batch()
    outs = []
    for m in (ref, model):
        torch.manual_seed(0)
        outs.append((m(input_ids=ids, labels=labels), torch.rand(1)))
    (want, want_next), (got, got_next) = outs
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(got.logits, want.logits)
    assert torch.equal(got_next, want_next)
