"""loss="ce": the patched model is the unpatched model (loss, every gradient, logits, generation)."""

import inspect
import warnings

import pytest
import torch
from patching_models import FAMILIES, assert_grads_close, batch, grads, make_model, twin
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions, CausalLMOutputWithPast

import hf_mhce
from hf_mhce.patching import apply_patch, is_patched, unpatch

CASES = [(f, False) for f in FAMILIES] + [("llama", True)]


def _loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, grads(model)


@pytest.mark.parametrize("family,tied", CASES, ids=[f + ("-tied" if t else "") for f, t in CASES])
def test_loss_and_all_gradients_match(family, tied):
    ref = make_model(family, tied=tied)
    model = apply_patch(twin(ref), loss="ce")
    ids, labels = batch()
    ref_out, ref_grads = _loss_and_grads(ref, input_ids=ids, labels=labels)
    out, got = _loss_and_grads(model, input_ids=ids, labels=labels)
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-5, atol=0)
    assert out.logits is None
    assert_grads_close(ref_grads, got)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_tied_head_gets_one_gradient(family):
    ref = make_model(family, tied=True)
    model = apply_patch(twin(ref))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    ids, labels = batch()
    _, ref_grads = _loss_and_grads(ref, input_ids=ids, labels=labels)
    _, got = _loss_and_grads(model, input_ids=ids, labels=labels)
    # named_parameters lists the shared weight once; its gradient holds both uses, counted once
    shared = [n for n in got if "wte" in n or "embed_tokens" in n]
    assert len(shared) == 1 and not any("lm_head" in n for n in got)
    assert_grads_close(ref_grads, got)


@pytest.mark.parametrize("family", FAMILIES)
def test_num_items_in_batch_and_shift_labels(family):
    ref = make_model(family)
    model = apply_patch(twin(ref))
    ids, labels = batch()
    n = torch.tensor(7)
    a = ref(input_ids=ids, labels=labels, num_items_in_batch=n).loss
    b = model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
    torch.testing.assert_close(b, a, rtol=1e-5, atol=0)
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    shift[1, 1] = -100  # so that a loss from labels would differ from one from shift_labels
    c = model(input_ids=ids, labels=labels, shift_labels=shift).loss
    torch.testing.assert_close(c, ref(input_ids=ids, labels=labels, shift_labels=shift).loss, rtol=1e-5, atol=0)
    assert not torch.allclose(c, ref(input_ids=ids, labels=labels).loss)
    alone, stock = model(input_ids=ids, shift_labels=shift), ref(input_ids=ids, shift_labels=shift)
    assert alone.loss is None and stock.loss is None  # as in transformers: no labels, no loss
    torch.testing.assert_close(alone.logits, stock.logits)
    custom = labels.masked_fill(labels == -100, 5)
    d = model(input_ids=ids, labels=custom, ignore_index=5).loss
    e = ref(input_ids=ids, labels=custom, ignore_index=5).loss
    torch.testing.assert_close(d, e, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint64, torch.int32])
def test_labels_of_any_integer_dtype(dtype):
    """Unsigned labels: padding them with ignore_index -100 failed in F.pad (as in transformers' own loss);
    they are read as int64 first, and a uint64 label that int64 would wrap (2**64 - 100 to -100) is refused."""
    ref = make_model("llama")
    model = apply_patch(twin(ref))
    ids, labels = batch(pad_first=0)
    want = ref(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(model(input_ids=ids, labels=labels.to(dtype)).loss, want, rtol=1e-5, atol=0)
    shift = torch.nn.functional.pad(labels, (0, 1), value=7)[..., 1:].contiguous()
    torch.testing.assert_close(model(input_ids=ids, shift_labels=shift.to(dtype), labels=labels).loss,
                               ref(input_ids=ids, shift_labels=shift, labels=labels).loss, rtol=1e-5, atol=0)
    if dtype == torch.uint64:
        values = labels.tolist()
        values[0][4] = 2**64 - 100
        with pytest.raises(ValueError, match="label 18446744073709551516 is outside the vocabulary"):
            model(input_ids=ids, labels=torch.tensor(values, dtype=dtype))
        # labels beside shift_labels are not read (as in transformers): not refused either
        torch.testing.assert_close(model(input_ids=ids, labels=torch.tensor(values, dtype=dtype), shift_labels=shift).loss,
                                   ref(input_ids=ids, labels=labels, shift_labels=shift).loss, rtol=1e-5, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_outputs_and_signature(family):
    ref = make_model(family).eval()
    model = apply_patch(twin(ref))
    ids, labels = batch()
    expected_type = CausalLMOutputWithCrossAttentions if family == "gpt2" else CausalLMOutputWithPast
    with torch.no_grad():
        r = ref(input_ids=ids, output_hidden_states=True, output_attentions=True)
        o = model(input_ids=ids, output_hidden_states=True, output_attentions=True)
        assert type(o) is expected_type
        torch.testing.assert_close(o.logits, r.logits, rtol=0, atol=0)
        assert len(o.hidden_states) == len(r.hidden_states) and len(o.attentions) == len(r.attentions)
        cache = "cache" if "cache" in type(o).__dataclass_fields__ else "past_key_values"  # transformers >= 5.24: cache
        assert getattr(o, cache) is not None and type(getattr(o, cache)) is type(getattr(r, cache))
        # logits_to_keep as generate() uses it
        torch.testing.assert_close(model(ids, logits_to_keep=1).logits, ref(ids, logits_to_keep=1).logits)
        # asked-for logits next to the fused loss; tuples as with return_dict=False
        both = model(input_ids=ids, labels=labels, return_logits=True)
        torch.testing.assert_close(both.logits, r.logits)
        torch.testing.assert_close(both.loss, ref(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=0)
        as_tuple = model(ids, return_dict=False, use_cache=False)
        torch.testing.assert_close(as_tuple[0], r.logits)
    # generate() and Trainer read the signature: the original parameters are all there
    original = set(inspect.signature(type(ref).forward).parameters) - {"self"}
    assert original <= set(inspect.signature(model.forward).parameters)
    assert model._supports_logits_to_keep()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_identical(family):
    ref = make_model(family).eval()
    model = apply_patch(twin(ref))
    ids, _ = batch(seq=5)
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


def test_per_instance_idempotent_and_unpatch_exact():
    a, b = make_model("llama"), make_model("llama")
    assert apply_patch(a) is a
    assert is_patched(a) and not is_patched(b)
    assert "forward" not in b.__dict__ and b.forward.__func__ is type(b).forward
    patched_forward = a.forward
    apply_patch(a, label_smoothing=0.1)  # re-patch: options updated, the forward is not re-wrapped
    assert a.forward is patched_forward and a.config.hf_mhce["label_smoothing"] == 0.1
    apply_patch(a)  # no arguments: keeps the current options
    assert a.config.hf_mhce["label_smoothing"] == 0.1
    unpatch(a)
    assert "forward" not in a.__dict__ and a.forward.__func__ is type(a).forward
    assert not hasattr(a.config, "hf_mhce") and not is_patched(a)
    unpatch(a)  # no-op on an unpatched model


def test_accelerate_hook_kept():
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module

    ref = make_model("llama").eval()
    model = twin(ref)
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True))
    hooked = model.forward
    apply_patch(model)
    assert model.forward is hooked  # the hook stays outermost; we replaced what it calls
    ids, labels = batch()
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss)
    unpatch(model)
    assert model._old_forward.__func__ is type(model).forward  # what the hook calls is the original again
    remove_hook_from_module(model)


