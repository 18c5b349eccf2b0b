"""Two CPU processes (torch.distributed, gloo) report the same RBE statistics and metrics as one
process on the same evaluation data: counts exactly, floats to 1e-9; also for eval sets whose size
is not a multiple of the global batch (accelerate's padding rows are not counted, packed rows and
batches dispatched from process 0 too)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch_helpers import DISTRIBUTED_VARS, child_env, free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def _single_process_reference(tmp_path, monkeypatch):
    for var in DISTRIBUTED_VARS:
        monkeypatch.delenv(var, raising=False)
    import dist_worker

    threads = torch.get_num_threads()
    try:
        return dist_worker.run(str(tmp_path / "single"))
    finally:
        torch.set_num_threads(threads)


def _assert_same(got: dict, ref: dict, what: str):
    assert got["stats"].keys() == ref["stats"].keys()
    for key, stats in ref["stats"].items():
        assert got["stats"][key]["counts"] == stats["counts"], f"{what} {key}: counts differ"
        assert sum(stats["counts"]) > 0
        torch.testing.assert_close(torch.tensor(got["stats"][key]["nll_sums"], dtype=torch.float64),
                                   torch.tensor(stats["nll_sums"], dtype=torch.float64), rtol=1e-9, atol=1e-12)
    assert got["metrics"].keys() == ref["metrics"].keys() and ref["metrics"]
    for key, value in ref["metrics"].items():
        assert got["metrics"][key] == pytest.approx(value, rel=1e-9, abs=1e-12), f"{what} {key}"


def test_two_processes_match_one(tmp_path, monkeypatch):
    out = tmp_path / "dist.json"
    env = child_env(str(HERE), str(HERE.parent), str(ROOT), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(HERE / "dist_worker.py"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180, cwd=str(tmp_path))
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    dist = json.loads(out.read_text())
    assert dist["world_size"] == 2

    single = _single_process_reference(tmp_path, monkeypatch)
    assert single["world_size"] == 1
    assert set(single["trainer"]["stats"]) == {"eval_mixed", "eval_ragged", "eval_short", "packed", "dispatched",
                                               "right_padded", "left_padded"}
    metrics = single["trainer"]["metrics"]  # packing leaves the counted tokens as they are, so does the padding side
    assert metrics["packed_rbe_num_tokens"] == metrics["eval_ragged_rbe_num_tokens"]
    assert metrics["right_padded_rbe_num_tokens"] == metrics["left_padded_rbe_num_tokens"] > 0
    assert single["trainer"]["metrics"]["eval_mixed_rbe_num_tokens"] == 8 * 15
    assert single["trainer"]["metrics"]["eval_short_rbe_num_tokens"] == 5 * 15
    assert single["trainer"]["metrics"]["dispatched_rbe_num_tokens"] == 5 * 15
    _assert_same(dist["trainer"], single["trainer"], "Trainer.evaluate")
    _assert_same(dist["standalone"], single["standalone"], "rbe.evaluate")
    assert single["warnings"] == {"same_rows": [], "even_batches": []}
    assert dist["warnings"]["same_rows"] == ["all 2 processes evaluated the same tokens, which the RBE statistics "
                                             "count 2 times (num_tokens); give each process its share of the rows, "
                                             "or all_reduce=False"]
    assert len(dist["warnings"]["even_batches"]) == 1 and "repeated rows" in dist["warnings"]["even_batches"][0]
    assert dist["rank0_alone"] == single["rank0_alone"]  # all of the rows, in process 0 alone
