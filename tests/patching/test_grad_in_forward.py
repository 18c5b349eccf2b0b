"""A patched model on the Triton backend (kernels through the interpreter) computes its head's gradients in
the forward: loss and every gradient as the unpatched model's, through Trainer's gradient accumulation
and loss scaling too; and the same as the recompute schedule (HF_MHCE_GRAD_IN_FORWARD=0)."""

import pytest
import torch
from patching_models import FAMILIES, assert_grads_close, batch, grads, make_model, token_dataset, twin
from reference import requires_triton
from transformers import Trainer, TrainingArguments

from hf_mhce.patching import apply_patch

pytestmark = requires_triton


@pytest.fixture
def schedule(monkeypatch):
    """Which schedule each fused loss took: True where its gradients came from the forward."""
    from hf_mhce.ops import triton_forward_grad

    taken = []
    real = triton_forward_grad.forward_with_grads

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(triton_forward_grad, "forward_with_grads", spy)
    monkeypatch.delenv("HF_MHCE_WORKSPACE_MB", raising=False)
    monkeypatch.delenv("HF_MHCE_GRAD_IN_FORWARD", raising=False)
    return taken


def _step(model, scale=1.0, **inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    (loss * scale).backward()
    return loss.detach(), grads(model)


@pytest.mark.parametrize("family,tied", [(f, False) for f in FAMILIES] + [("llama", True)],
                         ids=[*FAMILIES, "llama-tied"])
def test_patched_model_matches_unpatched(family, tied, schedule):
    ref = make_model(family, tied=tied)
    model = apply_patch(twin(ref), backend="triton")
    ids, labels = batch()
    for scale, extra in ((1.0, {}), (3.0, {"num_items_in_batch": torch.tensor(7)})):
        want_loss, want = _step(ref, scale, input_ids=ids, labels=labels, **extra)
        got_loss, got = _step(model, scale, input_ids=ids, labels=labels, **extra)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=0)
        assert_grads_close(want, got)
    assert schedule == [True, True]


def test_mhce_same_as_the_recompute_schedule(schedule, monkeypatch):
    model = apply_patch(make_model("llama"), loss="mhce", num_heads=4, backend="triton")
    ids, labels = batch()
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("HF_MHCE_GRAD_IN_FORWARD", flag)
        runs[flag] = _step(model, 2.0, input_ids=ids, labels=labels)
    assert schedule == [True, False]
    torch.testing.assert_close(runs["1"][0], runs["0"][0], rtol=1e-6, atol=0)
    assert_grads_close(runs["0"][1], runs["1"][1])


def test_trainer_with_accumulation_matches_unpatched(schedule, tmp_path):
    data = token_dataset(16, ragged=True)
    ref = make_model("llama")
    model = apply_patch(twin(ref), backend="triton")
    logs = []
    for name, m in (("ref", ref), ("patched", model)):
        args = TrainingArguments(
            output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
            learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", seed=0,
            data_seed=0, disable_tqdm=True, dataloader_num_workers=0, warmup_steps=0,
            optim="sgd", max_grad_norm=0.0,  # steps proportional to the gradients: a wrong scale shows
        )
        trainer = Trainer(model=m, args=args, train_dataset=data)
        trainer.train()
        logs.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert len(schedule) == 6 and all(schedule)  # 3 steps x 2 micro-batches
    torch.testing.assert_close(torch.tensor(logs[1]), torch.tensor(logs[0]), rtol=1e-4, atol=0)
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-3, atol=1e-5, msg=lambda m: f"{n}: {m}")
