"""Trainer: patched runs follow the unpatched ones; MHCE trains and evaluates; gradient accumulation."""

import inspect
import math

import pytest
import torch
from patching_models import FAMILIES, batch, make_model, token_dataset, twin
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
    # predict() asks for predictions: it gets the mixture log-probs
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


def _eval_trainer(model, tmp_path, compute_metrics=None):
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to="none", use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0)
    return Trainer(model=model, args=args, eval_dataset=token_dataset(8, seed=5), compute_metrics=compute_metrics)


@pytest.mark.parametrize("loss", ["ce", "mhce"])
def test_compute_metrics_gets_the_models_logits(loss, tmp_path):
    """A Trainer with compute_metrics hands it the logits an unpatched model would return (for MHCE the
    mixture log-probs the patched model generates from); evaluate() without it builds none."""
    import hf_mhce.patching.forward as forward

    ref = make_model("llama")
    model = apply_patch(twin(ref), loss=loss, num_heads=4 if loss == "mhce" else None)
    rows = token_dataset(8, seed=5)
    ids = torch.stack([r["input_ids"] for r in rows])
    with torch.no_grad():
        expected = (ref if loss == "ce" else model.eval())(input_ids=ids).logits
    seen = []

    def metrics(pred):
        seen.append(pred.predictions)
        return {"top1": float((pred.predictions[:, :-1].argmax(-1) == pred.label_ids[:, 1:]).mean())}

    result = _eval_trainer(model, tmp_path, metrics).evaluate()
    assert "eval_top1" in result
    torch.testing.assert_close(torch.as_tensor(seen[0]), expected, rtol=1e-5, atol=1e-5)

    calls = []
    original = forward._logits
    monkey = pytest.MonkeyPatch()
    monkey.setattr(forward, "_logits", lambda *a: calls.append(1) or original(*a))
    try:
        plain = _eval_trainer(model, tmp_path).evaluate()  # loss only: no logits
        assert calls == [] and plain["eval_loss"] == pytest.approx(result["eval_loss"], rel=1e-6)
        apply_patch(model, return_logits=False)  # an explicit "never" wins over the Trainer's wish
        _eval_trainer(model, tmp_path).predict(rows)
        assert calls == []
        apply_patch(model, return_logits=None)  # back to "when the Trainer needs them"
        _eval_trainer(model, tmp_path).predict(rows)
        assert len(calls) == 2  # two batches of 4
    finally:
        monkey.undo()


def test_compute_metrics_with_replicas_in_threads(tmp_path):
    """nn.DataParallel (Trainer on several GPUs of one process) runs each replica's forward in a worker
    thread: the logits still reach compute_metrics.  Simulated on CPU by a Trainer that wraps the model in
    DataParallel, as it does on several GPUs (on CPU its forward is the model's), and runs the forward in a
    thread, as DataParallel's parallel_apply does."""
    import threading

    class ThreadedForward(Trainer):
        def _wrap_model(self, model, training=True, dataloader=None):
            return torch.nn.DataParallel(model)

        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            box = []
            worker = threading.Thread(target=lambda: box.append(super(ThreadedForward, self).compute_loss(
                model, inputs, return_outputs=return_outputs, **kw)))
            worker.start()
            worker.join()
            return box[0]

    model = apply_patch(make_model("llama")).eval()
    seen = []
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to="none", use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0)
    trainer = ThreadedForward(model=model, args=args, eval_dataset=token_dataset(8, seed=5),
                              compute_metrics=lambda p: seen.append(p.predictions) or {})
    trainer.evaluate()
    assert seen[0].shape == (8, 16, model.config.vocab_size)


def _pad_with(rows, value):
    return [{"input_ids": r["input_ids"], "labels": torch.where(r["labels"] == -100, value, r["labels"])} for r in rows]


def test_custom_ignore_index_with_trainer(tmp_path):
    """The Trainer counts num_items_in_batch as labels != -100: with ignore_index=-1 that count took
    the -1 padding in, and the step loss came out several times too small.  A Trainer created after
    apply_patch now passes no count (each batch averages its own tokens: one micro-batch per step
    here, so the unpatched model's -100 run is the reference); one created before meets a clear error."""
    data = token_dataset(32, ragged=True)
    ref = make_model("llama")
    model = apply_patch(twin(ref), ignore_index=-1)
    _, ref_losses = _train(ref, tmp_path / "ref", data, steps=4)
    trainer, losses = _train(model, tmp_path / "patched", _pad_with(data, -1), steps=4)
    assert not trainer.model_accepts_loss_kwargs
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)

    fresh = make_model("llama")
    early = Trainer(model=fresh, args=TrainingArguments(output_dir=str(tmp_path / "early"), max_steps=1,
                                                        report_to="none", use_cpu=True, save_strategy="no"),
                    train_dataset=_pad_with(data, -1))
    apply_patch(fresh, ignore_index=-1)  # after the Trainer read accepts_loss_kwargs
    with pytest.raises(ValueError, match="counts num_items_in_batch as labels != -100"):
        early.train()


