"""Standalone RBE evaluation of a causal LM on token data, without Trainer."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from ..losses import collect_ranks
from ..patching import CONFIG_KEY, apply_patch, is_patched, unpatch
from ..patching.methods import uncompiled, unwrap
from ..patching.sharding import FullyShardedDataParallel
from .data import check_aligned
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
        perplexity = float(torch.tensor(d.cross_entropy, dtype=torch.float64).exp())  # float32's overflows at 88.7 nats
        rows = [("cross-entropy", d.cross_entropy), ("Error-Entropy", d.error_entropy),
                ("Self-Alignment", d.self_alignment), ("Confidence", d.confidence),
                ("perplexity", perplexity), ("top-1 accuracy", d.top1), ("top-5 accuracy", d.top5),
                ("mean rank", d.mean_rank)]
        lines = [f"{'component':<18}{'value':>14}", "-" * 32]
        lines += [f"{name:<18}{value:>14.6f}" for name, value in rows]
        lines.append(f"{'tokens':<18}{d.num_tokens:>14d}")
        lines.append("CE = Error-Entropy + Self-Alignment - Confidence (nats)")
        return "\n".join(lines)


def _token_ids(values, what: str) -> torch.Tensor:
    """``values`` (a list, tensor or numpy array of integers) as a 1-D int64 tensor; anything else is named."""
    try:
        ids = torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError):  # text, ragged lists, object arrays
        ids = None
    if ids is None or ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        kind = type(values).__name__ + (f" of {values.dtype}" if hasattr(values, "dtype") else "")
        shape = f" with shape {tuple(ids.shape)}" if ids is not None and ids.dim() != 1 else ""
        raise TypeError(f"{what} must be a 1-D sequence of integer token ids (tokenize text first), "
                        f"got {kind}{shape}: {str(values)[:60]!r}")
    return ids.long()


def as_row(row, index: int | str = 0) -> Mapping:
    """A dict with ``input_ids`` (and ``labels``, ``attention_mask`` where given) as 1-D int64 tensors; a
    bare sequence of token ids (list, 1-D tensor, integer numpy array) is one.  ``index``: the row's, in messages."""
    if not isinstance(row, Mapping):
        return {"input_ids": _token_ids(row, f"row {index} (a dict with 'input_ids', or its token ids)")}
    if "input_ids" not in row:
        raise ValueError(f"each row needs an 'input_ids' entry (token ids), got keys {sorted(row)} in row {index}")
    if row.get("position_ids") is not None:  # padding would drop them: packed sequences then read as one
        raise ValueError(f"row {index} has position_ids (sequences packed in a row?), which rows padded per batch "
                         "cannot keep: pass the sequences as separate rows, or a DataLoader of packed batches "
                         "(e.g. collate_fn=DataCollatorWithFlattening())")
    out = {**row, "input_ids": _token_ids(row["input_ids"], f"row {index}'s input_ids")}
    for name in ("labels", "attention_mask"):
        if row.get(name) is not None:
            out[name] = _token_ids(row[name], f"row {index}'s {name}")
            check_aligned(index, name, out[name], out["input_ids"])
    return out


