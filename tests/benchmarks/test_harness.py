"""The GPU benchmark scripts, run end to end on CPU at tiny shapes with the Triton interpreter.

Device time is scarce (a session may get a GPU for 30 minutes, or none): a script that breaks on a
renamed option or a changed API must fail here, not on the device.  The scripts run one after the
other in one subprocess (TRITON_INTERPRET=1 has to be set before triton is imported), each with its
own --out; each writes its record, and the record's correctness columns are checked: a
harness that times wrong answers is no harness.
Timings at these shapes mean nothing and are not looked at.
"""

import json
import os
from pathlib import Path

import pytest
from script_runs import output, run_scripts

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
BF16_TOL = 1e-2  # relative L2 of bf16 dX / dW against float32/float64 references at these sizes

# The scripts one after the other in one interpreter (tests/script_runs.py): the tests share one start
# (torch, triton, hf_mhce imported once) instead of five; each run has its own --out.
RUNS = {
    # 9 tokens: one partial row block (the interpreter's time grows with the blocks; kernels are checked in tests/ops)
    "peers": ["peers", "--device", "cpu", "--small", "--tokens", "9", "--reps", "1", "--rotate", "1", "--variants",
              "hf_eager", "liger", "hf_mhce_ce", "hf_mhce_ce_lean", "hf_mhce_ce_fast", "hf_mhce_mhce4", "hf_mhce_ranks",
              "hf_mhce_mhce4_ranks", "slab_ranks", "slab_fwdgrad"],
    # V = 263: 9 vocabulary tiles under the interpreter (BLOCK_V 32), the last partial, like every tiny shape here
    **{f"gpu_suite_{name}": ["gpu_suite", "--device", "cpu", "--small", "--tokens", "21", "--vocab", "263",
                             "--hidden", "24", "--heads", "2", "--dtypes", "float32", "bfloat16", "--reps", "1",
                             "--lora-rank", rank]
       for name, rank in (("plain", "0"), ("low_rank", "2"))},
    # a budget of over 3x the setup (inputs, their statistics: ~3 s here): the first settings run, on a busy machine too
    "tile_sweep": ["tile_sweep", "--device", "cpu", "--small", "--reps", "1", "--budget-s", "10"],
    "gpu_ties": ["gpu_ties", "--device", "cpu", "--small", "--heads", "1", "2"],
    "gpu_ties_softcap": ["gpu_ties", "--device", "cpu", "--small", "--heads", "2", "--softcap", "3"],
}


@pytest.fixture(scope="module")
def run_all(tmp_path_factory):
    base = tmp_path_factory.mktemp("bench")
    runs = {name: [str(BENCH / f"{script}.py"), *argv, "--out", str(base / name)] for name, (script, *argv) in RUNS.items()}
    for name in RUNS:
        (base / name).mkdir()
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return base, run_scripts(runs, base, env, timeout=1000)


def _run(run_all, name: str) -> list[dict]:
    base, status = run_all
    assert status[name] == 0, (status[name], *(text[-4000:] for text in output(base, name)))
    out = base / name
    records = sorted(out.glob("*.json"))
    assert len(records) == 1 and records[0].with_suffix(".md").is_file(), list(out.iterdir())
    return json.loads(records[0].read_text())


