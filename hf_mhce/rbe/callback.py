"""RBECallback: the RBE decomposition of every evaluation, from the evaluation forward itself.

How it hooks into ``Trainer`` (transformers 5.x):
- when the Trainer is built, forward hooks on its model install a rank sink
  (``hf_mhce.losses.collect_ranks``) for the duration of each of that model's forwards; the
  patched loss computed without gradient -- an evaluation forward -- feeds it ranks and NLL from
  the same fused sweep (no second forward, no logits, no gathered predictions).  Each forward
  starts from an empty batch, and a sink that was already active (``hf_mhce.rbe.evaluate`` on the
  same model) is fed too.  A forward under other PEFT adapters than the model has after the batch
  (TRL's reference for a PEFT policy: the same model with its adapter disabled, or a "ref" adapter)
  keeps its own batch, which is not counted;
- ``on_prediction_step`` (after each evaluation batch) moves what the batch fed into the
  statistics of the running evaluation, so no-grad forwards outside an evaluation, other models'
  forwards and ``predict()`` batches are not counted;
- ``Trainer.evaluate`` logs its metrics before ``on_evaluate``, so the metrics are added in
  ``on_log``: to the dict that ``evaluate()`` returns, to ``state.log_history`` and, because the
  callback moves itself ahead of the reporting integrations, to what they receive.  The prefix is
  the evaluation's ``metric_key_prefix`` (``eval``, ``eval_<name>`` for a dict of datasets).
Statistics are summed across processes (exact) before the decomposition.  The rows accelerate
repeats to complete the last batch of an eval set whose size is not a multiple of the global batch
(``even_batches``) are left out, as ``gather_for_metrics`` leaves them out of ``eval_loss``.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import weakref

import torch
from transformers import TrainerCallback
from transformers.training_args import ParallelMode

from ..losses import collect_ranks
from ..losses.collect import active_sink
from ..patching import CONFIG_KEY, add_card_section, is_patched
from .placement import head_vocab_size
from .replicas import check_replicas_in_sync
from .stats import RBEStats

logger = logging.getLogger(__name__)

METRICS = ("error_entropy", "self_alignment", "confidence", "cross_entropy", "top1", "top5", "mean_rank",
           "num_tokens")


class RBECallback(TrainerCallback):
    """Adds ``{prefix}_rbe_<component>`` metrics to every ``trainer.evaluate()``.

    plot: write, at each evaluation, the rank distribution (log-log) and the components over
        training steps as PNG files under ``<output_dir>/rbe`` (needs matplotlib).
    The model must be patched with ``hf_mhce.apply_patch`` (any loss); an unpatched model raises
    at the first evaluation, since its loss never reaches the fused sweep that counts ranks.
    Pass it in ``Trainer(callbacks=[...])``: added later with ``trainer.add_callback``, it misses
    the first batch of an evaluation that comes before any training, and skips that evaluation
    with a warning.
    """

    def __init__(self, plot: bool = False):
        if plot:  # before training, not at the first evaluation
            from . import plots

            if not plots.available():
                raise ImportError(plots.MISSING + ", or RBECallback(plot=False)")
        self._plot_dir: str | None = None
        self.plot = plot
        self.history: list[dict] = []  # one row per evaluation: step, prefix, components
        self.last_stats: dict[str, RBEStats] = {}
        self._batch: list = []  # (ranks, nll) fed by the forward in progress
        self._labels: tuple | None = None  # (labels, shift_labels, ignore_index, position_ids, attention_mask)
        self._forwards: dict = {}  # adapter state -> (batch, labels, input_ids) of its last forward
        self._running: RBEStats | None = None
        self._model = None
        self._hooks: list = []
        self._entered: list = []  # collect_ranks contexts of the forwards in progress
        self._late = False  # attached during an evaluation: its first batch went uncounted
        self._loader, self._loader_pass = None, None  # the eval dataloader (weak) and pass being counted

    # -- collection -------------------------------------------------------------------------
    def _sink(self, ranks, nll):
        self._batch.append((ranks.detach().reshape(-1).cpu(), nll.detach().reshape(-1).cpu()))

    def _move_first(self) -> None:
        """Run before the reporting integrations in every event (see the module docstring)."""
        for ref in gc.get_referrers(self):
            if isinstance(ref, list) and any(type(c).__name__ == "DefaultFlowCallback" for c in ref):
                ref.remove(self)
                ref.insert(0, self)

    def _pre_forward(self, module, args, kwargs):
        self._batch = []  # a new forward: what came before is no part of this batch
        saved = getattr(getattr(module, "config", None), CONFIG_KEY, None) or {}
        ignore_index = kwargs.get("ignore_index", saved.get("ignore_index", -100))
        self._labels = (kwargs.get("labels"), kwargs.get("shift_labels"), ignore_index, kwargs.get("position_ids"),
                        kwargs.get("attention_mask"))
        if not torch.is_grad_enabled():  # only a forward without gradient feeds ranks
            key, ids = _adapter_state(module), kwargs.get("input_ids")
            kept = self._forwards.get(key)
            # the batch's logits recomputed without labels (TRL's SFT, for compute_metrics) keep its ranks
            if not (self._labels[0] is None and self._labels[1] is None and kept and ids is not None and kept[2] is ids):
                self._forwards[key] = (self._batch, self._labels, ids)
        outer = active_sink()  # e.g. hf_mhce.rbe.evaluate on this model: feed it as well
        sink = self._sink if outer is None else _fan_out(self._sink, outer)
        cm = collect_ranks(sink)
        cm.__enter__()
        self._entered.append(cm)

    def _post_forward(self, module, args, output):
        if self._entered:
            self._entered.pop().__exit__(None, None, None)

    def _attach(self, model) -> None:
        """Hook ``model`` (once; again if the Trainer's model was replaced) and move first."""
        if model is None or model is self._model:
            return
        self.close()
        self._move_first()
        self._vocab_size = head_vocab_size(model)  # not head.weight's shape: ZeRO-3 empties it between calls
        self._hooks = [model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                       model.register_forward_hook(self._post_forward, always_call=True)]
        self._model = model
        if is_patched(model):  # the model card written on save gets the final RBE table
            add_card_section(model, "RBE evaluation", self.card_markdown)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        _check_arguments(args)
        self._plot_dir = os.path.join(args.output_dir, "rbe")
        self._attach(model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        _check_arguments(args)
        if model is not None and not is_patched(model) and (args.eval_strategy != "no" or args.eval_on_start):
            raise RuntimeError(_UNPATCHED)  # now, not at the first evaluation after eval_steps of training
        self._plot_dir = os.path.join(args.output_dir, "rbe")
        self._attach(model)  # added with trainer.add_callback, or a model_init model

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._forwards = {}  # no-grad forwards of training (e.g. TRL's reference) are no evaluation's
        # Metrics summed across processes assume one model: checked after the first two steps (a
        # warm-up may give the first a zero learning rate) and at every evaluation during training.
        if state.global_step <= 2 and args.world_size > 1 and model is not None:
            check_replicas_in_sync(model)

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        if state.global_step > 0 and args.world_size > 1 and model is not None:
            check_replicas_in_sync(model)

    def on_prediction_step(self, args, state, control, model=None, eval_dataloader=None, **kwargs):
        if self._model is None:  # added with trainer.add_callback after init: first batch of an evaluation
            _check_arguments(args)
            if model is not None:
                self._attach(model)  # this batch was missed
                self._late = True
        if self._new_evaluation(eval_dataloader):
            self._running = None  # an earlier evaluation that raised before its log is no part of this one
        # the batch of the last forward under the adapters the model has now, which TRL's reference forward
        # (adapter disabled or switched, after the policy's) has not
        running = self._model if self._model is not None else model  # not `or`: a compile wrapper has no truth value
        self._batch, self._labels, _ = self._forwards.get(_adapter_state(running), ([], None, None))
        self._forwards = {}
        if self._batch:
            ranks = torch.cat([r for r, _ in self._batch])
            nll = torch.cat([n for _, n in self._batch])
            keep = self._real_tokens(eval_dataloader, len(self._batch), ranks.numel())
            if self._running is None:
                self._running = RBEStats(self._vocab_size, device="cpu")
            self._running.add(ranks[:keep], nll[:keep])
        self._batch, self._labels = [], None

    def _new_evaluation(self, loader) -> bool:
        """Is this the first batch of an evaluation loop?  The Trainer has no "evaluation begins" event;
        a loop is a pass over one eval dataloader (a new object per ``evaluate()``, and accelerate's
        ``iteration`` counts the completed passes of a reused one)."""
        if loader is None:
            return False
        key = getattr(loader, "iteration", None)
        current = self._loader() if self._loader is not None else None
        if current is loader and key == self._loader_pass:
            return False
        self._loader, self._loader_pass = weakref.ref(loader), key
        return True

    def _real_tokens(self, loader, calls: int, tokens: int) -> int:
        """How many of the batch's tokens belong to real samples.  Under accelerate's ``even_batches``
        (Trainer's default), or when it dispatches batches from process 0 (``dispatch_batches``, the
        default for an IterableDataset), the last batch of an eval set whose size is not a multiple of
        the global batch is completed with samples from the start, which ``gather_for_metrics`` (and
        so ``eval_loss``) drops; their tokens must not be counted either.  The real samples are the
        first ``remainder`` rows of the batch concatenated over processes."""
        remainder = getattr(loader, "remainder", -1)
        position = _shard_position(loader)
        if (not getattr(loader, "end_of_dataloader", False) or remainder is None or remainder <= 0
                or position is None or position[1] <= 1):
            return tokens
        per_sample = _sample_tokens(*self._labels) if self._labels is not None and calls == 1 else None
        if per_sample is None or int(per_sample.sum()) != tokens:
            logger.warning("RBECallback: cannot tell the padding samples of the last evaluation batch from the "
                           "real ones; the RBE statistics count them (eval_loss does not)")
            return tokens
        samples = per_sample.numel()
        real = max(0, min(samples, remainder - position[0] * samples))
        return int(per_sample[:real].sum())

    def on_predict(self, args, state, control, **kwargs):
        self._running, self._batch, self._late = None, [], False  # predict() batches are not an evaluation
        self._forwards = {}

    # -- reporting --------------------------------------------------------------------------
    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        prefix = _evaluation_prefix(logs or {})
        if prefix is None:
            return
        if self._model is None:
            self._attach(model)
        stats = self._running if self._running is not None else RBEStats(self._vocab_size)
        self._running, self._batch, self._forwards = None, [], {}
        if self._late:
            self._late = False
            logger.warning("RBECallback was added after the Trainer was built: evaluation %r is not reported "
                           "(its first batch ran before the callback could count it); later ones are", prefix)
            return
        stats.all_reduce()  # every process logs the evaluation, so this collective is matched
        if stats.num_tokens == 0:
            if model is not None and not is_patched(model):
                raise RuntimeError(_UNPATCHED)
            logger.warning("RBECallback: evaluation %r counted no token, so there are no RBE metrics: the batches "
                           "had no labels (the eval set has no 'labels' column and the data collator adds none, e.g. "
                           "use DataCollatorForLanguageModeling(tokenizer, mlm=False)), every label was ignored, or "
                           "the Trainer computes the loss itself (a compute_loss_func given to Trainer)", prefix)
            return
        d = stats.decompose()
        metrics = {f"{prefix}_rbe_{k}": getattr(d, k) for k in METRICS}
        logs.update(metrics)
        if state.log_history and f"{prefix}_runtime" in state.log_history[-1]:
            state.log_history[-1].update(metrics)
        self.last_stats[prefix] = stats
        self.history.append({"step": state.global_step, "prefix": prefix, **d.as_dict()})
        if self.plot and state.is_world_process_zero:
            from .plots import plot_evaluation

            self._plot_dir = os.path.join(args.output_dir, "rbe")
            plot_evaluation(self._plot_dir, prefix, stats, self.history)

    def card_markdown(self, save_directory: str) -> str:
        """The latest decomposition of each evaluation set, with links to the plots (model card)."""
        latest = {row["prefix"]: row for row in self.history}
        if not latest:
            return ""
        lines = ["Cross-entropy = Error-Entropy + Self-Alignment - Confidence (nats), at the last evaluation:", "",
                 "| eval set | step | tokens | cross-entropy | Error-Entropy | Self-Alignment | Confidence | top-1 |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for prefix, r in latest.items():
            lines.append(f"| {prefix} | {r['step']} | {r['num_tokens']} | {r['cross_entropy']:.4f} | "
                         f"{r['error_entropy']:.4f} | {r['self_alignment']:.4f} | {r['confidence']:.4f} | {r['top1']:.3f} |")
        from .plots import plot_path

        plots = [f"[{prefix} {kind.replace('_', ' ')}]({os.path.relpath(path, save_directory)})"
                 for prefix in latest for kind in ("components", "rank_distribution")
                 if self._plot_dir and os.path.exists(path := plot_path(self._plot_dir, prefix, kind))]
        if plots:
            lines += ["", "Plots: " + ", ".join(plots)]
        return "\n".join(lines)

    def close(self) -> None:
        """Remove the forward hooks from the model (the callback then collects nothing)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._model = [], None


_UNPATCHED = ("RBECallback needs a model patched with hf_mhce.apply_patch(model, ...): the ranks are counted "
              "inside the fused loss, which an unpatched model never calls")


def _check_arguments(args) -> None:
    """TrainingArguments under which the callback would count nothing, or count wrongly.

    With label_smoothing_factor the Trainer removes the labels from the inputs and smooths the loss
    itself: the model never sees labels, so no rank is counted and no RBE metric is reported.
    Trainer runs several GPUs of one process through ``torch.nn.DataParallel``, whose replicas run
    the forward in worker threads at once: one batch's ranks would be split, raced and partly lost.
    Say so instead of reporting nothing or a wrong decomposition."""
    smoothing = getattr(args, "label_smoothing_factor", 0) or 0
    if smoothing > 0:
        raise ValueError(
            f"RBECallback counts ranks inside the patched model's loss, but with label_smoothing_factor={smoothing} "
            "the Trainer takes the labels out of the inputs and smooths the loss itself, so there would be no RBE "
            f"metrics. Smooth in the fused loss instead: hf_mhce.apply_patch(model, ..., label_smoothing={smoothing}) "
            "and label_smoothing_factor=0 (the same smoothed cross-entropy for loss='ce'; for 'mhce' the fused loss "
            "smooths each head's cross-entropy, the Trainer the mixture's)"
        )
    if getattr(args, "parallel_mode", None) == ParallelMode.NOT_DISTRIBUTED:
        raise RuntimeError(
            f"RBECallback does not support torch.nn.DataParallel, which Trainer uses for the "
            f"{getattr(args, 'n_gpu', 'several')} GPUs of a single process. Launch one process per GPU "
            f"instead (`accelerate launch` or `torchrun`: DistributedDataParallel, supported), or make "
            f"one GPU visible (CUDA_VISIBLE_DEVICES=0)."
        )


def _sample_tokens(labels, shift_labels, ignore_index, position_ids=None, attention_mask=None):
    """Counted tokens per sample of a [B, T] batch, in order, as the patched loss counts them (None
    if unknown).  A row is one sample, or several packed ones (DataCollatorWithFlattening): each
    starts where ``position_ids`` is 0, and the token before a start predicts nothing of its own.
    Padding (``attention_mask`` 0), which collators often give position 0 too, starts no sample."""
    if shift_labels is None:
        if not torch.is_tensor(labels) or labels.dim() != 2:
            return None
        shift_labels = labels[:, 1:]  # the last position predicts nothing
    if not torch.is_tensor(shift_labels) or shift_labels.dim() != 2:
        return None
    counted = (shift_labels != ignore_index).cpu()
    rows, width = counted.shape
    if not torch.is_tensor(position_ids) or position_ids.dim() != 2 or position_ids.shape[0] != rows \
            or position_ids.shape[1] < width:
        return counted.sum(1)
    starts = position_ids.cpu() == 0
    if torch.is_tensor(attention_mask) and attention_mask.shape == position_ids.shape:
        # padding positions (left or right) often carry position 0 too: they start no sample; a row's
        # first attended position starts its first sample
        real = attention_mask.cpu().bool()
        starts &= real
        first = real.long().argmax(1)
        starts[torch.arange(rows), first] = True
    else:
        starts[:, 0] = True
    # sample of each predicting token (row 0's leading padding, before any start, counts nothing)
    sample = (starts.reshape(-1).cumsum(0).reshape(starts.shape)[:, :width] - 1).clamp(min=0)
    return torch.zeros(int(starts.sum()), dtype=torch.long).index_add_(0, sample.reshape(-1), counted.reshape(-1).long())


def _adapter_state(model) -> tuple:
    """The PEFT adapters a forward of ``model`` runs with: (PeftModel's disabled flag and active adapter, the
    first adapter layer's); () without PEFT."""
    if model is None or "peft" not in sys.modules:
        return ()
    from peft.tuners.tuners_utils import BaseTunerLayer

    state = ()
    for m in model.modules():
        if hasattr(m, "_adapters_disabled") and hasattr(m, "peft_config"):  # a PeftModel (disable_adapter, set_adapter)
            state += (m._adapters_disabled, str(m.active_adapter))
        elif isinstance(m, BaseTunerLayer):  # also transformers' own adapters (model.disable_adapters())
            return state + (m.disable_adapters, tuple(m.active_adapters))
    return state


def _fan_out(*sinks):
    def sink(ranks, nll):
        for s in sinks:
            s(ranks, nll)

    return sink


def _shard_position(loader) -> tuple[int, int] | None:
    """(process index, number of processes) of an accelerate eval loader that completes its last
    batch with repeated samples; None for any other loader."""
    sampler = getattr(loader, "batch_sampler", None)
    if getattr(sampler, "even_batches", False):  # BatchSamplerShard: each process draws its own rows
        return sampler.process_index, sampler.num_processes
    dispatcher = getattr(sys.modules.get("accelerate.data_loader"), "DataLoaderDispatcher", None)
    if dispatcher is not None and isinstance(loader, dispatcher) and not getattr(loader, "_drop_last", False):
        return loader.state.process_index, loader.state.num_processes  # process p gets rows p*b .. (p+1)*b
    return None


def _evaluation_prefix(logs: dict) -> str | None:
    """``metric_key_prefix`` of an evaluation's logs (they carry ``<prefix>_runtime``), else None.
    "train" is one too (``evaluate(train_set, metric_key_prefix="train")``), except in the training's
    own summary (with ``total_flos``) and its token-speed logs (no loss, no samples per second)."""
    if "total_flos" in logs:
        return None
    for key in logs:
        if key.endswith("_runtime"):
            prefix = key[: -len("_runtime")]
            if f"{prefix}_loss" in logs or f"{prefix}_samples_per_second" in logs:
                return prefix
    return None