class _CheckedRows(torch.utils.data.Dataset):
    """In-memory ``data`` (anything with a length and indexing), each row checked and converted by as_row
    as the loader reads it, named by its index in ``data``; nothing is copied up front (a datasets.Dataset
    may be far larger than memory as int64 tensors)."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return as_row(self.data[index], index)


def _checked_rows(data):
    if isinstance(data, (Mapping, str, bytes)):
        raise TypeError(f"data must be a sequence of rows (dicts with 'input_ids', or token-id sequences), got "
                        f"{type(data).__name__}" + (": pass its rows, e.g. [{'input_ids': ids} for ids in "
                                                    "data['input_ids']]" if isinstance(data, Mapping) else ""))
    if isinstance(data, IterableDataset) or not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        return data  # checked per batch by pad_collate
    return _CheckedRows(data)


def pad_collate(rows: list, pad_id: int = 0, ignore_index: int = -100) -> dict:
    """Right-pad ``input_ids`` (and ``labels``, with ``ignore_index``: the model's) of variable-length
    rows: dicts with ``input_ids`` (optionally ``labels`` and ``attention_mask``; without labels, the
    masked positions are no targets), or bare sequences of token ids."""
    rows = [as_row(r, f"{i} of a batch") for i, r in enumerate(rows)]
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
        labels[i, :n] = torch.as_tensor(own) if own is not None else _targets(ids[i, :n], mask[i, :n], ignore_index)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _targets(ids: torch.Tensor, mask: torch.Tensor | None, ignore_index: int,
             position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``ids`` as labels, ``ignore_index`` where ``mask`` is 0, where the position before is 0 and, in
    packed rows, where a sequence starts (``position_ids`` 0): after left padding the first real token
    would be predicted from a padding position, a packed sequence's first token from the sequence
    before; targets the rows evaluated alone do not have."""
    off = mask == 0 if mask is not None else torch.zeros_like(ids, dtype=torch.bool)
    off = off | torch.cat([torch.zeros_like(off[..., :1]), off[..., :-1]], -1)
    if position_ids is not None and position_ids.shape == ids.shape:
        off = off | (position_ids == 0)
    return ids.masked_fill(off, ignore_index)


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
             progress: bool = False, max_batches: int | None = None, all_reduce: bool = True) -> RBEReport:
    """RBE decomposition of ``model`` on ``data``.

    data: a DataLoader yielding dicts with ``input_ids`` (optionally ``labels``, unshifted as
        transformers expects, and ``attention_mask``), or any sequence of such rows (e.g. a
        datasets.Dataset with an ``input_ids`` column) or of bare token-id sequences (a [B, T]
        tensor or integer numpy array, a list of id lists), padded per batch.  A row that is not
        integer token ids, or whose labels or attention_mask do not have one entry per input id, is
        named by its index (in ``data`` where that has indexing).
    A model inside ``nn.DataParallel``, ``DistributedDataParallel`` or a ``DeepSpeedEngine`` is evaluated
    through ``model.module``, one inside ``torch.compile``'s wrapper eagerly as the model it holds; an FSDP1
    root wrapper is refused (FSDP2's ``fully_shard`` works).  An unpatched model is patched for the evaluation with its saved hf_mhce config (else plain
    cross-entropy) and restored afterwards; the ranks come from the fused loss sweep.
    Distributed: give each process its share of the rows (e.g. a DistributedSampler); the
    statistics are summed over the processes.  A DistributedSampler pads a set whose size is not
    a multiple of the number of processes with repeated rows, which are then counted twice
    (a warning says so).
    A sharded model (FSDP2, ZeRO-3) gathers its weights in every forward, a collective, so every process
    must run the same number of batches (as transformers alone needs).
    The sum is a collective: call evaluate in every process (each with its own rows: the same rows
    given to every process are counted once per process), or pass ``all_reduce=False`` (e.g. from
    process 0 only) for the statistics of this process's rows alone.
    batch_size: rows per batch where ``data`` is not a DataLoader (which batches itself).
    progress: show a tqdm bar over the batches.  max_batches: stop after that many batches (None: all).
    device: where the batches go; default: where the model's input embedding runs.  Rows without
    labels: padding and attention-masked positions get the label the model is patched to ignore
    (``ignore_index``), as do the first real token after left padding and, in a batch without labels,
    the first token of each sequence packed in a row (``position_ids`` 0): padding or another sequence
    would predict it.  Labels given are used as given, as transformers does (mask their padding with
    ``ignore_index``).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"evaluate expects the model (an nn.Module), got {type(model).__name__} {model!r:.80}: load a "
                        "checkpoint with hf_mhce.from_pretrained")
    loader = data if isinstance(data, DataLoader) else None
    rows = _checked_rows(data) if loader is None else None  # a bad row is named by its index in data
    world = _world_size() if all_reduce else 1
    sampler = getattr(loader, "sampler", None)
    if loader is not None and world > 1 and _pads_last_batch(loader):
        warnings.warn("this accelerate-prepared DataLoader completes its last batch with repeated rows "
                      "(even_batches), which the RBE statistics count twice; prepare it with even_batches=False "
                      "or use a DistributedSampler over a set that splits evenly", stacklevel=2)
    if isinstance(sampler, DistributedSampler) and not sampler.drop_last and sampler.total_size != len(sampler.dataset):
        warnings.warn(f"the DistributedSampler pads {len(sampler.dataset)} rows to {sampler.total_size} with repeated "
                      "rows, which the RBE statistics count twice", stacklevel=2)
    model = _inside_wrapper(model)
    # not the head's weight, which ZeRO-3 empties and accelerate's offloading leaves on the meta device
    device = torch.device(device) if device is not None else input_device(model)
    stats = RBEStats(head_vocab_size(model))
    vocab = _input_vocab(unwrap(model))
    was_training = model.training
    model.eval()
    try:
        with _patched_for_eval(model), torch.no_grad(), collect_ranks(lambda r, l: stats.add(r, l)):
            ignore_index = getattr(unwrap(model).config, CONFIG_KEY).get("ignore_index", -100)  # as patched now
            # No cache: none is needed, and with one transformers attends across the sequences packed in a row
            # (position_ids), which it keeps apart only without a cache (as Trainer runs, use_cache=False).
            no_cache = {"use_cache": False} if getattr(unwrap(model).config, "use_cache", None) is not None else {}
            if loader is None:
                loader = DataLoader(rows, batch_size=batch_size,
                                    collate_fn=functools.partial(pad_collate, ignore_index=ignore_index))
            batches = loader
            if progress:
                from tqdm.auto import tqdm

                batches = tqdm(loader, desc="RBE evaluation", total=_length(loader, max_batches))
            for i, batch in enumerate(batches):
                if max_batches is not None and i >= max_batches:
                    break
                if not isinstance(batch, Mapping):
                    raise TypeError(f"the DataLoader gave a {type(batch).__name__} batch: evaluate reads dicts with "
                                    "input_ids (or give it the rows, or a [B, T] tensor, and it pads them itself)")
                batch = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
                _check_token_ids(batch.get("input_ids"), vocab, i)
                if "labels" not in batch:  # every real token is a target; padding (attention_mask 0) is not
                    batch["labels"] = _targets(batch["input_ids"], batch.get("attention_mask"), ignore_index,
                                               batch.get("position_ids"))
                model(**batch, **no_cache)
    finally:
        model.train(was_training)
    if all_reduce:
        if world > 1 and _same_everywhere(stats):
            warnings.warn(f"all {world} processes evaluated the same tokens, which the RBE statistics count {world} "
                          "times (num_tokens); give each process its share of the rows, or all_reduce=False", stacklevel=2)
        stats.all_reduce()
    return RBEReport(stats.decompose(), stats)


def _inside_wrapper(model):
    """The model data-parallel and torch.compile wrappers hold (evaluated directly), else ``model``; FSDP1's
    root is refused."""
    inner = uncompiled(model)  # evaluated eagerly: one pass needs no graph (accelerate's dynamo_backend wraps DDP)
    if isinstance(inner, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
        inner = inner.module  # a forward without gradient needs neither wrapper (and DataParallel's threads race the sink)
    elif type(inner).__module__.startswith("deepspeed.") and isinstance(getattr(inner, "module", None), torch.nn.Module):
        inner = inner.module  # a DeepSpeedEngine: ZeRO-3 gathers through hooks on the modules inside, not the engine
    if inner is not model:
        return _inside_wrapper(inner)
    if isinstance(model, FullyShardedDataParallel):
        raise TypeError("evaluate cannot run a model inside an FSDP1 FullyShardedDataParallel root wrapper (its forward "
                        "gathers the parameters, and patching checks the model inside): shard it with FSDP2's "
                        "fully_shard, or evaluate in a Trainer with RBECallback")
    return model


def _input_vocab(model) -> int | None:
    """The input embedding's number of rows, where the model has a plain one (None: no check)."""
    try:
        return getattr(model.get_input_embeddings(), "num_embeddings", None)
    except (AttributeError, NotImplementedError):
        return None


