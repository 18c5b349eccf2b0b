"""How well compile_check.py predicts a GPU: each forward row of a device tile sweep, compiled here.

    python benchmarks/compile_vs_device.py benchmarks/results/tile_sweep-NVIDIA-H100-80GB-HBM3-2026-11-24-budget-s_240.json

For every forward row of the sweep record (tile_sweep.py's JSON: settings, and the registers and spills
the device's compiled kernel reported), the same launch -- the training forward of ``Problem.forward``,
or for the rows of the stage "forward tiles with ranks" the evaluation forward of ``Problem.forward_ranks``
(need_ranks: one head counts the ranks in the same kernel, NEED_RANKS): 16-bit inputs, no bias, no
soft-cap, no logit sum, the row's heads -- is compiled for the row's
architecture through compile_check's path, at small sizes that keep the sweep's N, D and V divisibility
by 16, and ptxas's registers and spill bytes are put beside the device's.  Registers should agree
exactly where the Triton version is the device's; the device reports spills in another unit, so they
are compared as zero or not.  The sweep's backward rows are left out: the kernel they timed (the atomic
backward) has since been replaced.  Beside the device's time each row gets the compiled kernel's static facts
(blocks resident per SM, SASS instructions in the K loop and once per tile: ``kernel_facts``), the issue slots
per tile and warp they add up to, and the operand bytes the row's tiles move into shared memory,
ceil(N / BLOCK_N) ceil(V / BLOCK_V) (BLOCK_N + BLOCK_V) D 2, with the rate the device time gives them.

The kernel compiled is that of the hf_mhce on ``sys.path``: to compile the one the device ran, run this
script with PYTHONPATH set to a checkout of the sweep's commit (``git worktree add DIR COMMIT``) and the
device's Triton; the record names the source.  Writes
<out>/compile-vs-device-<date>-triton_<version>-<sweep>.json/.md (``--source-tag`` adds to the name).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from compile_check import compile_launch, record_launches  # noqa: E402
from records import Record, add_out_options  # noqa: E402
from tile_sweep import RANKS_STAGE  # noqa: E402

import hf_mhce  # noqa: E402
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
    need_ranks = row["stage"] == RANKS_STAGE  # the sweep timed (and reported registers of) this launch
    with override_tiles("forward", **row["settings"]):
        launches = record_launches(lambda: triton_forward.forward_stats(x, w, None, labels, row["heads"], None, False,
                                                                        need_ranks=need_ranks))
    kernel, args, kwargs = next(launch for launch in launches if launch[0].__name__ == "_forward_kernel")
    # one head ranks in the forward kernel itself; several in a kernel of their own after it
    if kwargs["NEED_RANKS"] != (need_ranks and row["heads"] == 1):
        raise RuntimeError(f"{row['stage']!r} row (H = {row['heads']}) compiled with NEED_RANKS={kwargs['NEED_RANKS']}")
    facts = compile_launch(kernel, args, kwargs, arch)
    tile = row["settings"]
    operand_bytes = (-(-row["N"] // tile["BLOCK_N"]) * -(-row["V"] // tile["BLOCK_V"])
                     * (tile["BLOCK_N"] + tile["BLOCK_V"]) * row["D"] * 2)
    k_loop = facts.get("k_loop_instructions")
    return {"stage": row["stage"], "settings": tile, "need_ranks": kwargs["NEED_RANKS"], "device_ms": row.get("ms"),
            "device_regs": row["regs"], "device_spills": row["spills"],
            "registers": facts["registers"], "spill_bytes": facts["spill_bytes"],
            "registers_agree": facts["registers"] == row["regs"],
            "spills_agree": (facts["spill_bytes"] > 0) == (row["spills"] > 0),
            "blocks_per_sm": facts["blocks_per_sm"], "k_loop_instructions": k_loop,
            "per_tile_instructions": facts.get("per_tile_instructions"),
            "issue_per_tile": None if k_loop is None else
            k_loop * (row["D"] // row["heads"]) // tile["BLOCK_K"] + facts["per_tile_instructions"],
            "operand_gb": operand_bytes / 1e9,
            "operand_tb_s": operand_bytes / 1e9 / row["ms"] if row.get("ms") else None}


def source_of_kernels() -> str:
    """The hf_mhce whose kernels this run compiles: its folder and, in a git checkout, the commit."""
    folder = os.path.dirname(os.path.dirname(os.path.abspath(hf_mhce.__file__)))
    commit = subprocess.run(["git", "-C", folder, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return folder + (f" at {commit.stdout.strip()}" if commit.returncode == 0 else "")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweep", help="a tile_sweep.py JSON record")
    p.add_argument("--arch", default="sm_90a", choices=["sm_90a", "sm_80"], help="the sweep device's architecture")
    p.add_argument("--source-tag", default="", help="added to the record's name (e.g. the kernels' commit)")
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
    tag = f"-{args.source_tag}" if args.source_tag else ""
    record = Record(p, args, f"compile-vs-device-{stamp}-triton_{triton.__version__}-{source}{tag}",
                    named=("sweep", "source_tag"))
    rows = [compile_row(r, args.arch) for r in sweep]
    agree = sum(r["registers_agree"] for r in rows), sum(r["spills_agree"] for r in rows)
    lines = [f"# {args.sweep}'s forward rows compiled without a GPU ({stamp}, triton {triton.__version__}, {args.arch})",
             "", f"Kernels of {source_of_kernels()}.", "",
             f"Registers agree in {agree[0]} of {len(rows)} rows; spills zero-or-not in {agree[1]} of {len(rows)} "
             "(the device's spill count is in another unit than ptxas's bytes). Blocks: resident per SM; K loop and "
             "per tile: static SASS instructions; issue / tile: K loop x D / BLOCK_K + per tile, per warp; operand GB: "
             "what the tiles load into shared memory, and its rate at the device's time.", "",
             "| stage | settings | device ms | device regs | device spills | regs here | spill bytes here | blocks | "
             "K loop | per tile | issue / tile | operand GB | TB/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def number(value, spec):
        return "-" if value is None else format(value, spec)
    lines += [f"| {r['stage']} | `{r['settings']}` | {number(r['device_ms'], '.2f')} | {r['device_regs']} | "
              f"{r['device_spills']} | {r['registers']} | {r['spill_bytes']} | {r['blocks_per_sm']} | "
              f"{number(r['k_loop_instructions'], 'd')} | {number(r['per_tile_instructions'], 'd')} | "
              f"{number(r['issue_per_tile'], 'd')} | {r['operand_gb']:.0f} | {number(r['operand_tb_s'], '.2f')} |"
              for r in rows]
    record.write(rows, "\n".join(lines))


if __name__ == "__main__":
    main()
