"""RBECallback in Trainer: metrics per eval set from the evaluation forward itself, checked against a
brute-force reference; log_history, TensorBoard event files and plots; isolation from everything
that is not an evaluation batch; the unpatched-model error."""

import logging
import math

import pytest
import torch
from rbe_helpers import METRICS, make_model, mixed_dataset, rank_histogram, reference_token_stats, token_dataset
from transformers import Trainer, TrainingArguments

from hf_mhce import RBECallback, apply_patch
from hf_mhce.rbe import evaluate as rbe_evaluate
from hf_mhce.rbe.stats import check_identity


pytestmark = pytest.mark.usefixtures("single_thread")


EVAL_SETS = {
    "mixed": lambda: mixed_dataset(8, seed=5),  # 8 rows x 15 targets
    "ragged": lambda: mixed_dataset(6, seed=6, ragged=True),  # label prefixes ignored
}
EVAL_BATCH = 4


def _args(out, **kw):
    opts = dict(output_dir=str(out), per_device_train_batch_size=8, per_device_eval_batch_size=EVAL_BATCH,
                learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=3, use_cpu=True,
                save_strategy="no", seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0,
                report_to="none")
    opts.update(kw)
    return TrainingArguments(**opts)


def _patched(loss):
    model = make_model("llama")
    return apply_patch(model, loss="mhce", num_heads=2) if loss == "mhce" else apply_patch(model, loss="ce")


def _read_tensorboard(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("loss", ["ce", "mhce"])
def test_callback_end_to_end(loss, tmp_path, monkeypatch):
    tb_dir = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tb_dir))
    plot = loss == "ce"
    model = _patched(loss)
    callback = RBECallback(plot=plot)
    eval_sets = {name: make() for name, make in EVAL_SETS.items()}
    trainer = Trainer(
        model=model,
        args=_args(tmp_path / "out", max_steps=12, eval_strategy="steps", eval_steps=6, report_to=["tensorboard"]),
        train_dataset=token_dataset(64), eval_dataset=eval_sets, callbacks=[callback],
    )
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert names.index("RBECallback") < names.index("TensorBoardCallback")
    trainer.train()

    # the evaluation itself: one decoder forward per batch, no logits
    decoder_calls, logits_seen = [], []
    hooks = [model.get_decoder().register_forward_hook(lambda m, a, o: decoder_calls.append(1)),
             model.register_forward_hook(lambda m, a, o: logits_seen.append(o.logits))]
    try:
        metrics = trainer.evaluate()
    finally:
        for h in hooks:
            h.remove()
    n_batches = sum(math.ceil(len(rows) / EVAL_BATCH) for rows in eval_sets.values())
    assert len(decoder_calls) == n_batches == 4
    assert len(logits_seen) == n_batches and all(lg is None for lg in logits_seen)

    num_heads = 2 if loss == "mhce" else 1
    for name, rows in eval_sets.items():
        prefix = f"eval_{name}"
        keys = [f"{prefix}_rbe_{k}" for k in METRICS]
        assert all(k in metrics for k in keys), sorted(set(keys) - metrics.keys())
        d = {k: metrics[f"{prefix}_rbe_{k}"] for k in METRICS}
        lhs = d["error_entropy"] + d["self_alignment"] - d["confidence"]
        assert math.isclose(lhs, d["cross_entropy"], rel_tol=1e-9), (lhs, d)
        assert d["error_entropy"] > 0 and d["self_alignment"] >= -1e-12

        nll, ranks, hits = reference_token_stats(model, rows, loss=loss, num_heads=num_heads)
        assert d["num_tokens"] == nll.numel()
        assert d["cross_entropy"] == pytest.approx(nll.mean().item(), rel=1e-5)
        assert d["top1"] == hits.double().mean().item()
        assert 0 < d["top1"] < 1  # trained enough that top-1 says something
        stats = callback.last_stats[prefix]
        hist = rank_histogram(ranks, stats.vocab_size)
        assert int((stats.counts - hist).abs().sum()) <= 2, "ranks differ from the brute-force ones"
        tol = 2 * model.config.vocab_size / nll.numel()
        assert d["mean_rank"] == pytest.approx(ranks.double().mean().item(), abs=tol)
        assert d["top5"] == pytest.approx((ranks < 5).double().mean().item(), abs=1.5 / nll.numel())
        # per-rank NLL sums of the callback against the reference (same tokens, same ranks)
        ref_sums = torch.zeros(stats.vocab_size, dtype=torch.float64).index_add_(0, ranks, nll)
        torch.testing.assert_close(stats.nll_sums.sum(), ref_sums.sum(), rtol=1e-5, atol=0)

        # log_history: both evaluations during training and the final one
        logged = [h for h in trainer.state.log_history if f"{prefix}_rbe_error_entropy" in h]
        assert [h["step"] for h in logged] == [6, 12, 12]
        assert all(f"{prefix}_loss" in h for h in logged)
        assert {k: logged[-1][k] for k in keys} == {k: metrics[k] for k in keys}
        assert logged[0][f"{prefix}_rbe_cross_entropy"] != logged[1][f"{prefix}_rbe_cross_entropy"]

    # equal-size batches, every label counted: Trainer's own eval loss is the same token mean
    assert metrics["eval_mixed_rbe_cross_entropy"] == pytest.approx(metrics["eval_mixed_loss"], rel=1e-5)
    assert metrics["eval_mixed_rbe_num_tokens"] == 8 * 15

    # TensorBoard event files
    scalars = _read_tensorboard(tb_dir)
    for name in eval_sets:
        for k in METRICS:
            tag = f"eval/{name}_rbe_{k}"
            assert tag in scalars, sorted(t for t in scalars if "rbe" in t)
            assert [s for s, _ in scalars[tag]] == [6, 12, 12]
            assert scalars[tag][-1][1] == pytest.approx(metrics[f"eval_{name}_rbe_{k}"], rel=1e-6)

    assert [h["prefix"] for h in callback.history] == ["eval_mixed", "eval_ragged"] * 3
    plot_dir = tmp_path / "out" / "rbe"
    if plot:
        for name in eval_sets:
            for kind in ("rank_distribution", "components"):
                png = plot_dir / f"eval_{name}_{kind}.png"
                assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    else:
        assert not plot_dir.exists()


