"""What the peers rows time and record (benchmarks/timing.py, peers.py), on CPU with the CUDA-only parts
stubbed: each test pins a number the review of the first GPU run found wrong or missing."""

import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import peers  # noqa: E402
import timing  # noqa: E402

CPU = torch.device("cpu")


class _Sleepy(torch.autograd.Function):
    """A loss whose forward sleeps ``grad_s`` in grad mode (gradients computed in the forward, as Liger's
    and our 6NDV rows do), ``eval_s`` without, and whose backward sleeps ``bwd_s``."""

    @staticmethod
    def forward(ctx, x, w, seconds):
        time.sleep(seconds[1] if torch.is_grad_enabled() or x.requires_grad else seconds[0])
        ctx.bwd_s = seconds[2]
        return (x @ w.T).float().logsumexp(-1).mean()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.bwd_s)
        return None, None, None


def _sleepy(eval_s, grad_s, bwd_s):
    return lambda x, w, y: _Sleepy.apply(x, w, (eval_s, grad_s, bwd_s))


def test_backward_is_timed_alone():
    """bwd was fwd+bwd - fwd(no grad), clamped at 0: for a row that does its gradient work in a grad-mode
    forward that is mostly forward work (here 40 + 5 - 10 = 35 ms).  Now the backward alone is timed."""
    w, sets = peers.inputs(5, 4, 7, CPU, torch.float32, rotate=2)
    row = timing.measure(_sleepy(0.010, 0.040, 0.005), False, w, sets, timing.Timer(CPU, reps=3), CPU, {})
    assert 9 < row["fwd_ms"] < 25 and 44 < row["fwd_bwd_ms"] < 70, row
    assert 4 < row["bwd_ms"] < 20, row


def test_cuda_timer_times_only_the_body_after_prepare(monkeypatch):
    """The CUDA path: prepare() runs before the start event, the body between the events."""
    from host_clock import stub_cuda_timing

    stub_cuda_timing(monkeypatch)
    got = []
    timer = timing.Timer(torch.device("cuda"), reps=3)
    ms = timer(lambda prepared: (got.append(prepared), time.sleep(0.005)), prepare=lambda: time.sleep(0.03) or "graph")
    assert 4 < ms < 20 and set(got) == {"graph"} and len(timer.runs) >= 3, (ms, timer.runs)


def test_spread_of_each_timed_column_is_recorded():
    """A verdict on one median of ~5 runs needs the runs' spread beside it (targets.py reads it)."""
    timer = timing.Timer(CPU, reps=5)
    timer.runs = [10.0, 11.0, 12.0, 13.0, 20.0]
    assert timer.spread == pytest.approx((13 - 11) / 12)
    timer.runs = [10.0]
    assert timer.spread is None  # one run: unknown, not recorded
    w, sets = peers.inputs(5, 4, 7, CPU, torch.float32, rotate=2)
    row = timing.measure(_sleepy(0.001, 0.002, 0.001), False, w, sets, timing.Timer(CPU, reps=4), CPU)
    assert all(row[f"{k}_spread"] >= 0 for k in ("fwd", "fwd_bwd", "bwd")), row


def test_out_of_memory_in_fwd_bwd_keeps_the_forward(monkeypatch):
    """measure's numbers reached the row only when it returned, and the gradient check's fwd+bwd ran before it:
    an out-of-memory error in any fwd+bwd lost the forward time already measured, or never measured it."""
    def fn(x, w, y):
        if torch.is_grad_enabled():  # every fwd+bwd at this N runs out of memory, the gradient check's too
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stub)")
        return F.cross_entropy((x @ w.T).float(), y, ignore_index=-100)

    monkeypatch.setattr(peers, "make_variant", lambda name, device: (fn, False))
    (row,) = peers.run_shape("tiny", 8, 16, 9, ["hf_eager"], CPU, torch.float32, 2, 1)
    assert row["note"] == "out of memory" and row["fwd_ms"] > 0 and "fwd_bwd_ms" not in row, row


def test_grad_mode_loss_is_checked_too(monkeypatch):
    """Liger's and our 6NDV rows compute the grad-mode loss by other code than the evaluation forward:
    its error was discarded.  It is recorded, and the table's loss err shows the larger."""
    def fn(x, w, y):
        loss = F.cross_entropy((x @ w.T).float(), y, ignore_index=-100)
        return loss * 1.01 if torch.is_grad_enabled() else loss

    monkeypatch.setattr(peers, "make_variant", lambda name, device: (fn, False))
    (row,) = peers.run_shape("tiny", 8, 16, 9, ["hf_eager"], CPU, torch.float32, 1, 1)
    assert row["loss_rel_err"] < 1e-5 and row["loss_grad_rel_err"] == pytest.approx(0.01, rel=1e-3), row
    table = peers.markdown([row], "CPU", "2026-01-01")
    assert f"| {row['loss_grad_rel_err']:.1e} |" in table, table


