"""One process of the distributed RBE test (run by torch.distributed.run), or the single-process
reference when started without a WORLD_SIZE.  Writes, from rank 0, a JSON file with:

- "trainer": the RBE metrics of ``Trainer.evaluate`` with an ``RBECallback`` on a dict of two eval
  sets, and the callback's per-rank statistics (after its all-reduce);
- "standalone": ``hf_mhce.rbe.evaluate`` of a DataLoader whose DistributedSampler gives each
  process its share of the rows (the statistics are all-reduced inside).

Usage: dist_worker.py OUT_JSON
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import warnings

import torch

torch.set_num_threads(1)

from rbe_helpers import make_model, mixed_dataset  # noqa: E402

EVAL_BATCH = 2  # per process


def eval_sets():
    """8 rows: every global batch (2 processes x 2 rows) is full.  7 and 5 rows: accelerate completes
    the last global batch with rows from the start (even_batches), which must not be counted: one
    padding row on process 1 (7 rows), a padding row on process 0 and a whole padding batch on
    process 1 (5 rows)."""
    return {"mixed": mixed_dataset(8, seed=5), "ragged": mixed_dataset(7, seed=6, ragged=True),
            "short": mixed_dataset(5, seed=7)}


def uneven_lengths(rows):
    """The rows cut to lengths 16, 11, 6, 14, ...: batches of them are padded."""
    return [{k: v[: 16 - (5 * i) % 11] for k, v in row.items()} for i, row in enumerate(rows)]


def positioned_collate(left: bool):
    """pad_collate with position_ids that are 0 at the padding, as many collators give them: right padding
    with arange * mask, or left padding with (cumsum - 1).clamp(0).  Padding starts no sample."""
    from hf_mhce.rbe.evaluate import pad_collate

    def collate(rows):
        batch = pad_collate(rows)
        mask = batch["attention_mask"]
        if left:  # move each row's padding to its front
            order = torch.argsort(mask, dim=1, stable=True)
            batch = {k: v.gather(1, order) for k, v in batch.items()}
            mask = batch["attention_mask"]
            batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        else:
            batch["position_ids"] = torch.arange(mask.shape[1]) * mask
        return batch

    return collate


def model():
    from hf_mhce import apply_patch

    return apply_patch(make_model("llama"), loss="mhce", num_heads=2)


def _stats(stats):
    return {"counts": stats.counts.tolist(), "nll_sums": stats.nll_sums.tolist()}


def run(out_dir: str) -> dict:
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from hf_mhce import RBECallback
    from hf_mhce.rbe import evaluate
    from hf_mhce.rbe.evaluate import pad_collate

    hf_logging.set_verbosity_error()
    callback = RBECallback()
    args = TrainingArguments(output_dir=out_dir, per_device_eval_batch_size=EVAL_BATCH, use_cpu=True,
                             report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model(), args=args, eval_dataset=eval_sets(), callbacks=[callback])
    with contextlib.redirect_stdout(io.StringIO()):
        metrics = trainer.evaluate()
    # packed rows (one row of 2 samples per process and batch): the padding sample accelerate adds to
    # the last batch shares a row with a real one, and must not be counted either
    packed = RBECallback()
    flat = Trainer(model=trainer.model, args=args, eval_dataset=eval_sets()["ragged"], callbacks=[packed],
                   data_collator=DataCollatorWithFlattening())
    with contextlib.redirect_stdout(io.StringIO()):
        metrics.update(flat.evaluate(metric_key_prefix="packed"))
    # batches dispatched from process 0 (accelerate's default for an IterableDataset): 5 rows over a
    # global batch of 4, whose last batch process 1 fills with repeated rows
    dispatched = RBECallback()
    dispatch_args = TrainingArguments(output_dir=out_dir, per_device_eval_batch_size=EVAL_BATCH, use_cpu=True,
                                      report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                                      accelerator_config={"dispatch_batches": True})
    sent = Trainer(model=trainer.model, args=dispatch_args, eval_dataset=eval_sets()["short"], callbacks=[dispatched])
    with contextlib.redirect_stdout(io.StringIO()):
        metrics.update(sent.evaluate(metric_key_prefix="dispatched"))
    callbacks = [callback, packed, dispatched]
    for side in ("right", "left"):  # padding at position 0 used to count as packed samples: real rows dropped
        counted = RBECallback()
        callbacks.append(counted)
        padded = Trainer(model=trainer.model, args=args, eval_dataset=uneven_lengths(eval_sets()["ragged"]),
                         callbacks=[counted],
                         data_collator=positioned_collate(left=side == "left"))
        with contextlib.redirect_stdout(io.StringIO()):
            metrics.update(padded.evaluate(metric_key_prefix=f"{side}_padded"))
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    result = {
        "world_size": world,
        "trainer": {"metrics": {k: v for k, v in metrics.items() if "_rbe_" in k},
                    "stats": {p: _stats(s) for c in callbacks for p, s in c.last_stats.items()}},
    }
    rows = eval_sets()["mixed"]  # a DistributedSampler pads uneven sets: this one splits evenly
    sampler = DistributedSampler(rows, num_replicas=world, rank=rank, shuffle=False) if world > 1 else None
    report = evaluate(trainer.model, DataLoader(rows, batch_size=1, sampler=sampler, collate_fn=pad_collate))
    result["standalone"] = {"metrics": report.as_dict(), "stats": {"mixed": _stats(report.stats)}}
    result["warnings"] = {}
    with warnings.catch_warnings(record=True) as caught:  # the same rows in every process: counted twice
        warnings.simplefilter("always")
        evaluate(trainer.model, rows)
    result["warnings"]["same_rows"] = [str(w.message) for w in caught]
    with warnings.catch_warnings(record=True) as caught:  # accelerate completes the last batch with repeats
        warnings.simplefilter("always")
        evaluate(trainer.model, trainer.get_eval_dataloader(eval_sets()["ragged"]))
    result["warnings"]["even_batches"] = [str(w.message) for w in caught]
    if rank == 0:  # one process alone: was a hang in the all-reduce
        alone = evaluate(trainer.model, rows, all_reduce=False)
        result["rank0_alone"] = {"mixed": _stats(alone.stats)}
    return result


def main() -> None:
    out = sys.argv[1]
    result = run(os.path.join(os.path.dirname(out), f"trainer_out_{os.environ.get('RANK', 'single')}"))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    import torch.distributed as dist

    if dist.is_initialized():
        from launch_helpers import leave_without_teardown

        leave_without_teardown()


if __name__ == "__main__":
    main()
