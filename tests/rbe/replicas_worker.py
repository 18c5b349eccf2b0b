"""One process of the replica-check test (torch.distributed.run, 2 CPU processes, gloo).

Trains a patched tiny Llama with Trainer + RBECallback for 3 steps, in two ways: calling
``trainer.evaluate()`` before ``trainer.train()`` (upstream, that leaves the model without DDP, so
the processes drift apart) and with ``eval_on_start=True`` (synchronised).  Rank 0 writes, per way,
the error the callback raised (or None).

Usage: replicas_worker.py OUT_JSON
"""

from __future__ import annotations

import json
import sys

import torch

torch.set_num_threads(1)

from launch_helpers import leave_without_teardown  # noqa: E402
from rbe_helpers import make_model, mixed_dataset  # noqa: E402


def train(evaluate_first: bool, out_dir: str):
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from hf_mhce import RBECallback, apply_patch
    from hf_mhce.rbe.replicas import ReplicasDivergedError

    hf_logging.set_verbosity_error()
    model = apply_patch(make_model("llama"), loss="mhce", num_heads=2)
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                             max_steps=3, learning_rate=1e-2, warmup_steps=0, use_cpu=True, report_to="none",
                             save_strategy="no", eval_strategy="no", eval_on_start=not evaluate_first,
                             logging_steps=1, seed=0)
    data = mixed_dataset(16, seed=3)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=mixed_dataset(4, seed=4),
                      callbacks=[RBECallback()])
    try:
        if evaluate_first:
            trainer.evaluate()
        trainer.train()
        trainer.evaluate()
    except ReplicasDivergedError as err:
        return str(err)
    return None


def main(out: str) -> None:
    import torch.distributed as dist

    results = {"evaluate_first": train(True, "run_evaluate_first"),
               "eval_on_start": train(False, "run_eval_on_start")}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    leave_without_teardown()


if __name__ == "__main__":
    main(sys.argv[1])
