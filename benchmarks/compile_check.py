"""Compile the Triton kernels for Hopper and Ampere without a GPU, and report what ptxas reports.

    python benchmarks/compile_check.py                    # every kernel variant at the launch settings in use
    python benchmarks/compile_check.py --sweep            # plus candidate tiles: registers, spills, shared memory

The kernels' host functions run on CPU tensors with their launches recorded instead of executed, and
each recorded launch (argument types, constexprs, num_warps, and the specializations Triton's JIT
derives from the values: 16-byte aligned pointers, integers divisible by 16) is compiled through Triton's own
pipeline for sm_90a and sm_80: TTIR -> PTX -> cubin with the ptxas that ships with Triton.  This
catches what the interpreter cannot (code that only fails to compile, a tile that needs more shared
memory than the SM has) and shows each variant's registers, spill bytes, static SASS instruction count
and MMA instructions (wgmma on Hopper), so tile candidates that spill can be ruled out before device time is spent on them.
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
from kernel_facts import resident_blocks, sass_counts  # noqa: E402
from records import Record, add_out_options  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from hf_mhce.ops.triton_tile import override_tiles  # noqa: E402  (the rest where used: older checkouts lack them)

TARGETS = {"sm_90a": (90, 232448), "sm_80": (80, 166912)}  # capability, shared memory per block (bytes)


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


def specialize(kernel, args, kwargs, target) -> tuple[dict, dict, dict, dict]:
    """Triton's (options, signature, constexprs, attrs) for one launch from these values on ``target``,
    through the JIT's own binder: the attrs carry what a device launch specializes on (pointers aligned
    to 16 bytes, integers divisible by 16).  Compiled without them, a kernel's loads and MMA operands
    lose their vector widths and ptxas reported spills a device never showed (1276 bytes against 0 for
    the 128 x 256 x 64 forward on Hopper, H100 tile sweep 2026-11-24)."""
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, sig, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return options.__dict__, sig, constexprs, attrs


def ptxas_report(ptx: str, capability: int, arch: str) -> tuple[int, int, str | None]:
    """(registers per thread, spill store bytes) from ``ptxas -v``, and the cubin's SASS from the
    ``cuobjdump`` beside that ptxas (None without one): per-entry work a change adds or removes shows
    there, where registers saturate at 255."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(capability).path
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", src, "-o", src + ".o"],
                             capture_output=True, text=True, check=True).stderr
        cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
        sass = subprocess.run([cuobjdump, "-sass", src + ".o"], capture_output=True, text=True,
                              check=True).stdout if os.path.exists(cuobjdump) else None
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    return registers, sum(int(b) for b in re.findall(r"(\d+) bytes spill stores", log)), sass


def compile_launch(kernel, args, kwargs, arch: str) -> dict:
    capability, smem_limit = TARGETS[arch]
    target = GPUTarget("cuda", capability, 32)
    options, sig, constexprs, attrs = specialize(kernel, args, kwargs, target)
    compiled = triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=target, options=options)
    ptx = compiled.asm["ptx"]
    registers, spills, sass = ptxas_report(ptx, capability, arch)
    blocks, limited_by = resident_blocks(registers, compiled.metadata.num_warps, compiled.metadata.shared, arch)
    return {"arch": arch, "shared_bytes": compiled.metadata.shared, "shared_fits": compiled.metadata.shared <= smem_limit,
            "registers": registers, "spill_bytes": spills, **sass_counts(sass),
            "num_warps": compiled.metadata.num_warps, "blocks_per_sm": blocks, "limited_by": limited_by,
            "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
            # atomic instructions (atom.*, red.*): none, so that a step's results do not depend on the tiles' order
            "atomics": len(re.findall(r"^\s*(?:@%p\d+\s+)?(?:atom|red)\.", ptx, re.M)),
            "divisible_args": sum(["tt.divisibility", 16] in a for a in attrs.values()),
            "pointer_args": sum(t.startswith("*") for t in sig.values())}


VARIANTS = {  # name: (dtype, heads, bias, softcap, low_rank, ranks[, tokens, hidden, vocabulary])
    "ce bf16 + ranks": (torch.bfloat16, 1, False, None, False, True),
    "ce bf16": (torch.bfloat16, 1, False, None, False, False),  # the same without ranks: what ranks add
    "mhce4 bf16, bias, softcap, LoRA, ranks": (torch.bfloat16, 4, True, 30.0, True, True),
    "ce fp16": (torch.float16, 1, False, None, False, False),
    "ce fp32": (torch.float32, 1, False, None, False, False),
    "ce bf16 + ranks, odd N and V": (torch.bfloat16, 1, False, None, False, True, 300, 512, 1001),  # GPT-2's V
}


def drive(dtype, heads, bias, softcap, low_rank, ranks, n=1024, d=512, v=2048):
    """Run the forward and backward host functions once (their launches are recorded, not run).  The
    sizes are specialized on (divisible by 16 or not) as at the benchmark's Llama-3 and Mistral shapes;
    the odd variant stands for GPT-2's V = 50257 and ragged batches."""
    from hf_mhce.ops import triton_backward, triton_forward, triton_forward_grad

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(n, d, generator=g).to(dtype), torch.randn(v, d, generator=g).to(dtype)
    b = torch.randn(v, generator=g).to(dtype) if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    lr = (torch.randn(n, heads, 8, generator=g).to(dtype), torch.randn(v, 8, generator=g).to(dtype)) if low_rank else None
    triton_forward.forward_stats(x, w, b, labels, heads, softcap, True, need_ranks=ranks, low_rank=lr)
    stat = torch.zeros(n, heads)
    needs = (True, True, bias, True, True) if low_rank else (True, True, bias)
    triton_backward.backward(x, w, b, labels, stat, stat, stat, stat, stat, heads, softcap, needs, low_rank=lr)
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


KERNEL_NAMES = {"forward": "_forward_kernel", "backward": "_dlogits_kernel", "ranks": "_mixture_rank_kernel"}
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
    for bv in (64, 128):  # the mixture ranks' tiles at H = 4
        yield "mhce4 bf16, bias, softcap, LoRA, ranks", "ranks", {"BLOCK_N": 64, "BLOCK_V": bv, "BLOCK_K": 64}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--sweep", action="store_true",
                   help="also compile candidate tiles (bf16 CE and H=4 ranks for sm_90a, fp32 CE for both)")
    add_out_options(p)
    args = p.parse_args(argv)
    from hf_mhce.ops.triton_tile import _HOPPER_16BIT

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
            archs = ["sm_90a", "sm_80"] if "fp32" in variant else ["sm_90a"]  # float32 tiles are not Hopper's own
            rows += [{**row, "variant": f"sweep {kernel}" + (", fp32" if "fp32" in variant else "")} for row in
                     check({variant: VARIANTS[variant]}, archs, {kernel: tile}, KERNEL_NAMES[kernel])]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = [f"# Triton kernels compiled for {', '.join(args.arch)} without a GPU ({stamp}, triton {triton.__version__})",
             "", "Registers and spill bytes from ptxas -v, static SASS instructions from cuobjdump -sass (all; "
             "the K loop's; per tile outside it); shared memory from Triton's metadata; blocks_per_sm: blocks "
             "resident per SM from those (`kernel_facts.resident_blocks`), and the resource that limits them. No timings.", "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    record.write(rows, "\n".join(lines))
    failed = [r for r in rows if "error" in r or not r.get("shared_fits", True)]
    if failed and not args.sweep:
        raise SystemExit(f"{len(failed)} launch(es) failed to compile or need more shared memory than the SM has")


if __name__ == "__main__":
    main()