def test_peers_table(run_all):
    variants = ["hf_eager", "liger", "hf_mhce_ce", "hf_mhce_ce_lean", "hf_mhce_ce_fast", "hf_mhce_mhce4", "hf_mhce_ranks",
                "hf_mhce_mhce4_ranks", "slab_ranks", "slab_fwdgrad"]
    assert RUNS["peers"][-len(variants):] == variants
    rows = _run(run_all, "peers")
    by_name = {r["variant"]: r for r in rows}
    assert list(by_name) == variants
    note = by_name["liger"]["note"]  # a peer that cannot run here is a row that says why
    assert "need CUDA" in note or "not installed" in note, note
    for name in set(variants) - {"liger"}:
        r = by_name[name]
        assert "note" not in r, r
        assert r["loss_rel_err"] < 1e-3, r  # MHCE rows against the MHCE reference, not CE's
        assert r["fwd_ms"] > 0 and r["vs_floor"] > 0
        if name not in ("hf_mhce_ranks", "hf_mhce_mhce4_ranks", "slab_ranks"):  # forward only (evaluation)
            assert r["dx_rel_err"] < BF16_TOL and r["dw_rel_err"] < BF16_TOL, r
            assert r["fwd_bwd_ms"] > 0
    table = next((run_all[0] / "peers").glob("*.md")).read_text()
    assert "| hf_mhce_mhce4 |" in table and "floor" in table
    assert "| ranks | hf_mhce_mhce4_ranks vs hf_mhce_mhce4 |" in table  # the several-head rank sweep against its forward
    # the P6 verdicts (benchmarks/targets.py): liger cannot run here, so its comparison is owed, not passed
    assert "## P6 targets" in table and "| liger | hf_mhce_ce (512 MB, default) | - | < 1.0 | owed: liger: " in table
    assert "- every CE target at once, hf_mhce_ce_fast (8192 MB): no (misses time; owed: cce, liger, memory)" in table


@pytest.mark.parametrize("lora", [0, 2], ids=["plain", "low_rank"])
def test_gpu_suite(run_all, lora):
    rows = _run(run_all, f"gpu_suite_{'low_rank' if lora else 'plain'}")
    assert [(r["dtype"], r["heads"]) for r in rows] == [("float32", 2), ("bfloat16", 2)]
    grads = ["err_dx", "err_db"] + (["err_du", "err_dlb"] if lora else ["err_dw"])
    for r in rows:
        tol = 1e-5 if r["dtype"] == "float32" else BF16_TOL
        assert r["err_loss"] < tol and all(r[k] < tol for k in grads), r
        assert r["bitwise_repeat"] is True, r  # the field is written; only a GPU's tile order can break it
        if r["dtype"] == "bfloat16":  # no worse than eager in the same dtype, up to one rounding
            assert all(r[k] <= 2 * r[f"eager_{k}"] + 1e-3 for k in ["err_loss", *grads]), r


def test_tile_sweep(run_all):
    rows = _run(run_all, "tile_sweep")
    assert {r["stage"] for r in rows} == {"forward tiles", "forward splits", "backward tiles", "backward groups",
                                         "forward tiles with ranks"}
    timed = [r for r in rows if "ms" in r]
    assert timed, rows  # the budget lets the first settings run
    for r in rows:
        assert not r.get("note", "").startswith("failed"), r
    assert all(r["rel_err_vs_default"] <= 2e-3 for r in timed), timed


def test_gpu_ties_with_a_softcap(run_all):
    """The softcap case device_run.sh checks on the GPU (where the rank kernel's c * tanh once went into an fma):
    here the script's float64 reference with the cap, and the interpreted kernels, agree."""
    rows = _run(run_all, "gpu_ties_softcap")
    assert [(r["forward"], r["heads"], r["softcap"]) for r in rows] == [("tile", 2, 3.0)] * 2, rows
    for r in rows:
        assert r["wrong_ranks"] == 0 and r["duplicates_ranked_above"] == 0 and r["rows_compared"] >= 0.9 * r["rows"], r


def test_gpu_ties(run_all):
    rows = _run(run_all, "gpu_ties")
    assert [(r["forward"], r["dtype"], r["heads"]) for r in rows] == [
        (forward, dtype, heads) for dtype in ("float32", "bfloat16") for heads in (1, 2)
        for forward in (("tile", "slab") if heads == 1 else ("tile",))]  # the slab candidate: one head
    for r in rows:
        assert r["wrong_ranks"] == 0 and r["duplicates_ranked_above"] == 0, r
        assert r["rows_compared"] >= 0.9 * r["rows"], r  # few rows left out as near-ties
        assert 0 < r["median_rank"] < 300, r  # informative ranks, neither all 0 nor all V
