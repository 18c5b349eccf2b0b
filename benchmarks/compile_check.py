"""Compile the Triton kernels for Hopper and Ampere without a GPU, and report what ptxas reports.

    python benchmarks/compile_check.py                    # every kernel variant at the launch settings in use
    python benchmarks/compile_check.py --sweep            # plus candidate tiles: registers, spills, shared memory

The kernels' host functions run on CPU tensors with their launches recorded instead of executed, and
each recorded launch (argument types, constexprs, num_warps) is compiled through Triton's own
pipeline for sm_90a and sm_80: TTIR -> PTX -> cubin with the ptxas that ships with Triton.  This
catches what the interpreter cannot (code that only fails to compile, a tile that needs more shared
memory than the SM has) and shows each variant's registers, spill bytes and MMA instructions (wgmma
on Hopper), so tile candidates that spill can be ruled out before device time is spent on them.
Speed is not measured here: that needs the GPU (tile_sweep.py).  Writes <out>/compile-check-<date>.json
and .md, with non-default options in the name (records.py's rule: ``--sweep`` adds ``-sweep``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from records import Record, add_out_options  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from hf_mhce.ops import triton_backward, triton_forward, triton_forward_grad  # noqa: E402
from hf_mhce.ops.triton_tile import _HOPPER_16BIT, override_tiles  # noqa: E402

TARGETS = {"sm_90a": (90, 232448), "sm_80": (80, 166912)}  # capability, shared memory per block (bytes)
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
          torch.int32: "i32"}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


def record_launches(run) -> list[tuple]:
    """(kernel, args, kwargs) of every launch ``run()`` makes, none executed."""
    launches = []
    original = JITFunction.__getitem__
    JITFunction.__getitem__ = lambda kernel, grid: lambda *a, **k: launches.append((kernel, a, k))
    try:
        run()
    finally:
        JITFunction.__getitem__ = original
    return launches


def signature(kernel, args, kwargs) -> tuple[dict, dict]:
    """Triton's (signature, constexprs) of one launch, typed as a launch from these values would be."""
    values = dict(zip(kernel.arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
    sig, constexprs = {}, {}
    for i, param in enumerate(kernel.params):
        v = values[param.name]
        if param.is_constexpr:
            sig[param.name], constexprs[(i,)] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[param.name] = "*" + _TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[param.name] = "i1"
        elif isinstance(v, int):
            sig[param.name] = "i32" if -2**31 <= v < 2**31 else "i64"
        else:
            sig[param.name] = "fp32"
    return sig, constexprs


def ptxas_report(ptx: str, capability: int, arch: str) -> tuple[int, int]:
    """(registers per thread, spill store bytes) from ``ptxas -v``."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([get_ptxas(capability).path, "-v", f"--gpu-name={arch}", src, "-o", src + ".o"],
                             capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    return registers, sum(int(b) for b in re.findall(r"(\d+) bytes spill stores", log))


def compile_launch(kernel, args, kwargs, arch: str) -> dict:
    capability, smem_limit = TARGETS[arch]
    sig, constexprs = signature(kernel, args, kwargs)
    options = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
    compiled = triton.compile(ASTSource(kernel, sig, constexprs), target=GPUTarget("cuda", capability, 32),
                              options=options)
    ptx = compiled.asm["ptx"]
    registers, spills = ptxas_report(ptx, capability, arch)
    return {"arch": arch, "shared_bytes": compiled.metadata.shared, "shared_fits": compiled.metadata.shared <= smem_limit,
            "registers": registers, "spill_bytes": spills, "num_warps": compiled.metadata.num_warps,
            "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync")}


VARIANTS = {  # name: (dtype, heads, bias, softcap, low_rank, ranks)
    "ce bf16 + ranks": (torch.bfloat16, 1, False, None, False, True),
    "mhce4 bf16, bias, softcap, LoRA, ranks": (torch.bfloat16, 4, True, 30.0, True, True),
    "ce fp16": (torch.float16, 1, False, None, False, False),
    "ce fp32": (torch.float32, 1, False, None, False, False),
}


def drive(dtype, heads, bias, softcap, low_rank, ranks, n=300, d=512, v=1000):
    """Run the forward and backward host functions once (their launches are recorded, not run)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(n, d, generator=g).to(dtype), torch.randn(v, d, generator=g).to(dtype)
    b = torch.randn(v, generator=g).to(dtype) if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    lr = (torch.randn(n, heads, 8, generator=g).to(dtype), torch.randn(v, 8, generator=g).to(dtype)) if low_rank else None
    triton_forward.forward_stats(x, w, b, labels, heads, softcap, True, need_ranks=ranks, low_rank=lr)
    stat = torch.zeros(n, heads)
    needs = (True, True, bias, True, True) if low_rank else (True, True, bias)
    triton_backward.backward(x, w, b, labels, stat, stat, stat, stat, heads, softcap, needs, low_rank=lr)
    grads = triton_forward_grad.forward_with_grads(x, w, b, labels, labels >= 0, heads, softcap, 0.1, 0.0,
                                                   torch.ones(()), needs, low_rank=lr)  # one chunk fits
    assert (grads is None) == (dtype == torch.float16), "gradients in the forward: launched unless fp16"
    triton_forward_grad.slab_forward_stats(x, w, b, labels, heads, softcap, True, need_ranks=ranks and heads == 1,
                                           low_rank=lr)


def check(variants, archs, tiles=None, only=None) -> list[dict]:
    """One row per (variant, distinct launch, arch).  ``tiles``: {kernel: settings} to compile instead;
    ``only``: the name of the one kernel to compile."""
    rows = []
    for name, spec in variants.items():
        with contextlib.ExitStack() as stack:
            for kernel_name, settings in (tiles or {}).items():
                stack.enter_context(override_tiles(kernel_name, **settings))
            launches = record_launches(lambda: drive(*spec))
        seen = set()
        for kernel, args, kwargs in launches:
            key = (kernel.__name__, tuple(sorted(kwargs.items())))
            if key in seen or (only and kernel.__name__ != only):
                continue
            seen.add(key)
            tile = {k: kwargs[k] for k in ("BLOCK_N", "BLOCK_V", "BLOCK_K", "num_warps", "num_stages") if k in kwargs}
            for arch in archs:
                row = {"variant": name, "kernel": kernel.__name__.strip("_"), **tile}
                try:
                    row.update(compile_launch(kernel, args, kwargs, arch))
                except Exception as err:  # noqa: BLE001 - recorded: a failure is a result here
                    row.update(arch=arch, error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
                rows.append(row)
                print(row, flush=True)
    return rows


KERNEL_NAMES = {"forward": "_forward_kernel", "backward": "_dlogits_kernel"}  # launch settings -> kernel
# launch settings -> the kernels (as rows name them) that take them
SETTINGS_USERS = {"forward": {"forward_kernel", "target_kernel"}, "backward": {"dlogits_kernel"},
                  "ranks": {"mixture_rank_kernel"}}


def sweep_candidates():
    """Tile candidates for the sweep: the GPU tile sweep's space, for the two kernels that matter."""
    for kernel, bn, bv, bk, warps in itertools.product(("forward", "backward"), (64, 128), (64, 128, 256), (32, 64),
                                                       (4, 8)):
        yield "ce bf16 + ranks", kernel, {"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": bk, "num_warps": warps}
    for kernel, bk in itertools.product(("forward", "backward"), (16, 32, 64)):  # float32: FMA, operands in registers
        yield "ce fp32", kernel, {"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_K": bk, "num_warps": 8}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--sweep", action="store_true", help="also compile candidate tiles (bf16 and fp32 CE, sm_90a)")
    add_out_options(p)
    args = p.parse_args(argv)
    stamp = datetime.date.today().isoformat()
    record = Record(p, args, f"compile-check-{stamp}")
    rows = check({k: VARIANTS[k] for k in args.variants}, args.arch)
    if "sm_90a" in args.arch:  # Hopper's own 16-bit tiles (launch_config picks them on an sm_90 device only)
        for name in (k for k in args.variants if VARIANTS[k][0] != torch.float32):
            rows += [{**r, "variant": f"{name}, Hopper tiles"} for r in
                     check({name: VARIANTS[name]}, ["sm_90a"], _HOPPER_16BIT)
                     if any(r["kernel"] in SETTINGS_USERS[k] for k in _HOPPER_16BIT)]
    if args.sweep:
        for variant, kernel, tile in sweep_candidates():
            rows += [{**row, "variant": f"sweep {kernel}" + (", fp32" if "fp32" in variant else "")} for row in
                     check({variant: VARIANTS[variant]}, ["sm_90a"], {kernel: tile}, KERNEL_NAMES[kernel])]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = [f"# Triton kernels compiled for {', '.join(args.arch)} without a GPU ({stamp}, triton {triton.__version__})",
             "", "Registers and spill bytes from ptxas -v; shared memory from Triton's metadata. No timings.", "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    record.write(rows, "\n".join(lines))
    failed = [r for r in rows if "error" in r or not r.get("shared_fits", True)]
    if failed and not args.sweep:
        raise SystemExit(f"{len(failed)} launch(es) failed to compile or need more shared memory than the SM has")


if __name__ == "__main__":
    main()
