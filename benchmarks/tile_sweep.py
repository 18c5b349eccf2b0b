"""Tile sweep of the Triton kernels (issue P6): which launch settings are fastest on this GPU.

    python benchmarks/tile_sweep.py                      # Llama-3-8B head (D=4096, V=128256), bf16, H=1
    python benchmarks/tile_sweep.py --heads 1 4 --budget-s 420
    TRITON_INTERPRET=1 python benchmarks/tile_sweep.py --device cpu --small    # checks the script itself

Stages, each timed with the harness of peers.py (median of CUDA events, L2 flushed, inputs rotated):
  1. backward (dY slab kernel) tiles at N=16384 (fused dX + dW pass of 16-bit inputs);
  2. backward group width (GROUP_N) for the best backward tiles;
  3. forward tiles with ranks (evaluation) at N=16384, a few candidates;
  4. forward tiles at N=16384 (BLOCK_N x BLOCK_V x BLOCK_K x warps x stages);
  5. forward vocabulary splits at N=4096 (64 token blocks: half an H100 without splits);
then the three fastest settings of each stage are timed again (a difference under the spread of
two timings is noise).  Every setting's output is compared with the default setting's (relative L2
error; a setting that changes the result is reported, never picked).  Per compiled kernel: registers,
spills and whether the SASS uses Hopper's warpgroup MMA (HGMMA).  The run stops starting new
settings after --budget-s seconds (the device tool allows 10 minutes a call) and says which it
skipped.  Writes <out>/tile_sweep-<device>-<date>.md and .json (records.py's naming rule; off CUDA
only with --small and TRITON_INTERPRET=1) after every stage, and on SIGTERM (device_run.sh stops a
step at the call's budget) with the rows finished so far before it exits; the winners go into
``hf_mhce/ops/triton_tile.py``'s _GPU_DEFAULTS by hand, with the record cited.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import signal
import sys
import time

import torch
from timing import Timer
from records import Record, add_device_options, check_device, device_label, positive_float, positive_int

TILES = [(64, 128), (128, 128), (64, 256), (128, 256)]  # (BLOCK_N, BLOCK_V)
FORWARD = [dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, num_warps=nw, num_stages=ns)
           for (bn, bv), bk, nw, ns in itertools.product(TILES, (64, 128), (4, 8), (3, 4))]
BACKWARD = [dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, num_warps=nw, num_stages=ns)
            for (bn, bv), bk, nw, ns in itertools.product(TILES, (32, 64), (4, 8), (2, 3))]
# evaluation (ranks in the forward sweep): the training forward's best and the former default
RANKS_TILES = [dict(BLOCK_N=128, BLOCK_V=256, BLOCK_K=64, num_warps=8, num_stages=4),
               dict(BLOCK_N=64, BLOCK_V=256, BLOCK_K=64, num_warps=8, num_stages=4),
               dict(BLOCK_N=128, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=4),
               dict(BLOCK_N=64, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=3)]
SPLITS = [1, 2, 3, 4, 8, None]
GROUPS = [1, 4, 8, 16, 32, 1 << 20]  # 1 << 20: every token block in one group (the old order)
SMALL_TILES = [dict(BLOCK_N=16, BLOCK_V=32, BLOCK_K=16), dict(BLOCK_N=32, BLOCK_V=16, BLOCK_K=32)]
RANKS_STAGE = "forward tiles with ranks"  # kernel "forward" with need_ranks (compile_vs_device.py reads it)


class Problem:
    """Rotated inputs of one shape, the statistics the backward needs, and the two kernels."""

    def __init__(self, n, d, v, heads, device, dtype, rotate=3, seed=0):
        from hf_mhce.ops import mixture, triton_backward, triton_forward

        self.fwd_mod, self.bwd_mod = triton_forward, triton_backward
        self.n, self.d, self.v, self.heads = n, d, v, heads
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.w = (torch.randn(v, d, generator=g) * (2.0 / math.sqrt(d // heads))).to(device, dtype)
        self.sets = []
        for _ in range(rotate):
            x = torch.randn(n, d, generator=g).to(device, dtype)
            labels = torch.randint(0, v, (n,), generator=g)
            labels[torch.rand(n, generator=g) < 0.05] = -1
            labels = labels.to(device)
            stats = triton_forward.forward_stats(x, self.w, None, labels, heads, None, False)
            valid = labels >= 0
            coef = mixture.grad_coefficients(stats.lse, stats.log_p_target, valid, valid.float() / valid.sum(), v, 0.0, 0.0)
            self.sets.append((x, labels, (stats.top, stats.log_sum), coef))
        self._turn = 0

    def _next(self):
        self._turn += 1
        return self.sets[self._turn % len(self.sets)]

    def forward(self, first=False):
        x, labels, _, _ = self.sets[0] if first else self._next()
        return self.fwd_mod.forward_stats(x, self.w, None, labels, self.heads, None, False).log_p_target

    def forward_ranks(self, first=False):
        """The evaluation forward: target ranks counted in the same sweep (H = 1) or a second one."""
        x, labels, _, _ = self.sets[0] if first else self._next()
        stats = self.fwd_mod.forward_stats(x, self.w, None, labels, self.heads, None, False, need_ranks=True)
        return torch.cat([stats.log_p_target.flatten(), stats.ranks.double()])

    def backward(self, first=False):
        x, labels, (top, log_sum), (alpha, target_grad, gamma) = self.sets[0] if first else self._next()
        dx, dw, _ = self.bwd_mod.backward(x, self.w, None, labels, top, log_sum, alpha, target_grad, gamma, self.heads,
                                          None, (True, True, False))
        return torch.cat([dx.flatten(), dw.flatten()])


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def compiled_facts(jit_fn) -> dict:
    """Registers, spills and HGMMA use of the most recently compiled variant of ``jit_fn``."""
    try:
        kernels = [k for cache in jit_fn.device_caches.values() for k in cache[0].values()]
        k = kernels[-1]
        facts = {"regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None)}
        try:
            facts["hgmma"] = "HGMMA" in k.asm["sass"]
        except Exception:  # no disassembler in this image: leave it unknown
            pass
        return facts
    except Exception:
        return {}


def sweep(stage, kernel, settings, fn, jit_fn, reference, timer, deadline, done, tags, fixed=None) -> list[dict]:
    """This stage's rows, each also appended to ``done`` (with ``tags``) as soon as it is finished: a run
    stopped in the middle of a stage keeps the settings it timed."""
    from hf_mhce.ops.triton_tile import override_tiles

    rows = []
    for s in settings:
        full = {**(fixed or {}), **s}
        row = {"stage": stage, "kernel": kernel, "settings": full, **tags}
        if time.monotonic() > deadline:
            row["note"] = "skipped: time budget spent"
        else:
            try:
                with override_tiles(kernel, **full):
                    row["rel_err_vs_default"] = rel_err(fn(first=True), reference)
                    row.update(compiled_facts(jit_fn))
                    row["ms"] = timer(fn)
            except Exception as err:  # out of resources (shared memory) is a result, not a crash
                row["note"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
        rows.append(row)
        done.append(row)
        print(json.dumps(row), flush=True)
    return rows


def best(rows, tol) -> list[dict]:
    ok = [r for r in rows if "ms" in r and r["rel_err_vs_default"] <= tol]
    return sorted(ok, key=lambda r: r["ms"])


def retime(rows, fn, kernel, timer, deadline, tol, k=3) -> list[dict]:
    """Time the k fastest again: the second number shows the spread."""
    from hf_mhce.ops.triton_tile import override_tiles

    for r in best(rows, tol)[:k]:
        if time.monotonic() > deadline:
            break
        with override_tiles(kernel, **r["settings"]):
            r["ms_again"] = timer(fn)
    return rows


def tolerance(dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-3  # 16-bit dX/dW: one rounding of each element


def run(args, device, dtype, rows=None, save=lambda: None) -> list[dict]:
    """The stages, their rows appended to ``rows`` as they finish; ``save()`` after every stage."""
    from hf_mhce.ops import triton_backward, triton_forward

    start = time.monotonic()
    deadline = start + args.budget_s
    timer = Timer(device, args.reps)
    d, v = (48, 263) if args.small else (4096, 128256)
    n_big, n_small = (45, 20) if args.small else (16384, 4096)
    fwd_tiles, bwd_tiles = (SMALL_TILES, SMALL_TILES) if args.small else (FORWARD, BACKWARD)
    tol = tolerance(dtype)
    kernels = {"forward": triton_forward._forward_kernel, "backward": triton_backward._dlogits_kernel}
    rows = [] if rows is None else rows

    def stage(name, kernel, settings, problem, ref, fixed=None, fn=None) -> dict:
        """Sweep, tag, time the fastest again, save; returns the winning settings ({} if none held)."""
        fn = fn or getattr(problem, kernel)
        tags = {"heads": problem.heads, "D": d, "V": v, "N": problem.n}
        got = sweep(name, kernel, settings, fn, kernels[kernel], ref, timer, deadline, rows, tags, fixed)
        retime(got, fn, kernel, timer, deadline, tol)
        save()
        ranked = best(got, tol)
        return ranked[0]["settings"] if ranked else {}

    for heads in args.heads:  # the backward first: the forward's tiles were swept on the H100 already
        big = Problem(n_big, d, v, heads, device, dtype)
        ref = big.backward(first=True)
        win = stage("backward tiles", "backward", bwd_tiles, big, ref)
        stage("backward groups", "backward", [{"GROUP_N": g} for g in GROUPS], big, ref, win)
        del ref
        stage(RANKS_STAGE, "forward", fwd_tiles[:len(RANKS_TILES)] if args.small else RANKS_TILES, big,
              big.forward_ranks(first=True), fn=big.forward_ranks)
        win = stage("forward tiles", "forward", fwd_tiles, big, big.forward(first=True))
        small = Problem(n_small, d, v, heads, device, dtype)
        stage("forward splits", "forward", [{"SPLITS": s} for s in SPLITS], small, small.forward(first=True), win)
        del small, big
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"sweep took {time.monotonic() - start:.0f} s", flush=True)
    return rows


def markdown(rows, device_name, today, tol, stopped="") -> str:
    from hf_mhce.ops.triton_tile import _GPU_DEFAULTS

    lines = [f"# Tile sweep on {device_name} ({today})", "",
             f"Median ms (CUDA events, timing.Timer), `again` = a second timing of the fastest three; err = relative L2 difference from "
             f"the default setting's output (picked only if <= {tol:g}). Defaults at the time: `{_GPU_DEFAULTS}`.", "",
             *([f"**{stopped}**", ""] if stopped else [])]
    for key in dict.fromkeys((r["heads"], r["stage"], r["N"]) for r in rows):
        group = [r for r in rows if (r["heads"], r["stage"], r["N"]) == key]
        lines += [f"## H={key[0]}, {key[1]}, N={key[2]} (D={group[0]['D']}, V={group[0]['V']})", "",
                  "| settings | ms | again | err | regs | spills | HGMMA | note |", "|---|---:|---:|---:|---:|---:|---|---|"]
        for r in sorted(group, key=lambda r: r.get("ms", math.inf)):
            def f(k, fmt=".2f"):
                return format(r[k], fmt) if r.get(k) is not None else "-"
            lines.append(f"| `{r['settings']}` | {f('ms')} | {f('ms_again')} | {f('rel_err_vs_default', '.1e')} | "
                         f"{r.get('regs', '-')} | {r.get('spills', '-')} | {r.get('hgmma', '-')} | {r.get('note', '')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=positive_int, nargs="+", default=[1])
    add_device_options(p, reps=3)
    p.add_argument("--budget-s", type=positive_float, default=420.0, help="no new setting is started after this")
    args = p.parse_args(argv)
    device = check_device(p, args)
    d = 48 if args.small else 4096  # as run() takes it
    if any(d % h for h in args.heads):
        p.error(f"every --heads must divide the hidden size {d}: got {args.heads}")
    dtype = getattr(torch, args.dtype)
    name = device_label(device)
    today = datetime.date.today().isoformat()
    record = Record(p, args, f"tile_sweep-{name}-{today}" + ("-small" if args.small else ""), named={"small"})
    rows, started = [], time.monotonic()

    def save(stopped="", echo=False):
        record.write(rows, markdown(rows, name, today, tolerance(dtype), stopped), echo=echo)

    def on_sigterm(signum, frame):  # device_run.sh stops a step at the call's budget: keep the rows finished
        save(f"Stopped by signal {signum} after {time.monotonic() - started:.0f} s: the settings after the last "
             "row were not run, and the re-timing of the stage in progress is missing.")
        try:
            sys.stdout.flush()
        except Exception:  # interrupted inside a print: the record is written, the log line lost
            pass
        os._exit(128 + signum)  # at once: unwinding would resume a write the handler has just replaced

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        run(args, device, dtype, rows, save)
    finally:  # an error (out of memory building a problem) still leaves the stages before it
        signal.signal(signal.SIGTERM, previous)
        save(echo=True)
    return rows


if __name__ == "__main__":
    main()
