"""Trainer: patched runs follow the unpatched ones; MHCE trains and evaluates; gradient accumulation."""

import math

import pytest
import torch
from patching_models import FAMILIES, make_model, token_dataset, twin
from transformers import Trainer, TrainingArguments

from hf_mhce.patching import apply_patch


def _train(model, tmp_path, data, *, steps=20, batch_size=4, accumulation=1, lr=1e-3, eval_data=None,
           scheduler="linear"):
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=8, gradient_accumulation_steps=accumulation, learning_rate=lr,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", seed=0, data_seed=0,
        disable_tqdm=True, dataloader_num_workers=0, warmup_steps=0, lr_scheduler_type=scheduler,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=eval_data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == steps
    return trainer, losses


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_matches_unpatched(family, tmp_path):
    data = token_dataset(32, ragged=True)
    ref = make_model(family)
    model = apply_patch(twin(ref))
    _, ref_losses = _train(ref, tmp_path / "ref", data)
    trainer, losses = _train(model, tmp_path / "patched", data)
    assert trainer.model_accepts_loss_kwargs  # so num_items_in_batch reaches the fused loss
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-3, atol=1e-5, msg=lambda m: f"{n}: {m}")


def test_mhce_trainer_learns_and_evaluates(tmp_path):
    data = token_dataset(32)
    model = apply_patch(make_model("llama"), loss="mhce", num_heads=4)
    trainer, losses = _train(model, tmp_path, data, steps=30, lr=1e-2, scheduler="constant", eval_data=token_dataset(8, seed=5))
    assert sum(losses[-3:]) / 3 < 0.75 * sum(losses[:3]) / 3, losses
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] < losses[0]
    # evaluate() agrees with the model's own loss on the eval rows
    model.eval()
    rows = token_dataset(8, seed=5)
    ids = torch.stack([r["input_ids"] for r in rows])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=torch.stack([r["labels"] for r in rows])).loss
    assert metrics["eval_loss"] == pytest.approx(loss.item(), rel=1e-5)
    # asking for logits (e.g. for compute_metrics) gives the mixture log-probs to predict()
    apply_patch(model, return_logits=True)
    pred = trainer.predict(rows)
    assert pred.predictions.shape == (8, 16, model.config.vocab_size)
    assert abs(float(torch.tensor(pred.predictions).exp().sum(-1).mean()) - 1.0) < 1e-4


@pytest.mark.parametrize("loss", ["ce", "mhce"])
def test_gradient_accumulation_equivalence(loss, tmp_path):
    data = token_dataset(32, ragged=True)  # micro-batches hold different numbers of targets
    opts = {"loss": loss, "num_heads": 4} if loss == "mhce" else {"loss": "ce"}
    big = apply_patch(make_model("llama"), **opts)
    accumulated = apply_patch(make_model("llama"), **opts)
    _, big_losses = _train(big, tmp_path / "big", data, batch_size=4, accumulation=1)
    _, acc_losses = _train(accumulated, tmp_path / "acc", data, batch_size=2, accumulation=2)
    torch.testing.assert_close(torch.tensor(acc_losses), torch.tensor(big_losses), rtol=1e-5, atol=0)
    for (n, p), (_, q) in zip(big.named_parameters(), accumulated.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_trainer_with_peft_lora_on_lm_head(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = apply_patch(make_model("llama"), loss="mhce", num_heads=4)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "lm_head"]))
    head_b = model.get_base_model().lm_head.lora_B["default"].weight
    assert head_b.abs().sum() == 0  # PEFT initialises B to zero
    trainer, losses = _train(model, tmp_path, token_dataset(32), steps=20, lr=1e-2, scheduler="constant")
    assert trainer.model_accepts_loss_kwargs
    assert head_b.abs().sum() > 0  # the head adapter was trained through the fused loss
    assert losses[-1] < losses[0]
