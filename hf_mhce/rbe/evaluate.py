"""Standalone RBE evaluation of a causal LM on token data, without Trainer."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ..losses import collect_ranks
from ..patching import CONFIG_KEY, apply_patch, is_patched, unpatch
from ..patching.methods import unwrap
from .placement import head_vocab_size, input_device
from .stats import RBEDecomposition, RBEStats


@dataclass
class RBEReport:
    """The decomposition of one evaluation and the statistics it came from."""

    decomposition: RBEDecomposition
    stats: RBEStats

    def as_dict(self) -> dict:
        return self.decomposition.as_dict()

    def table(self) -> str:
        d = self.decomposition
        rows = [("cross-entropy", d.cross_entropy), ("Error-Entropy", d.error_entropy),
                ("Self-Alignment", d.self_alignment), ("Confidence", d.confidence),
                ("perplexity", float(torch.tensor(d.cross_entropy).exp())), ("top-1 accuracy", d.top1),
                ("top-5 accuracy", d.top5), ("mean rank", d.mean_rank)]
        lines = [f"{'component':<18}{'value':>14}", "-" * 32]
        lines += [f"{name:<18}{value:>14.6f}" for name, value in rows]
        lines.append(f"{'tokens':<18}{d.num_tokens:>14d}")
        lines.append("CE = Error-Entropy + Self-Alignment - Confidence (nats)")
        return "\n".join(lines)


def _as_row(row) -> Mapping:
    """A dict with ``input_ids``; a bare sequence of token ids (list, 1-D tensor) is one."""
    if isinstance(row, Mapping):
        if "input_ids" not in row:
            raise ValueError(f"each row needs an 'input_ids' entry (token ids), got keys {sorted(row)}")
        return row
    if isinstance(row, (str, bytes)) or not (isinstance(row, (Sequence, torch.Tensor)) and torch.as_tensor(row).dim() == 1):
        raise TypeError(f"rows must be dicts with 'input_ids' or sequences of token ids (tokenize text first), "
                        f"got {type(row).__name__}: {str(row)[:60]!r}")
    return {"input_ids": row}


def pad_collate(rows: list, pad_id: int = 0, ignore_index: int = -100) -> dict:
    """Right-pad ``input_ids`` (and ``labels``, with ``ignore_index``: the model's) of variable-length
    rows: dicts with ``input_ids`` (optionally ``labels`` and ``attention_mask``; without labels, the
    masked positions are no targets), or bare sequences of token ids."""
    rows = [_as_row(r) for r in rows]
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), longest), ignore_index, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.as_tensor(r["input_ids"])
        # a row's own mask (e.g. tokenizer(..., padding="max_length")) keeps its padding out of the targets
        mask[i, :n] = torch.as_tensor(r["attention_mask"]) if r.get("attention_mask") is not None else 1
        own = r.get("labels")
        labels[i, :n] = torch.as_tensor(own) if own is not None else ids[i, :n].masked_fill(mask[i, :n] == 0, ignore_index)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@contextlib.contextmanager
def _patched_for_eval(model):
    """Patch an unpatched model for the evaluation (saved hf_mhce config, else CE), then restore."""
    if is_patched(model):
        yield model
        return
    apply_patch(model)
    try:
        yield model
    finally:
        unpatch(model)


def evaluate(model, data, *, batch_size: int = 8, device: str | torch.device | None = None,
             progress: bool = False, max_batches: int | None = None) -> RBEReport:
    """RBE decomposition of ``model`` on ``data``.

    data: a DataLoader yielding dicts with ``input_ids`` (optionally ``labels``, unshifted as
        transformers expects, and ``attention_mask``), or any sequence of such rows (e.g. a
        datasets.Dataset with an ``input_ids`` column) or of bare token-id sequences (a [B, T]
        tensor, a list of id lists), padded per batch.
    A model inside ``nn.DataParallel`` or ``DistributedDataParallel`` is evaluated through
    ``model.module``.  An unpatched model is patched for the evaluation with its saved hf_mhce config (else plain
    cross-entropy) and restored afterwards; the ranks come from the fused loss sweep.
    Distributed: give each process its share of the rows (e.g. a DistributedSampler); the
    statistics are summed over the processes.  A DistributedSampler pads a set whose size is not
    a multiple of the number of processes with repeated rows, which are then counted twice
    (a warning says so).
    device: where the batches go; default: where the model's input embedding runs.  Padding and
    attention-masked positions get the label the model is patched to ignore (``ignore_index``).
    """
    loader = data if isinstance(data, DataLoader) else None
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, DistributedSampler) and not sampler.drop_last and sampler.total_size != len(sampler.dataset):
        warnings.warn(f"the DistributedSampler pads {len(sampler.dataset)} rows to {sampler.total_size} with repeated "
                      "rows, which the RBE statistics count twice", stacklevel=2)
    if isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
        model = model.module  # a forward without gradient needs neither wrapper (and DataParallel's threads race the sink)
    # not the head's weight, which ZeRO-3 empties and accelerate's offloading leaves on the meta device
    device = torch.device(device) if device is not None else input_device(model)
    stats = RBEStats(head_vocab_size(model))
    was_training = model.training
    model.eval()
    try:
        with _patched_for_eval(model), torch.no_grad(), collect_ranks(lambda r, l: stats.add(r, l)):
            ignore_index = getattr(unwrap(model).config, CONFIG_KEY).get("ignore_index", -100)  # as patched now
            if loader is None:
                loader = DataLoader(data, batch_size=batch_size,
                                    collate_fn=functools.partial(pad_collate, ignore_index=ignore_index))
            batches = loader
            if progress:
                from tqdm.auto import tqdm

                batches = tqdm(loader, desc="RBE evaluation", total=_length(loader, max_batches))
            for i, batch in enumerate(batches):
                if max_batches is not None and i >= max_batches:
                    break
                batch = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
                if "labels" not in batch:  # every real token is a target; padding (attention_mask 0) is not
                    mask = batch.get("attention_mask")
                    ids = batch["input_ids"]
                    batch["labels"] = ids if mask is None else ids.masked_fill(mask == 0, ignore_index)
                model(**batch)
    finally:
        model.train(was_training)
    stats.all_reduce()
    return RBEReport(stats.decompose(), stats)


def _length(loader, max_batches):
    try:
        n = len(loader)
    except TypeError:
        return max_batches
    return n if max_batches is None else min(n, max_batches)
