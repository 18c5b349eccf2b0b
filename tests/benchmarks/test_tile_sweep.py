"""benchmarks/tile_sweep.py stopped part-way, and its rows compiled again by compile_vs_device.py, on CPU.

The first device run's sweep was given a fixed budget longer than the time its step had left, and
wrote its record only at the end: the step's SIGTERM lost every row.  Its ranks rows were compiled
again as the plain forward kernel, beside the registers of the kernel with ranks.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_sigterm_keeps_the_rows_finished(tmp_path):
    """Stopped after its first timed setting (the way device_run.sh's step stops it), the sweep writes
    a record with every row it had reported, says it was stopped, and exits 128 + 15."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("OUT", None)
    proc = subprocess.Popen([sys.executable, str(BENCH / "tile_sweep.py"), "--device", "cpu", "--small", "--reps", "1",
                             "--budget-s", "600", "--out", str(tmp_path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    reported, deadline = [], time.monotonic() + 300
    try:
        for line in proc.stdout:  # the sweep prints each row as JSON when it is finished
            if line.startswith('{"stage"'):
                reported.append(json.loads(line))
                if "ms" in reported[-1]:
                    break
            assert time.monotonic() < deadline, "no row timed in 300 s"
        assert reported and "ms" in reported[-1], "the sweep ended before it timed a setting"
        proc.send_signal(signal.SIGTERM)
        proc.stdout.read()
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    (record,) = tmp_path.glob("tile_sweep-cpu-*-small-reps_1-budget-s_600.json")
    rows = json.loads(record.read_text())
    assert [(r["stage"], r["settings"]) for r in rows[:len(reported)]] == [(r["stage"], r["settings"]) for r in reported]
    assert all(r["ms"] > 0 for r in rows if "ms" in r) and len(rows) < 14  # the sweep has 14 settings at --small
    assert "Stopped by signal 15" in record.with_suffix(".md").read_text()


def test_ranks_rows_compile_the_kernel_with_ranks(tmp_path):
    """compile_vs_device.py compiles each forward row of a sweep record: the rows of the stage "forward
    tiles with ranks" (kernel "forward") as the evaluation forward (need_ranks: NEED_RANKS in the kernel
    at one head), the others as the training forward.  ptxas is stubbed out: only the launch is checked."""
    settings = {"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    row = {"kernel": "forward", "settings": settings, "regs": 200, "spills": 0, "ms": 1.0, "D": 4096, "V": 128256,
           "N": 16384}
    sweep = [{**row, "stage": "forward tiles", "heads": 1}, {**row, "stage": "forward tiles with ranks", "heads": 1},
             {**row, "stage": "forward tiles with ranks", "heads": 4}]
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    driver = f"""
import sys
sys.path.insert(0, {str(BENCH)!r})
import compile_vs_device as c
facts = {{"registers": 200, "spill_bytes": 0, "blocks_per_sm": 1, "k_loop_instructions": None, "per_tile_instructions": None}}
compiled = []
c.compile_launch = lambda kernel, args, kwargs, arch: compiled.append(kwargs["NEED_RANKS"]) or dict(facts)
c.main([{str(tmp_path / "sweep.json")!r}, "--out", {str(tmp_path)!r}])
print("NEED_RANKS", compiled)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OUT")}
    proc = subprocess.run([sys.executable, "-c", driver], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # H = 4 ranks in a kernel of their own after the forward, whose registers the sweep reported
    assert "NEED_RANKS [False, True, False]" in proc.stdout, proc.stdout[-3000:]
    got = json.loads(next(tmp_path.glob("compile-vs-device-*.json")).read_text())
    assert [(r["stage"], r["need_ranks"]) for r in got] == [("forward tiles", False), ("forward tiles with ranks", True),
                                                           ("forward tiles with ranks", False)], got
