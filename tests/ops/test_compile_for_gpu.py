"""The Triton kernels compiled for Hopper (sm_90a) and Ampere (sm_80) on this GPU-less machine, through
Triton's own pipeline and the ptxas it ships (benchmarks/compile_check.py): the interpreter runs the
kernels' logic but never compiles them, so code that only fails to compile, or a tile that needs more
shared memory than an SM has, would otherwise first show on a GPU.  Spills are reported, not asserted:
they cost time, which only a GPU can measure (benchmarks/tile_sweep.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_every_kernel_variant_compiles_for_hopper_and_ampere(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(BENCH / "compile_check.py"), "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # every launch states FMA contraction: Triton warns (and 3.10 flips the default) otherwise
    assert "TRITON_DEFAULT_FP_FUSION" not in proc.stderr, proc.stderr[-2000:]
    rows = json.loads(next(tmp_path.glob("compile-check-*.json")).read_text())
    kernels = {r["kernel"] for r in rows}
    tiles = {"target_kernel", "forward_kernel", "mixture_rank_kernel", "dlogits_kernel"}  # matmul tiles inside
    assert kernels == tiles | {"row_stats_kernel", "dlogits_in_place_kernel"}, kernels  # row passes on a slab
    assert {r["arch"] for r in rows} == {"sm_90a", "sm_80"}
    for r in rows:
        assert "error" not in r and r["shared_fits"], r
        assert 0 < r["registers"] <= 255, r
        if r["kernel"] in tiles and not r["variant"].endswith("fp32"):  # 16-bit inputs run on tensor cores: wgmma on Hopper
            assert (r["wgmma"] > 0) if r["arch"] == "sm_90a" else (r["mma_sync"] > 0), r
