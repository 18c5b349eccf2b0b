"""One process of the RBE-under-ZeRO-3 test (torch.distributed.run, 2 CPU processes, DeepSpeed's CPU
accelerator over gloo), or the single-process reference without a WORLD_SIZE.

ZeRO-3 partitions every parameter, so outside its call lm_head.weight is an empty placeholder: the
RBE statistics must be sized from its full shape (``ds_shape``), not from that placeholder.  Each
process evaluates its half of the rows with ``hf_mhce.rbe.evaluate`` and through ``RBECallback``'s
hooks (driven as Trainer drives them: a forward per batch, ``on_prediction_step``, ``on_log``); both
all-reduce their statistics.  Rank 0 writes them, the vocabulary the callback sized them by and the
placeholder's shape.

Cases: ce, lora_mhce (PEFT LoRA on q_proj, v_proj and lm_head; MHCE H=2).

Usage: zero3_worker.py OUT_JSON [SINGLE_JSON]  (launched with SINGLE_JSON: rank 0 first writes the
single-process reference there, see launch_helpers.single_reference)
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch

torch.set_num_threads(1)

from launch_helpers import finish, single_reference  # noqa: E402
from rbe_helpers import mixed_dataset  # noqa: E402
from sharding_worker import VOCAB, build, loss_options  # noqa: E402

CASES = ["ce", "lora_mhce"]
ROWS, BATCH = 4, 2  # per process in the distributed run: equal batch counts (ZeRO-3 gathers collectively)
DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
             "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "zero_allow_untested_optimizer": True}


def _stats(stats) -> dict:
    return {"counts": stats.counts.tolist(), "nll_sums": stats.nll_sums.tolist()}


def _callback_stats(model, rows, out_dir: str, world: int) -> tuple[dict, int]:
    from torch.utils.data import DataLoader

    from hf_mhce import RBECallback
    from hf_mhce.rbe.evaluate import pad_collate

    callback = RBECallback()
    callback._attach(model)  # what on_init_end does with the Trainer's model
    args = SimpleNamespace(label_smoothing_factor=0, parallel_mode=None, output_dir=out_dir, world_size=world)
    state = SimpleNamespace(global_step=0, log_history=[], is_world_process_zero=True)
    model.eval()
    with torch.no_grad():
        for batch in DataLoader(rows, batch_size=BATCH, collate_fn=pad_collate):
            model(**batch)
            callback.on_prediction_step(args, state, None, model=model)
    logs = {"eval_loss": 0.0, "eval_runtime": 0.1}
    callback.on_log(args, state, None, logs=logs, model=model)
    callback.close()
    return _stats(callback.last_stats["eval"]), callback._vocab_size


def run_case(case: str, distributed: bool, out_dir: str) -> dict:
    import hf_mhce
    from hf_mhce.rbe import evaluate

    rows = mixed_dataset(2 * ROWS, vocab=VOCAB, seed=11, ragged=True)
    model = hf_mhce.apply_patch(build(case), **loss_options(case))
    result = {}
    if distributed:
        import deepspeed
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                          config=DS_CONFIG)
        model = engine.module
        head = model.get_output_embeddings()
        result["placeholder_shape"] = list(getattr(head, "base_layer", head).weight.shape)
        rows = rows[rank * ROWS:(rank + 1) * ROWS]
    else:
        world = 1
    result["evaluate"] = _stats(evaluate(model, rows, batch_size=BATCH).stats)
    result["callback"], result["vocab"] = _callback_stats(model, rows, out_dir, world)
    return result


def main(out: str) -> None:
    distributed = "WORLD_SIZE" in os.environ
    out_dir = os.path.dirname(os.path.abspath(out))
    if distributed:
        single_reference(lambda: {case: run_case(case, False, out_dir) for case in CASES}, sys.argv[1:])
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    finish({case: run_case(case, distributed, out_dir) for case in CASES}, out, distributed)


if __name__ == "__main__":
    main(sys.argv[1])