def test_custom_ignore_index_honours_a_count_without_ignored_labels():
    """The refusal is for labels holding the custom ignore_index; the shift's own padding of the last
    position is not the caller's and must not trigger it."""
    ref = make_model("llama")
    model = apply_patch(twin(ref), ignore_index=-1)
    ids, _ = batch()
    count = torch.tensor(10)
    torch.testing.assert_close(model(input_ids=ids, labels=ids, num_items_in_batch=count).loss,
                               ref(input_ids=ids, labels=ids, num_items_in_batch=count).loss)
    # the first position predicts nothing (the shift drops its label): -1 there is not an ignored target
    torch.testing.assert_close(model(input_ids=ids, labels=ids.index_fill(1, torch.tensor([0]), -1),
                                     num_items_in_batch=count).loss,
                               ref(input_ids=ids, labels=ids, num_items_in_batch=count).loss)
    with pytest.raises(ValueError, match="labels that hold ignore_index=-1 tokens"):
        model(input_ids=ids, labels=ids.masked_fill(ids == ids[0, 1], -1), num_items_in_batch=count)


def test_accepts_loss_kwargs_follows_the_patch():
    from hf_mhce.patching import unpatch

    model = make_model("gpt2")
    model.accepts_loss_kwargs = True  # a user's own setting comes back
    apply_patch(model, ignore_index=-1)
    assert model.accepts_loss_kwargs is False
    apply_patch(model, ignore_index=-100)
    assert model.accepts_loss_kwargs is True
    apply_patch(model, ignore_index=0)
    unpatch(model)
    assert model.accepts_loss_kwargs is True
    plain = make_model("gpt2")
    unpatch(apply_patch(plain, ignore_index=-1))
    assert "accepts_loss_kwargs" not in plain.__dict__


def test_eval_loss_with_a_batch_without_targets(tmp_path):
    """The Trainer leaves NaN batch losses out of eval_loss (logging_nan_inf_filter): HF's all-ignored
    batch is NaN, the fused loss's was 0 and halved eval_loss here.  The same eval_loss now."""
    rows = token_dataset(8, seed=4)
    for r in rows[:4]:  # the first eval batch of 4 has no target
        r["labels"] = torch.full_like(r["labels"], -100)
    ref = make_model("llama")
    results = []
    for model in (ref, apply_patch(twin(ref))):
        args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to="none",
                                 use_cpu=True, disable_tqdm=True)
        results.append(Trainer(model=model, args=args, eval_dataset=rows).evaluate()["eval_loss"])
    if "logging_nan_inf_filter" not in inspect.getsource(Trainer.evaluation_loop):
        # transformers 5.17 averages every batch's loss: HF's NaN makes eval_loss NaN (a 0 would not)
        assert math.isnan(results[0]) and math.isnan(results[1])
        return
    assert math.isfinite(results[0]) and results[1] == pytest.approx(results[0], rel=1e-5)


