"""Run several ``hf-mhce train`` jobs for the sweep examples (mhce_vs_ce.py, rbe_scaling.py).

Every run is the main job, ``hf_mhce.train.main``; this module only schedules them: in this process
(``workers=1``) or as ``hf-mhce train`` subprocesses, ``workers`` at a time.  These models are too
small for intra-op threads: 2 workers x 1 thread beat 1 x 2 threads on 2 cores (measured).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

# glibc malloc: keep freed memory instead of returning it to the OS (mmap/munmap) at every large
# tensor; otherwise a training step spends ~25 % of its time in page faults, and two concurrent
# runs slow each other down about 2x (measured on a 2-vCPU VM).  Results are unchanged.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def options_argv(options: dict) -> list[str]:
    """{"max_steps": 6} -> ["--max_steps", "6"]."""
    return [x for k, v in options.items() for x in (f"--{k}", str(v))]


def prepare_tokenizer(out: str, vocab_size: int) -> str:
    """Train the job's BPE once (what every run would train itself) and save it for all runs."""
    from hf_mhce.train import corpus

    path = os.path.join(out, "tokenizer")
    corpus.train_tokenizer(corpus.embedded_texts()[0], vocab_size).save_pretrained(path)
    return path


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
    env.update({k: v for k, v in MALLOC_ENV.items() if k not in os.environ})
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