def _check_token_ids(ids, vocab: int | None, batch: int) -> None:
    """Ids outside the input embedding fail deep inside it (on a GPU as a device-side assert): named here."""
    if ids is None or vocab is None or ids.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(ids)).tolist()  # one sync per batch, beside a whole forward
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise ValueError(f"batch {batch} holds token id {bad}, outside the model's input embedding [0, {vocab}): "
                         "a tokenizer of another model, or padding with a negative id")


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _same_everywhere(stats) -> bool:
    """Do all processes hold identical statistics (the same rows evaluated everywhere)?  Collective."""
    import torch.distributed as dist

    from .placement import collective_device

    local = torch.stack([stats.counts.double().sum(), stats.nll_sums.sum(), (stats.counts.double() *
                         torch.arange(stats.vocab_size, dtype=torch.float64)).sum()]).to(collective_device())
    low, high = local.clone(), local.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(local[0] > 0) and bool(torch.equal(low, high))


def _pads_last_batch(loader) -> bool:
    """An accelerate DataLoaderShard / DataLoaderDispatcher that repeats rows to even out the last batch."""
    from .callback import _shard_position

    if _shard_position(loader) is None or getattr(getattr(loader, "batch_sampler", None), "drop_last", False):
        return False
    try:
        return len(loader.dataset) % loader.total_batch_size != 0
    except (TypeError, AttributeError):
        return True  # unknown length: it may


def _length(loader, max_batches):
    try:
        n = len(loader)
    except TypeError:
        return max_batches
    return n if max_batches is None else min(n, max_batches)
