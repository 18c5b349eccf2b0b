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
        assert r["atomics"] == 0, r  # a bitwise repeatable step: no kernel adds with atomics (dB included)
        assert 0 < r["registers"] <= 255, r
        if r["kernel"] in tiles and not r["variant"].endswith("fp32"):  # 16-bit inputs run on tensor cores: wgmma on Hopper
            assert (r["wgmma"] > 0) if r["arch"] == "sm_90a" else (r["mma_sync"] > 0), r
            if r["sass_instructions"] is not None:  # the cuobjdump beside ptxas: where the instructions sit
                assert 0 < r["k_loop_instructions"] < r["per_tile_instructions"] < r["sass_instructions"], r
        assert r["blocks_per_sm"] >= 1 and r["limited_by"], r
    # compiled as a device launch specializes them (Triton's binder): fresh tensors are 16-byte aligned, and
    # odd N and V leave fewer integers divisible by 16 (a compile without these attributes reported spills
    # that the H100 never showed)
    forward = {r["variant"]: r for r in rows if r["kernel"] == "forward_kernel" and r["arch"] == "sm_90a"}
    even, odd = forward["ce bf16 + ranks"], forward["ce bf16 + ranks, odd N and V"]
    assert even["divisible_args"] > odd["divisible_args"] >= even["pointer_args"] == odd["pointer_args"] > 0


def test_compiled_here_as_the_h100_compiled_it(tmp_path):
    """compile_vs_device.py on two rows of the H100 tile sweep: the Hopper forward tile (128 x 256 x 64,
    8 warps, 4 stages: 247 registers, no spills on the device) and the same tile with 4 warps (spills).
    A compile without the launch's specializations reported 1276 spill bytes for the first."""
    record = BENCH / "results" / "tile_sweep-NVIDIA-H100-80GB-HBM3-2026-11-24-budget-s_240.json"
    rows = [r for r in json.loads(record.read_text()) if r["stage"] == "forward tiles" and "regs" in r]
    hopper = {"BLOCK_N": 128, "BLOCK_V": 256, "BLOCK_K": 64, "num_stages": 4}
    picked = [next(r for r in rows if r["settings"] == {**hopper, "num_warps": warps}) for warps in (8, 4)]
    assert [r["regs"] for r in picked] == [247, 255] and picked[1]["spills"] > 0 == picked[0]["spills"]
    (tmp_path / "sweep.json").write_text(json.dumps(picked))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OUT")}
    script = str(BENCH / "compile_vs_device.py")
    proc = subprocess.run([sys.executable, script, str(tmp_path / "sweep.json"), "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(next(tmp_path.glob("compile-vs-device-*.json")).read_text())
    assert [r["spills_agree"] for r in got] == [True, True], got
    # 247 on the device; compiled here, that kernel with its maximum and log-sum stored apart (one more store)
    # took 246 with Triton 3.6 (the device's) and 248 with 3.9.  Since the tiles keep the rest of the sum apart
    # from the maximum's 1 (NOTES change 13: a tie count and a select per entry) 255 with 3.9, still without
    # spills; the device's count for this kernel is owed (benchmarks/device_run.sh tune)
    assert 245 <= got[0]["registers"] <= 255, got
    # static facts beside the device's time: one block of 8 warps per SM (registers and 192 KB of stages), the
    # operand bytes 128 x 256 tiles load at N = 16384, V = 128256, D = 4096, and the K loop run 4096 / 64 times
    first = got[0]
    assert first["blocks_per_sm"] == 1 and first["operand_gb"] == 128 * 501 * (128 + 256) * 4096 * 2 / 1e9, first
    assert first["operand_tb_s"] == first["operand_gb"] / first["device_ms"] and 29.3 < first["device_ms"] < 29.4, first
    assert first["issue_per_tile"] == first["k_loop_instructions"] * 64 + first["per_tile_instructions"] > 0, first
    bad = subprocess.run([sys.executable, script, str(tmp_path / "missing.json"), "--out", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "cannot read the sweep record" in bad.stderr, bad.stderr[-2000:]


SOFTCAP_USES = r'''
import json, re, sys
sys.path.insert(0, sys.argv[1])
import torch, triton
import compile_check as cc
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

out = {}
for kernel, args, kwargs in cc.record_launches(lambda: cc.drive(torch.bfloat16, 4, True, 30.0, False, True,
                                                                 n=128, d=128, v=520)):
    name = kernel.__name__
    if name not in ("_mixture_rank_kernel", "_target_kernel"):
        continue
    target = GPUTarget("cuda", 90, 32)
    options, sig, constexprs, attrs = cc.specialize(kernel, args, kwargs, target)
    ptx = triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=target, options=options).asm["ptx"]
    param = re.search(rf"ld\.param\.(?:b32|f32)\s+(%[rf]\d+),\s*\[{name}_param_{list(sig).index('softcap')}\]", ptx)
    regs = {param.group(1)} | set(re.findall(rf"mov\.b32\s+(%f\d+),\s*{re.escape(param.group(1))}\b", ptx))
    ops = [line.split()[0] for line in ptx.splitlines() if any(re.search(rf"{re.escape(r)}[,;\s]", line) for r in regs)
           and not line.strip().startswith(("ld.param", "mov"))]
    out[name] = sorted(set(ops))
print(json.dumps(out))
'''


def test_a_softcap_product_is_rounded_alike_where_a_tie_is_ranked(tmp_path):
    """Ranks with several heads and a softcap: the rank kernel's c * tanh was fused into the subtraction of the
    logsumexp (fma.rn.f32, unrounded) while _target_kernel stored it rounded (mul.f32), so a vocabulary row equal
    to the target's was ranked above it on a GPU (20.7% of tokens in an emulation); the interpreter never fuses.
    Compiled for sm_90a as a launch specializes it: the softcap multiplies alone (mul.f32), in both kernels."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SOFTCAP_USES, str(BENCH)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    uses = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(uses) == {"_mixture_rank_kernel", "_target_kernel"}, uses
    for name, ops in uses.items():  # y / c into tanh, then c * tanh on its own: no fma takes the softcap
        assert "mul.f32" in ops and not any(op.startswith("fma") for op in ops), (name, ops)
