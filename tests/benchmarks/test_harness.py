"""The GPU benchmark scripts, run end to end on CPU at tiny shapes with the Triton interpreter.

Device time is scarce (a session may get a GPU for 30 minutes, or none): a script that breaks on a
renamed option or a changed API must fail here, not on the device.  Each script runs as a
subprocess (TRITON_INTERPRET=1 has to be set before triton is imported), writes its record, and
the record's correctness columns are checked: a harness that times wrong answers is no harness.
Timings at these shapes mean nothing and are not looked at.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
BF16_TOL = 1e-2  # relative L2 of bf16 dX / dW against float32/float64 references at these sizes


def _run(script: str, *args: str, out: Path) -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / script), *args, "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = sorted(out.glob("*.json"))
    assert len(records) == 1 and records[0].with_suffix(".md").is_file(), list(out.iterdir())
    return json.loads(records[0].read_text())


def test_peers_table(tmp_path):
    variants = ["hf_eager", "liger", "hf_mhce_ce", "hf_mhce_mhce4", "hf_mhce_ranks", "slab_fwdgrad"]
    # 9 tokens: one partial row block (the interpreter's time grows with the blocks; kernels are checked in tests/ops)
    rows = _run("peers.py", "--device", "cpu", "--small", "--tokens", "9", "--reps", "1", "--rotate", "1",
                "--variants", *variants, out=tmp_path)
    by_name = {r["variant"]: r for r in rows}
    assert list(by_name) == variants
    note = by_name["liger"]["note"]  # a peer that cannot run here is a row that says why
    assert "need CUDA" in note or "not installed" in note, note
    for name in set(variants) - {"liger"}:
        r = by_name[name]
        assert "note" not in r, r
        assert r["loss_rel_err"] < 1e-3, r  # MHCE rows against the MHCE reference, not CE's
        assert r["fwd_ms"] > 0 and r["vs_floor"] > 0
        if name != "hf_mhce_ranks":  # forward only (evaluation)
            assert r["dx_rel_err"] < BF16_TOL and r["dw_rel_err"] < BF16_TOL, r
            assert r["fwd_bwd_ms"] > 0
    table = next(tmp_path.glob("*.md")).read_text()
    assert "| hf_mhce_mhce4 |" in table and "floor" in table


@pytest.mark.parametrize("lora", [0, 2], ids=["plain", "low_rank"])
def test_gpu_suite(tmp_path, lora):
    rows = _run("gpu_suite.py", "--device", "cpu", "--small", "--tokens", "21", "--vocab", "517", "--hidden", "24",
                "--heads", "2", "--dtypes", "float32", "bfloat16", "--reps", "1", "--lora-rank", str(lora),
                out=tmp_path)
    assert [(r["dtype"], r["heads"]) for r in rows] == [("float32", 2), ("bfloat16", 2)]
    grads = ["err_dx", "err_db"] + (["err_du", "err_dlb"] if lora else ["err_dw"])
    for r in rows:
        tol = 1e-5 if r["dtype"] == "float32" else BF16_TOL
        assert r["err_loss"] < tol and all(r[k] < tol for k in grads), r
        if r["dtype"] == "bfloat16":  # no worse than eager in the same dtype, up to one rounding
            assert all(r[k] <= 2 * r[f"eager_{k}"] + 1e-3 for k in ["err_loss", *grads]), r


def test_tile_sweep(tmp_path):
    rows = _run("tile_sweep.py", "--device", "cpu", "--small", "--reps", "1", "--budget-s", "20", out=tmp_path)
    assert {r["stage"] for r in rows} == {"forward tiles", "forward splits", "backward tiles", "backward groups"}
    timed = [r for r in rows if "ms" in r]
    assert timed, rows  # the budget lets the first settings run
    for r in rows:
        assert not r.get("note", "").startswith("failed"), r
    assert all(r["rel_err_vs_default"] <= 2e-3 for r in timed), timed


def test_gpu_ties(tmp_path):
    rows = _run("gpu_ties.py", "--device", "cpu", "--small", "--heads", "1", "2", out=tmp_path)
    assert [(r["dtype"], r["heads"]) for r in rows] == [("float32", 1), ("float32", 2), ("bfloat16", 1), ("bfloat16", 2)]
    for r in rows:
        assert r["wrong_ranks"] == 0 and r["duplicates_ranked_above"] == 0, r
        assert r["rows_compared"] >= 0.9 * r["rows"], r  # few rows left out as near-ties
        assert 0 < r["median_rank"] < 300, r  # informative ranks, neither all 0 nor all V