def test_unpatched_model_raises(tmp_path):
    trainer = Trainer(model=make_model("llama"), args=_args(tmp_path), eval_dataset=token_dataset(4),
                      callbacks=[RBECallback()])
    with pytest.raises(RuntimeError, match="apply_patch"):
        trainer.evaluate()
    # with evaluations scheduled, train() says so before its first step (was: at the first evaluation)
    trainer = Trainer(model=make_model("llama"), args=_args(tmp_path, eval_strategy="steps", eval_steps=50, max_steps=50),
                      train_dataset=token_dataset(4), eval_dataset=token_dataset(4), callbacks=[RBECallback()])
    with pytest.raises(RuntimeError, match="apply_patch"):
        trainer.train()
    assert trainer.state.global_step == 0


def _eval_trainer(out, model=None, callbacks=None):
    model = model if model is not None else _patched("ce")
    cbs = [RBECallback()] if callbacks is None else callbacks
    return Trainer(model=model, args=_args(out), eval_dataset=token_dataset(6, seed=3), callbacks=cbs), model


def _rbe(metrics):
    return {k: v for k, v in metrics.items() if "_rbe_" in k}


def test_only_evaluation_batches_are_counted(tmp_path):
    """predict(), no-grad forwards between evaluations, another Trainer's evaluations and a standalone
    rbe.evaluate of the same model leave an evaluation's statistics untouched."""
    trainer, model = _eval_trainer(tmp_path / "a")
    base = _rbe(trainer.evaluate())
    assert base["eval_rbe_num_tokens"] == 6 * 15

    trainer.predict(token_dataset(5, seed=9))
    assert _rbe(trainer.evaluate()) == base

    rows = token_dataset(4, seed=11)
    with torch.no_grad():
        model(input_ids=torch.stack([r["input_ids"] for r in rows]), labels=torch.stack([r["labels"] for r in rows]))
    assert _rbe(trainer.evaluate()) == base

    # a second Trainer (another model) built later: each callback counts its own model's evaluations
    other, _ = _eval_trainer(tmp_path / "b", model=apply_patch(make_model("llama", seed=1)))
    assert _rbe(trainer.evaluate()) == base
    other_metrics = _rbe(other.evaluate())
    assert other_metrics["eval_rbe_num_tokens"] == base["eval_rbe_num_tokens"]
    assert other_metrics["eval_rbe_cross_entropy"] != base["eval_rbe_cross_entropy"]

    # the standalone evaluation of the Trainer's model still gets every token
    report = rbe_evaluate(model, token_dataset(6, seed=3), batch_size=4)
    assert report.decomposition.num_tokens == 6 * 15
    assert report.decomposition.cross_entropy == pytest.approx(base["eval_rbe_cross_entropy"], rel=1e-6)
    assert _rbe(trainer.evaluate()) == base
    assert check_identity(trainer.callback_handler.callbacks[0].last_stats["eval"].decompose())


def test_callback_added_after_init(tmp_path, caplog):
    trainer, _ = _eval_trainer(tmp_path / "a")
    expected = _rbe(trainer.evaluate())
    late, _ = _eval_trainer(tmp_path / "b", callbacks=[])
    late.add_callback(RBECallback())
    with caplog.at_level(logging.WARNING, logger="hf_mhce.rbe.callback"):
        first = late.evaluate()
    assert not _rbe(first) and "added after the Trainer was built" in caplog.text
    assert _rbe(late.evaluate()) == pytest.approx(expected, rel=1e-12)