def test_top_level_exports():
    assert hf_mhce.apply_patch is apply_patch and hf_mhce.unpatch is unpatch
    assert callable(hf_mhce.from_pretrained)


@pytest.mark.parametrize("num_items", [None, 0, 7])
def test_all_ignored_batch(num_items):
    """HF's loss of a batch without targets is 0/0 = NaN (0 / count with a count of a larger batch),
    and the Trainer's evaluation leaves NaN batches out of eval_loss: the same values, with zero
    gradients where HF's would be NaN."""
    ref = make_model("llama")
    model = apply_patch(twin(ref))
    ids, _ = batch()
    labels = torch.full_like(ids, -100)
    kw = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    want = ref(input_ids=ids, labels=labels, **kw).loss
    loss = model(input_ids=ids, labels=labels, **kw).loss
    torch.testing.assert_close(loss, want, equal_nan=True)
    assert loss.isnan() == (num_items in (None, 0))
    loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_tuple_output_keeps_hf_positions():
    """return_dict=False with labels: HF's tuple is (loss, logits, past_key_values); code unpacking it
    by position must not get the cache for the logits.  The logits are built (one warning says so and
    how to skip them); return_logits=False leaves them out, as None fields are."""
    ref = make_model("llama")
    model = apply_patch(twin(ref))
    ids, _ = batch()
    kw = {"return_dict": False}
    want = ref(input_ids=ids, labels=ids, **kw)
    with pytest.warns(UserWarning, match="return_dict=False with labels builds"):
        got = model(input_ids=ids, labels=ids, **kw)
    assert len(got) == len(want) == 3
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per patch
        model(input_ids=ids, labels=ids, **kw)
        skipped = model(input_ids=ids, labels=ids, return_logits=False, use_cache=False, **kw)
    assert len(skipped) == 1 and skipped[0].dim() == 0


@pytest.mark.parametrize("loss", ["ce", "mhce"])
def test_torch_compile_gives_the_eager_results(loss):
    """torch.compile(model): dynamo traces the decoder and runs the fused loss as it is (no tracing
    into its checks and launches); loss, gradients and logits equal the uncompiled patched model's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    opts = {"loss": loss, "num_heads": 4 if loss == "mhce" else None}
    eager = apply_patch(make_model("llama"), **opts)
    model = apply_patch(make_model("llama"), **opts)
    compiled = torch.compile(model, backend="eager")
    ids, labels = batch()
    want, want_grads = _loss_and_grads(eager, input_ids=ids, labels=labels)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(input_ids=ids, labels=labels)
    # dynamo warns of possible silent incorrectness at an lru_cache-wrapped call it traces
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message)[:200] for w in caught]
    got.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=0)
    assert_grads_close(want_grads, grads(model))
    breaks = list(counters["graph_break"])
    assert breaks and all("torch.compiler.disable" in reason for reason in breaks), breaks  # only the one we chose
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).logits, eager(input_ids=ids).logits)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gradient_checkpointing_matches_unpatched(family):
    ref = make_model(family)
    model = apply_patch(twin(ref))
    for m in (ref, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
    ids, labels = batch()
    ref_out, ref_grads = _loss_and_grads(ref, input_ids=ids, labels=labels, use_cache=False)
    out, got = _loss_and_grads(model, input_ids=ids, labels=labels, use_cache=False)
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-5, atol=0)
    assert_grads_close(ref_grads, got)


def test_torch_compile_of_a_forward_without_labels_is_one_graph():
    """A model with options the Trainer's own loss would drop (here ignore_index=-1) checks for that Trainer in
    a forward without labels, by reading Python frames: compiled in evaluation (generation), that check cut the
    graph in two at every call, and torch.compile(fullgraph=True) failed."""
    model = apply_patch(make_model("llama"), ignore_index=-1).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    ids, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits)
