"""The timing machinery of peers.py and tile_sweep.py: a median timer, the matmul rate of the floor, and
one row's forward, backward and forward+backward times (with their spreads) and peak memory."""

from __future__ import annotations

import itertools
import statistics
import time

import torch


def _flush_buffer(device) -> torch.Tensor:
    """Zeroed before each timed run on CUDA: evicts L2 (50-60 MB on Hopper), as do_bench's buffer does."""
    return torch.empty(256 * 2**20, dtype=torch.int8, device=device)


class Timer:
    """Median milliseconds of fn(): CUDA events around each run (L2 flushed before it), perf_counter elsewhere.

    With ``prepare``, fn(prepare()) is run and only fn is timed (the backward alone: prepare is its
    forward).  ``runs`` keeps the last call's samples and ``spread`` their interquartile range over the
    median, so that a verdict can tell a margin from noise."""

    def __init__(self, device, reps):
        self.device, self.reps = device, reps
        self.runs: list[float] = []

    def __call__(self, fn, prepare=None) -> float:
        body = fn if prepare is not None else (lambda _: fn())
        prepare = prepare or (lambda: None)
        if self.device.type == "cuda":
            self.runs = self._cuda(body, prepare)
        else:
            body(prepare())
            self.runs = []
            for _ in range(self.reps):
                arg = prepare()
                t0 = time.perf_counter()
                body(arg)
                self.runs.append(1000 * (time.perf_counter() - t0))
                del arg  # a prepared graph is freed before the next is built
        return statistics.median(self.runs)

    @property
    def spread(self) -> float | None:
        """(Q3 - Q1) / median of the last call's runs; None with fewer than two runs."""
        if len(self.runs) < 2:
            return None
        q1, _, q3 = statistics.quantiles(self.runs, n=4, method="inclusive")
        return (q3 - q1) / statistics.median(self.runs)

    def _cuda(self, body, prepare) -> list[float]:
        """do_bench's method (warm-up, L2 flushed, events; 100 ms of runs) with at least ``reps`` runs:
        do_bench times rep / estimate runs, one alone where a run takes over 100 ms (the P6 shapes),
        after five runs for its estimate; one run gives the estimate here (prepare included: it bounds
        the call's time)."""
        body(prepare())  # compilation and autotuning
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        body(prepare())
        torch.cuda.synchronize()
        estimate = max(1000 * (time.perf_counter() - t0), 1e-3)
        flush = _flush_buffer(self.device)
        for _ in range(max(1, int(25 / estimate))):
            body(prepare())
        runs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(max(self.reps, min(int(max(100, 20 * self.reps) / estimate), 10_000)))]
        for start, end in runs:
            arg = prepare()  # enqueued before the start event: untimed
            flush.zero_()
            start.record()
            body(arg)
            end.record()
            del arg
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in runs]


COMPUTE_BOUND_K = 4096
ALIGN_V = 128  # cuBLAS's fast kernels want aligned leading dimensions; GPT-2's V = 50257 is not


def matmul_rate(n, d, v, device, dtype, timer) -> float:
    """FLOP/s of [N, K] x [K, V'] products, the unit of the floor: the faster of K = D and K = 4096.

    At a narrow D (GPT-2's 768) the plain product is bound by writing its [N, V] output, which the
    fused losses never write: its rate put the GPT-2 floor below what torch.compile attained (0.33x
    "floor" on the H100, 2026-11-24).  At K = 4096 the same output costs a sixth as much per FLOP.
    V' is V rounded up to a multiple of 128 (FLOPs counted with V'): at an unaligned V cuBLAS runs
    slow kernels, and a slow rate makes a flattering floor; the floor then takes the true V at this rate."""
    v_aligned = -(-v // ALIGN_V) * ALIGN_V
    rates = []
    for k in dict.fromkeys((d, max(d, COMPUTE_BOUND_K))):
        a = torch.randn(n, k, device=device, dtype=dtype)
        b = torch.randn(v_aligned, k, device=device, dtype=dtype)
        ms = timer(lambda: a @ b.T)
        rates.append(2 * n * k * v_aligned / (ms / 1000))
    return max(rates)


def _timed(row, key, timer, fn, prepare=None) -> None:
    """row[key_ms] and, where known, row[key_spread]: written at once, so a later failure keeps them."""
    row[f"{key}_ms"] = timer(fn, prepare)
    if timer.spread is not None:
        row[f"{key}_spread"] = timer.spread


def measure(fn, forward_only, w, sets, timer, device, row=None) -> dict:
    """Fill ``row`` step by step: fwd_ms (evaluation forward), then fwd_bwd_ms, bwd_ms (the backward
    alone, after an untimed forward in grad mode) and peak_extra_mb; an out-of-memory error in a later
    step keeps the numbers already measured."""
    row = {} if row is None else row
    it = itertools.count()

    def pick():
        return sets[next(it) % len(sets)]

    def fwd():  # evaluation: no leaf wants a gradient (Liger computes them in its forward when one does)
        x, y = pick()
        with torch.no_grad():
            fn(x.detach(), w.detach(), y)

    def grad_forward():  # fresh leaves: the shared inputs never turn into ones that want gradients
        x, y = pick()
        return fn(x.detach().requires_grad_(), w.detach().requires_grad_(), y)

    _timed(row, "fwd", timer, fwd)
    if forward_only:
        return row
    _timed(row, "fwd_bwd", timer, lambda: grad_forward().backward())
    # not fwd_bwd - fwd: a row that computes its gradients in the forward (Liger, ours at 8192 MB) does
    # that work only in grad mode, which the evaluation forward leaves out
    _timed(row, "bwd", timer, lambda loss: loss.backward(), prepare=grad_forward)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grad_forward().backward()
        torch.cuda.synchronize()
        row["peak_extra_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return row
