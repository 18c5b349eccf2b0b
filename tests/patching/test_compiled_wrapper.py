"""A patched model inside ``torch.compile``'s wrapper (OptimizedModule: the README's order, patch then
compile; accelerate's dynamo_backend makes the same wrapper): the wrapper reads as patched, ``unpatch``
of it unpatches the model it holds, and evaluation counts ranks through it."""

import pytest
import torch
from patching_models import batch, make_model, token_dataset, twin
from transformers import Trainer, TrainingArguments

from hf_mhce import RBECallback, apply_patch, unpatch
from hf_mhce.patching import CONFIG_KEY, is_patched
from hf_mhce.rbe import evaluate


def _compiled_mhce():
    plain = make_model("llama")
    inner = apply_patch(twin(plain), loss="mhce", num_heads=2)
    torch._dynamo.reset()
    return plain, inner, torch.compile(inner, backend="eager")


def test_unpatch_of_the_wrapper_restores_plain_cross_entropy():
    plain, inner, compiled = _compiled_mhce()
    ids, labels = batch()
    assert is_patched(compiled)
    mhce = compiled(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(mhce, inner(input_ids=ids, labels=labels).loss)
    assert not torch.allclose(mhce, plain(input_ids=ids, labels=labels).loss)  # MHCE is not CE here

    assert unpatch(compiled) is compiled
    assert not is_patched(compiled) and not is_patched(inner)
    assert not hasattr(inner.config, CONFIG_KEY)
    torch.testing.assert_close(compiled(input_ids=ids, labels=labels).loss, plain(input_ids=ids, labels=labels).loss)


def test_evaluate_and_the_callback_see_through_the_wrapper(tmp_path):
    _, inner, compiled = _compiled_mhce()
    rows = [r["input_ids"].tolist() for r in token_dataset(4, seed=3)]
    want = evaluate(inner, rows).decomposition
    assert evaluate(compiled, rows).decomposition == pytest.approx(want)

    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=2, use_cpu=True, report_to="none",
                             disable_tqdm=True, save_strategy="no",
                             remove_unused_columns=False)  # the wrapper's forward(*args, **kwargs) names no column
    metrics = {}
    for name, model in (("eager", inner), ("compiled", compiled)):
        trainer = Trainer(model=model, args=args, eval_dataset=token_dataset(4, seed=3), callbacks=[RBECallback()])
        metrics[name] = {k: v for k, v in trainer.evaluate().items() if "_rbe_" in k}
    assert metrics["eager"]["eval_rbe_num_tokens"] > 0
    assert metrics["compiled"] == pytest.approx(metrics["eager"])


def test_unpatch_of_a_compiled_peft_model_removes_what_the_peft_model_held():
    from peft import LoraConfig, get_peft_model

    peft = apply_patch(get_peft_model(make_model("llama"), LoraConfig(r=2, target_modules=["q_proj"])), loss="ce")
    assert "save_pretrained" in peft.__dict__
    torch._dynamo.reset()
    unpatch(torch.compile(peft, backend="eager"))
    assert not is_patched(peft) and "save_pretrained" not in peft.__dict__ and not peft._forward_pre_hooks