def test_matmul_rate_is_timed_at_an_aligned_vocabulary():
    """cuBLAS is slow at GPT-2's unaligned V = 50257, which made the floor flattering: the rate is timed
    at V rounded up to a multiple of 128, and its FLOPs counted with that V."""
    shapes = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("matmul", "__matmul__", "mm"):
                shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
            return func(*args, **(kwargs or {}))

    def timer(fn):
        with Spy():
            fn()
        return 1.0  # ms

    rate = timing.matmul_rate(4, 8, 263, CPU, torch.float32, timer)
    assert shapes == [((4, 8), (8, 384)), ((4, 4096), (4096, 384))], shapes
    assert rate == pytest.approx(2 * 4 * 4096 * 384 * 1000)


def test_compile_chunked_compiles_one_chunk_and_matches_cross_entropy(monkeypatch):
    """Compiled with its loop as one graph, the compiled backward kept every chunk's float32 logits
    (memory grew with the chunks on the H100).  Only the chunk loss is compiled now, once per chunk
    forward and once per chunk's recompute (checkpointed), and nothing of a chunk's logits is saved."""
    compile_ = torch.compile
    calls = []

    def counting_compile(f, **kw):
        compiled = compile_(f, backend="aot_eager", **kw)
        return lambda *a: calls.append(a[0].shape[0]) or compiled(*a)

    monkeypatch.setattr(torch, "compile", counting_compile)
    monkeypatch.setattr(peers, "CHUNK", 7)
    try:
        fn, _ = peers.make_variant("compile_chunked", torch.device("cuda"))  # built without a GPU
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(37, 5, generator=g, dtype=torch.float64), torch.randn(11, 5, generator=g, dtype=torch.float64)
        y = torch.randint(0, 11, (37,), generator=g)
        y[[3, 36]] = -100
        xv, wv = x.clone().requires_grad_(), w.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            loss = fn(xv, wv, y)
        assert calls == [7, 7, 7, 7, 7, 2] and not [s for s in saved if s[-1:] == (11,)], (calls, saved)
        loss.backward()
        assert calls[6:] == [2, 7, 7, 7, 7, 7]  # each chunk recomputed in the backward
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        ref = F.cross_entropy((xr @ wr.T).float(), y, ignore_index=-100)  # the same float32 logits, unchunked
        ref.backward()
        assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
        for got, want in ((xv.grad, xr.grad), (wv.grad, wr.grad)):
            assert float((got - want).norm() / want.norm()) < 1e-6
    finally:
        torch._dynamo.reset()


def test_logit_scale_sets_the_logits_spread_and_is_stated(tmp_path, monkeypatch):
    """N(0, 1) logits let CCE's default filter skip many backward blocks; trained heads are peakier.
    --logit-scale sets the logits' standard deviation; the default keeps the record's name, and the
    table says what the inputs were."""
    for scale in (1.0, 4.0):
        w, sets = peers.inputs(256, 64, 512, CPU, torch.float32, rotate=1, logit_scale=scale)
        assert float((sets[0][0] @ w.T).std()) == pytest.approx(scale, rel=0.05)
    monkeypatch.setattr(peers, "run_shape", lambda *a: [])
    monkeypatch.setattr(peers, "check_device", lambda p, args, triton: CPU)
    base = ["--small", "--tokens", "9", "--variants", "hf_eager", "--out", str(tmp_path)]
    peers.main(base)
    peers.main([*base, "--logit-scale", "4"])
    stem = "cpu-" + time.strftime("%Y-%m-%d") + "-peers-gpt2-small-tokens_9-variants_hf_eager"
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [f"{stem}-logit-scale_4.json", f"{stem}.json"]
    row = {"shape": "gpt2", "D": 8, "V": 37, "N": 9, "floor_fwd_ms": 1.0, "floor_fwd_bwd_ms": 3.0, "variant": "cce"}
    text = peers.markdown([row], "GPU", "2026-01-01", logit_scale=4.0)
    assert "logits x . w with standard deviation 4 (--logit-scale)" in text and "gradient filter" in text


def test_memory_is_recorded_against_both_bounds(monkeypatch):
    """The verdict reads peak extra / (dX + dW); the issue's bound is X + W + dX + dW: both ratios in the row."""
    def fake_measure(fn, forward_only, w, sets, timer, device, row):
        row.update(fwd_ms=1.0, fwd_bwd_ms=3.0, bwd_ms=2.0, peak_extra_mb=3.0)

    monkeypatch.setattr(peers, "measure", fake_measure)
    (row,) = peers.run_shape("tiny", 64, 512, 256, ["hf_eager"], CPU, torch.float32, 1, 1)
    full = 2 * (256 * 64 + 512 * 64) * 4 / 2**20  # X, W, dX, dW in float32
    assert row["mem_vs_full_bound"] == pytest.approx(3.0 / full) and row["mem_vs_bound"] == pytest.approx(6.0 / full)
    assert f"| {row['mem_vs_bound']:.2f} ({row['mem_vs_full_bound']:.2f}) |" in peers.markdown([row], "CPU", "2026-01-01")