def test_data_parallel_is_refused(tmp_path, monkeypatch):
    """Several GPUs in one process (Trainer's nn.DataParallel) would race the replicas' ranks: a clear
    error when the Trainer is built, not a wrong decomposition.  n_gpu is faked: no GPU here."""
    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))
    args = _args(tmp_path)
    assert args.parallel_mode.value == "not_distributed"
    with pytest.raises(RuntimeError, match="DataParallel.*accelerate launch"):
        Trainer(model=_patched("ce"), args=args, eval_dataset=token_dataset(4), callbacks=[RBECallback()])
    callback = RBECallback()  # added after init: refused at the first evaluation batch too
    with pytest.raises(RuntimeError, match="DataParallel"):
        callback.on_prediction_step(args, None, None, model=None)


def test_trainer_label_smoothing_is_refused_with_the_fused_alternative(tmp_path):
    """label_smoothing_factor makes the Trainer take the labels out of the inputs: the model would count
    no rank and every evaluation would end without RBE metrics (a metric_for_best_model on one then fails)."""
    args = _args(tmp_path, label_smoothing_factor=0.1)
    with pytest.raises(ValueError, match=r"label_smoothing_factor=0.1.*apply_patch\(model, \.\.\., label_smoothing=0.1\)"):
        Trainer(model=_patched("ce"), args=args, eval_dataset=token_dataset(4), callbacks=[RBECallback()])
    callback = RBECallback()  # added after init: refused at the first evaluation batch too
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        callback.on_prediction_step(args, None, None, model=None)
    # the alternative it names: the same smoothing inside the fused loss, with RBE metrics
    model = apply_patch(make_model("llama"), loss="ce", label_smoothing=0.1)
    metrics = Trainer(model=model, args=_args(tmp_path), eval_dataset=token_dataset(4),
                      callbacks=[RBECallback()]).evaluate()
    assert _rbe(metrics)


def test_loss_computed_by_the_trainer_is_named_when_nothing_is_counted(tmp_path, caplog):
    """A compute_loss_func also takes the labels away from the model (the callback cannot see it
    before the evaluation): the warning names it instead of only suggesting ignored labels."""
    def loss_func(outputs, labels, num_items_in_batch=None):
        return outputs.logits.float().mean()

    model = _patched("ce")
    trainer = Trainer(model=model, args=_args(tmp_path), eval_dataset=token_dataset(4), callbacks=[RBECallback()],
                      compute_loss_func=loss_func)
    with caplog.at_level(logging.WARNING, logger="hf_mhce.rbe.callback"):
        metrics = trainer.evaluate()
    assert not _rbe(metrics) and "compute_loss_func" in caplog.text


def test_each_evaluation_counts_only_its_own_batches(tmp_path):
    """Nothing resets the statistics but an evaluation's log: an evaluation with metric_key_prefix
    "train" went unreported and its tokens were added to the next one, as were those of an evaluation
    whose compute_metrics raised.  Both now stand alone; "train" evaluations are reported."""
    trainer, _ = _eval_trainer(tmp_path / "a")
    base = _rbe(trainer.evaluate())
    on_train = _rbe(trainer.evaluate(token_dataset(4, seed=8), metric_key_prefix="train"))
    assert on_train["train_rbe_num_tokens"] == 4 * 15
    assert _rbe(trainer.evaluate()) == base

    def failing(_):
        raise RuntimeError("metric bug")

    trainer.compute_metrics = failing
    with pytest.raises(RuntimeError, match="metric bug"):
        trainer.evaluate()
    trainer.compute_metrics = None
    assert _rbe(trainer.evaluate()) == base


def test_a_data_loader_reused_across_evaluations(tmp_path):
    """A reused eval dataloader (persistent workers) is told apart by accelerate's pass counter."""
    trainer, _ = _eval_trainer(tmp_path / "a")
    loader = trainer.get_eval_dataloader()
    trainer.get_eval_dataloader = lambda *a, **k: loader
    base = _rbe(trainer.evaluate())
    assert base["eval_rbe_num_tokens"] == 6 * 15 and _rbe(trainer.evaluate()) == base


def test_plots_of_an_eval_set_named_like_a_hub_id(tmp_path):
    pytest.importorskip("matplotlib")
    model = _patched("ce")
    trainer = Trainer(model=model, args=_args(tmp_path), eval_dataset={"allenai/c4": token_dataset(4)},
                      callbacks=[RBECallback(plot=True)])
    assert _rbe(trainer.evaluate())["eval_allenai/c4_rbe_num_tokens"] == 4 * 15
    assert sorted(p.name for p in (tmp_path / "rbe").iterdir()) == [
        "eval_allenai_c4_components.png", "eval_allenai_c4_rank_distribution.png"]
    card = trainer.callback_handler.callbacks[0].card_markdown(str(tmp_path))
    assert "rbe/eval_allenai_c4_components.png" in card