def test_custom_compute_loss_is_told_that_logits_are_none(tmp_path):
    """A Trainer subclass's compute_loss that reads outputs.logits (written for transformers) gets None
    with labels: a warning at its own line names the cause and return_logits=True (was: an AttributeError
    on None, nothing said); Trainer's own compute_loss is silent, so is a subclass's that hands the call to it
    for the loss alone (it was warned too), and return_logits=True gives HF's run."""
    import warnings

    class LogitRegularised(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            reg = torch.logsumexp(outputs.logits.float(), -1).pow(2).mean() if outputs.logits is not None else 0.0
            return outputs.loss + 1e-4 * reg

    def run(cls, model, out):
        args = TrainingArguments(output_dir=str(out), max_steps=2, per_device_train_batch_size=4, logging_steps=1,
                                 report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True)
        trainer = cls(model=model, args=args, train_dataset=token_dataset(8))
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    class Delegating(Trainer):  # the model called by Trainer.compute_loss, which hands back the loss alone
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    ref = make_model("llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(Trainer, apply_patch(twin(ref)), tmp_path / "plain")
        run(Delegating, apply_patch(twin(ref)), tmp_path / "delegating")
        run(LogitRegularised, apply_patch(twin(ref)), tmp_path / "custom")
    told = [w for w in caught if "compute_loss" in str(w.message)]
    assert len(told) == 1 and "LogitRegularised.compute_loss" in str(told[0].message), [str(w.message) for w in caught]
    assert "return_logits=True" in str(told[0].message) and told[0].filename == __file__  # the line that calls the model

    want = run(LogitRegularised, twin(ref), tmp_path / "hf")
    got = run(LogitRegularised, apply_patch(twin(ref), return_logits=True), tmp_path / "logits")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=0)


def test_forward_without_kwargs_keeps_the_trainers_per_batch_loss(tmp_path):
    """A forward without **kwargs (a subclass's override; remote code written for older transformers) gets
    no num_items_in_batch from the Trainer, which averages each micro-batch.  The patched forward's mirrored
    signature has a **kwargs, so the Trainer passed the count and trained on token-weighted steps: another
    loss (0.25 off, 5 %, at step 1 here) and other weights than the unpatched model's, silently."""
    import warnings

    from transformers import LlamaForCausalLM

    class NoKwargs(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, labels=None):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    base = make_model("llama")
    ref = NoKwargs(base.config)
    ref.load_state_dict(base.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "a forward that is not transformers' own"
        model = apply_patch(twin(ref))
    data = token_dataset(8)
    for i, row in enumerate(data):  # micro-batches of 15, 1, 13 and 2 targets
        row["labels"][: [0, 14, 2, 13][i % 4]] = -100
    ref_trainer, ref_losses = _train(ref, tmp_path / "ref", data, steps=2, batch_size=1, accumulation=4)
    trainer, losses = _train(model, tmp_path / "patched", data, steps=2, batch_size=1, accumulation=4)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert not ref_trainer.model_accepts_loss_kwargs and not trainer.model_accepts_loss_kwargs
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("trainer_loss", ["label_smoothing_factor", "compute_loss_func"])
def test_trainer_computing_the_loss_refuses_fused_options_it_would_drop(trainer_loss, tmp_path):
    """label_smoothing_factor or compute_loss_func make the Trainer take the labels out of the inputs and
    build the loss from the logits: a patched model's z_loss was dropped silently (the loss of a z_loss=0.05
    model was the unpatched one's to the last digit).  Such a call is refused now; what the Trainer's loss
    reproduces (label_smoothing equal to label_smoothing_factor, for CE) still runs."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    def run(model, smoothing=0.1):
        options = {"label_smoothing_factor": smoothing} if trainer_loss == "label_smoothing_factor" else {}
        func = (lambda out, labels, num_items_in_batch=None: ForCausalLMLoss(
            out.logits, labels, model.config.vocab_size, num_items_in_batch=num_items_in_batch)) if not options else None
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, report_to="none",
                                 use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1, **options)
        trainer = Trainer(model=model, args=args, train_dataset=token_dataset(4), compute_loss_func=func)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    ref = make_model("llama")
    with pytest.raises(ValueError, match=r"drop this model's \{'z_loss': 0.05\} silently"):
        run(apply_patch(twin(ref), z_loss=0.05))
    if trainer_loss == "label_smoothing_factor":
        with pytest.raises(ValueError, match="'ignore_index': -1"):  # the Trainer's smoothing ignores -100 alone
            run(apply_patch(twin(ref), ignore_index=-1))
        with pytest.raises(ValueError, match="'label_smoothing': 0.2"):
            run(apply_patch(twin(ref), label_smoothing=0.2))
        kept = {"label_smoothing": 0.1}
    else:
        with pytest.raises(ValueError, match="'label_smoothing': 0.1"):
            run(apply_patch(twin(ref), label_smoothing=0.1))
        kept = {}
    torch.testing.assert_close(torch.tensor(run(apply_patch(twin(ref), **kept))), torch.tensor(run(twin(ref))))


def test_a_forward_in_another_thread_reads_the_prediction_step_of_a_data_parallel_model_only(tmp_path):
    """A worker thread's forward read the main thread's Trainer.prediction_step whatever model that step ran, so an
    unrelated loss-only forward built the [tokens x vocab] logits. Only nn.DataParallel's replica threads
    (the step's own model, split over GPUs) take its prediction_loss_only."""
    import threading

    ids, labels = batch()
    other = apply_patch(make_model("llama")).eval()
    seen = {}

    class Stepping(Trainer):
        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            worker = threading.Thread(target=lambda: seen.update(
                logits=other(input_ids=ids, labels=labels).logits))  # as DataParallel's replicas run
            worker.start()
            worker.join()
            return seen["logits"]

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = Stepping(model=make_model("llama"), args=args)
    assert trainer.prediction_step(trainer.model, {}, prediction_loss_only=False) is None
    assert trainer.prediction_step(torch.nn.DataParallel(other), {}, prediction_loss_only=False) is not None
    assert trainer.prediction_step(torch.nn.DataParallel(other), {}, prediction_loss_only=True) is None
