"""Run several ``hf-mhce train`` jobs for the sweep examples (mhce_vs_ce.py, rbe_scaling.py), with
the schedule, options and evaluation read-out they share.

Every run is the main job, ``hf_mhce.train.main``; this module only schedules them: in this process
(``workers=1``) or as ``hf-mhce train`` subprocesses, ``workers`` at a time.  These models are too
small for intra-op threads: 2 workers x 1 thread beat 1 x 2 threads on 2 cores (measured).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# The training schedule of every run (hf-mhce train options); --quick replaces it by QUICK_SCHEDULE.
SCHEDULE = {
    "vocab_size": 4096, "block_size": 64, "max_eval_blocks": 100000,
    "per_device_train_batch_size": 16, "per_device_eval_batch_size": 32, "learning_rate": 3e-3, "weight_decay": 0.01,
    "warmup_steps": 20, "lr_scheduler_type": "cosine", "eval_steps": 50, "logging_steps": 25, "save_strategy": "no",
    "sample_tokens": 24,
}
# One evaluation during training (at its last step) and the final one: each evaluation writes the RBE plots,
# the larger part of a quick run's time.
QUICK_SCHEDULE = {
    "vocab_size": 300, "block_size": 32, "max_train_blocks": 64, "max_eval_blocks": 8, "max_steps": 6,
    "per_device_train_batch_size": 4, "per_device_eval_batch_size": 4, "learning_rate": 3e-3, "warmup_steps": 1,
    "weight_decay": 0.01, "lr_scheduler_type": "cosine", "eval_steps": 6, "logging_steps": 3, "save_strategy": "no",
    "sample_tokens": 4,
}
EVAL_SETS = ("docs", "code")
COMPONENTS = ("cross_entropy", "error_entropy", "self_alignment", "confidence", "top1")


def sweep_parser(description: str, out: str) -> argparse.ArgumentParser:
    """--out, --quick, --workers, --threads and --replot; the example adds its own sweep options."""
    p = argparse.ArgumentParser(description=description, allow_abbrev=False,
                                epilog="Unknown options are passed to every hf-mhce train run.")
    p.add_argument("--out", default=out, help="output directory")
    p.add_argument("--quick", action="store_true", help="reduced size, same code path (the test)")
    p.add_argument("--workers", type=int, default=2, help="parallel runs (1: in this process)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--replot", action="store_true",
                   help="no training: redo the analysis, table, verdict and plot from <out>/results.json")
    return p


def eval_metrics(summary: dict) -> dict:
    """{<set>_loss, <set>_<component>} of a run's final evaluation, for every eval set."""
    final = summary["final_eval"]
    row = {}
    for s in EVAL_SETS:
        row[f"{s}_loss"] = final[f"eval_{s}_rbe_cross_entropy"]  # -log p(target): eval_loss adds smoothing / z-loss
        for c in COMPONENTS:
            row[f"{s}_{c}"] = final[f"eval_{s}_rbe_{c}"]
    return row


def options_argv(options: dict) -> list[str]:
    """{"max_steps": 6} -> ["--max_steps", "6"]."""
    return [x for k, v in options.items() for x in (f"--{k}", str(v))]


def check_sweep_args(p: argparse.ArgumentParser, args) -> None:
    """The shared options' usage errors, before any work: counts below 1, --replot with nothing to redo, no
    matplotlib for the sweep's figure (its runs would go without their RBE plots and the figure fail at the end)."""
    from hf_mhce.rbe import plots

    if not plots.available():
        p.error(f"the sweep's figure and its runs' RBE plots need matplotlib: {plots.INSTALL}")
    for name in ("workers", "threads", "steps"):
        if getattr(args, name, None) is not None and getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)} must be at least 1")
    if args.replot and not os.path.isfile(os.path.join(args.out, "results.json")):
        p.error(f"--replot redoes the analysis of an earlier run, but {args.out}/results.json does not exist "
                "(give that run's --out)")


def prepare_runs(args, default: dict, reduced: dict, jobs_of) -> tuple[dict, str, list[tuple[str, list[str]]]]:
    """(options shared by every run, tokenizer path, jobs): ``reduced`` under --quick, else ``default``,
    with --steps as max_steps; ``jobs_of(options, tokenizer)`` lists the runs as (name, hf-mhce train
    argv).  Every run's options are checked as ``hf-mhce train`` checks them before anything is
    trained (a refused option is this script's usage error); then the job's BPE is trained once on
    vocab_size (what every run would train itself) and saved under args.out for all runs."""
    from hf_mhce.train import check_options, corpus

    options = dict(reduced if args.quick else default)
    if args.steps is not None:
        options["max_steps"] = args.steps
    vocab_size = options.pop("vocab_size")
    path = os.path.join(args.out, "tokenizer")
    jobs = jobs_of(options, path)
    for name, argv in jobs:
        try:
            check_options(argv)
        except ValueError as err:
            print(f"{os.path.basename(sys.argv[0])}: error: run {name}: hf-mhce train refuses its options: {err}",
                  file=sys.stderr)
            raise SystemExit(2) from None
    corpus.train_tokenizer(corpus.embedded_texts()[0], vocab_size).save_pretrained(path)
    return options, path, jobs


def run_jobs(jobs: list[tuple[str, list[str]]], out: str, workers: int, threads: int) -> dict[str, dict]:
    """Run ``hf_mhce.train.main(argv)`` for every (name, argv); returns {name: summary}.

    workers == 1: in this process (torch threads set to ``threads``); otherwise ``hf-mhce train``
    subprocesses, ``workers`` at a time, each with ``threads`` threads and its log in logs/<name>.log.
    A failed run stops the others and raises with the path of its log.
    """
    logs = os.path.join(out, "logs")
    os.makedirs(logs, exist_ok=True)
    results: dict[str, dict] = {}
    if workers <= 1:
        import torch

        import hf_mhce.train

        torch.set_num_threads(threads)
        for name, argv in jobs:
            results[name] = hf_mhce.train.main(argv)
            print(f"[done] {name}: {results[name]['wall_seconds']:.0f} s", flush=True)
        return results
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    pending, running = list(jobs), {}
    while pending or running:
        while pending and len(running) < workers:
            name, argv = pending.pop(0)
            log = open(os.path.join(logs, f"{name}.log"), "w")
            cmd = [sys.executable, "-m", "hf_mhce.cli", "train", *argv]
            running[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log, argv)
        time.sleep(0.5)
        for name, (proc, log, argv) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[name]
            if proc.returncode:
                for other, _, _ in running.values():
                    other.kill()
                raise RuntimeError(f"run {name} failed (exit {proc.returncode}); see {log.name}")
            out_dir = argv[argv.index("--output_dir") + 1]
            with open(os.path.join(out_dir, "metrics.json")) as f:
                results[name] = json.load(f)
            print(f"[done] {name}: {results[name]['wall_seconds']:.0f} s", flush=True)
    return results
