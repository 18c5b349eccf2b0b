"""Wall time of the main job, ``hf-mhce train`` on its embedded default (issue P4: <= 3 min on 2 cores).

    python benchmarks/main_job_cpu.py                    # the README's default run, timed
    python benchmarks/main_job_cpu.py --repeats 2 -- --loss ce   # options after -- go to hf-mhce train

Runs ``hf-mhce train`` in a fresh subprocess (so the time includes the Python and torch imports, the
tokenizer training and the final save, as a user sees it) and records wall time, CPU time, the
machine and the final metrics to benchmarks/results/main_job_cpu-<date>.json and .md (the options after
-- and a non-default --repeats are added to the name: records.py's rule).  Measure on
an otherwise quiet machine: with two OpenMP threads, a busy neighbour slows a step 15-50x.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

from records import Record, add_out_options, positive_int


def run_once(extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "hf_mhce.cli", "train", "--output_dir", out, *extra]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        load = os.getloadavg()[0]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode:
            raise RuntimeError(f"hf-mhce train failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        with open(os.path.join(out, "metrics.json")) as f:
            summary = json.load(f)
    return {"wall_seconds": round(wall, 1), "user_seconds": round(after.ru_utime - before.ru_utime, 1),
            "system_seconds": round(after.ru_stime - before.ru_stime, 1),
            "max_rss_mb": round(after.ru_maxrss / 1024), "load_average_before": load,
            "train_runtime": summary["train"]["train_runtime"],
            "final_eval": {k: v for k, v in summary["final_eval"].items() if k.endswith("_loss")},
            "loss": summary["loss"], "num_heads": summary["num_heads"], "parameters": summary["parameters"]}


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=positive_int, default=1)
    add_out_options(p)
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    today = datetime.date.today().isoformat()
    record = Record(p, args, f"main_job_cpu-{today}", extra=extra)
    runs = [run_once(extra) for _ in range(args.repeats)]
    result = {"date": today, "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                                         "python": platform.python_version()},
              "options": extra, "target_seconds": 180, "runs": runs}
    import torch

    result["machine"]["torch"] = torch.__version__
    result["machine"]["torch_threads"] = torch.get_num_threads()
    lines = [f"# hf-mhce train (embedded default{' + ' + ' '.join(extra) if extra else ''}), {today}", "",
             f"{os.cpu_count()} CPUs ({result['machine']['processor']}), torch {torch.__version__}, "
             f"Python {result['machine']['python']}; target <= 180 s wall.", "",
             "| run | wall s | user s | sys s | train s | max RSS MB | load avg before | eval losses |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for i, r in enumerate(runs):
        losses = ", ".join(f"{k[5:-5]} {v:.3f}" for k, v in r["final_eval"].items())
        lines.append(f"| {i} | {r['wall_seconds']} | {r['user_seconds']} | {r['system_seconds']} | "
                     f"{r['train_runtime']:.1f} | {r['max_rss_mb']} | {r['load_average_before']:.2f} | {losses} |")
    record.write(result, "\n".join(lines))
    return result


if __name__ == "__main__":
    main()
