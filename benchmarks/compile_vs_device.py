"""How well compile_check.py predicts a GPU: each forward row of a device tile sweep, compiled here.

    python benchmarks/compile_vs_device.py benchmarks/results/tile_sweep-NVIDIA-H100-80GB-HBM3-2026-11-24-budget-s_240.json

For every forward row of the sweep record (tile_sweep.py's JSON: settings, and the registers and spills
the device's compiled kernel reported), the same launch -- the training forward of ``Problem.forward``:
16-bit inputs, no bias, no soft-cap, no logit sum, the row's heads -- is compiled for the row's
architecture through compile_check's path, at small sizes that keep the sweep's N, D and V divisibility
by 16, and ptxas's registers and spill bytes are put beside the device's.  Registers should agree
exactly where the Triton version is the device's; the device reports spills in another unit, so they
are compared as zero or not.  The sweep's backward rows are left out: the kernel they timed (the atomic
backward) has since been replaced.  Writes <out>/compile-vs-device-<date>-triton_<version>-<sweep>.json/.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from compile_check import compile_launch, record_launches  # noqa: E402
from records import Record, add_out_options  # noqa: E402

from hf_mhce.ops import triton_forward  # noqa: E402
from hf_mhce.ops.triton_tile import override_tiles  # noqa: E402


def small_size(size: int, base: int) -> int:
    """``base`` (a multiple of 16) or one more: the same divisibility by 16 as ``size``."""
    return base if size % 16 == 0 else base + 1


def compile_row(row: dict, arch: str, dtype=torch.bfloat16) -> dict:
    g = torch.Generator().manual_seed(0)
    n, d, v = small_size(row["N"], 1024), small_size(row["D"], 512), small_size(row["V"], 2048)
    x, w = torch.randn(n, d, generator=g).to(dtype), torch.randn(v, d, generator=g).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::17] = -1
    with override_tiles("forward", **row["settings"]):
        launches = record_launches(lambda: triton_forward.forward_stats(x, w, None, labels, row["heads"], None, False))
    kernel, args, kwargs = next(launch for launch in launches if launch[0].__name__ == "_forward_kernel")
    facts = compile_launch(kernel, args, kwargs, arch)
    return {"stage": row["stage"], "settings": row["settings"], "device_ms": row.get("ms"),
            "device_regs": row["regs"], "device_spills": row["spills"],
            "registers": facts["registers"], "spill_bytes": facts["spill_bytes"],
            "registers_agree": facts["registers"] == row["regs"],
            "spills_agree": (facts["spill_bytes"] > 0) == (row["spills"] > 0)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweep", help="a tile_sweep.py JSON record")
    p.add_argument("--arch", default="sm_90a", choices=["sm_90a", "sm_80"], help="the sweep device's architecture")
    add_out_options(p)
    args = p.parse_args(argv)
    try:
        with open(args.sweep) as f:
            sweep = [r for r in json.load(f) if r.get("kernel") == "forward" and "regs" in r]
    except (OSError, ValueError) as err:
        p.error(f"cannot read the sweep record {args.sweep}: {err}")
    if not sweep:
        p.error(f"{args.sweep} has no forward rows with the device's registers (a tile_sweep.py record is expected)")
    stamp = datetime.date.today().isoformat()
    source = os.path.splitext(os.path.basename(args.sweep))[0]
    record = Record(p, args, f"compile-vs-device-{stamp}-triton_{triton.__version__}-{source}", named=("sweep",))
    rows = [compile_row(r, args.arch) for r in sweep]
    agree = sum(r["registers_agree"] for r in rows), sum(r["spills_agree"] for r in rows)
    lines = [f"# {args.sweep}'s forward rows compiled without a GPU ({stamp}, triton {triton.__version__}, {args.arch})",
             "", f"Registers agree in {agree[0]} of {len(rows)} rows; spills zero-or-not in {agree[1]} of {len(rows)} "
             "(the device's spill count is in another unit than ptxas's bytes).", "",
             "| stage | settings | device ms | device regs | device spills | regs here | spill bytes here |",
             "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['stage']} | `{r['settings']}` | {format(r['device_ms'], '.2f') if r['device_ms'] else '-'} | {r['device_regs']} | {r['device_spills']} | "
              f"{r['registers']} | {r['spill_bytes']} |" for r in rows]
    record.write(rows, "\n".join(lines))


if __name__ == "__main__":
    main()
