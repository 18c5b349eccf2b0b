"""What the GPU benchmarks measure, checked on CPU with the CUDA-only parts stubbed.

A number that is wrong on the device shows no error there: the one GPU run a session may get
would report it.  Each test here pins one way a row could time or count the wrong thing.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # the scripts import records (and peers) as top-level modules


def test_forward_timing_asks_for_no_gradients_whatever_ran_before():
    """Liger computes dX and dW in its forward whenever its inputs want gradients, no_grad or not:
    a forward timed on leaves that an earlier row's fwd+bwd turned into ones wanting gradients
    times the whole step (and the backward comes out near 0)."""
    import peers

    seen = []

    def fn(x, w, y):
        seen.append((torch.is_grad_enabled(), x.requires_grad, w.requires_grad))
        return (x @ w.T).float().logsumexp(-1).mean()

    w, sets = peers.inputs(5, 4, 7, torch.device("cpu"), torch.float32, rotate=2)
    timer = peers.Timer(torch.device("cpu"), reps=2)
    for _ in range(2):  # two rows, one after the other, as run_shape times them
        peers.measure(fn, False, w, sets, timer, torch.device("cpu"))
    assert {s for s in seen if not s[0]} == {(False, False, False)}, seen  # forwards: no leaf wants a gradient
    assert {s for s in seen if s[0]} == {(True, True, True)}, seen  # fwd+bwd: both leaves do
    assert not w.requires_grad and not any(x.requires_grad for x, _ in sets)  # the shared inputs stay as made


def test_ranks_row_is_compared_with_our_forward():
    """The P6 target for ranks in evaluation is <= 1.05x our CE: the forward-only row needs its ratio."""
    import peers

    base = {"shape": "llama3", "D": 4096, "V": 128256, "N": 4096, "floor_fwd_ms": 1.0, "floor_fwd_bwd_ms": 3.0}
    rows = [{**base, "variant": "hf_mhce_ce", "fwd_ms": 10.0, "fwd_bwd_ms": 30.0},
            {**base, "variant": "liger", "fwd_ms": 12.0, "fwd_bwd_ms": 45.0},
            {**base, "variant": "hf_mhce_ranks", "fwd_ms": 10.4}]
    text = peers.markdown(rows, "GPU", "2026-01-01")
    table, verdicts = text.split("## P6 targets")
    ratio = {line.split("|")[1].strip(): line.split("|")[8].strip() for line in table.splitlines() if line.startswith("| ")}
    assert ratio["liger"] == "1.50" and ratio["hf_mhce_ranks"] == "1.04", ratio
    assert "| ranks | hf_mhce_ranks vs hf_mhce_ce | 1.04x hf_mhce_ce | <= 1.05 | yes |" in verdicts


def test_ranks_row_that_ranks_nothing_is_no_result(monkeypatch):
    """A ranks row whose sink never fills times a plain CE forward and meets its target for nothing."""
    import contextlib

    import peers

    import hf_mhce.losses

    monkeypatch.setattr(hf_mhce.losses, "collect_ranks", lambda sink: contextlib.nullcontext())
    rows = peers.run_shape("gpt2", 8, 37, 9, ["hf_mhce_ranks"], torch.device("cpu"), torch.bfloat16, 1, 1)
    assert "tokens ranked of" in rows[0].get("note", ""), rows


def test_compiled_peer_stays_compiled_across_shapes(monkeypatch):
    """Dynamo's cache is per code object: every shape of a run added two entries to one cache, and past
    recompile_limit the function runs eager, still reported as compile_chunked."""
    import peers

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda f, **kw: compile_(f, backend="eager", **kw))
    # 8 on the device: 4 shapes there.  config.patch, not monkeypatch: undoing a setattr on dynamo's config
    # module deletes the key, and later compiles in the session fail on it
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        try:
            for n, d, v in [(8, 4, 11), (16, 6, 13)]:
                fn, _ = peers.make_variant("compile_chunked", torch.device("cuda"))  # built without a GPU
                x, w, y = torch.randn(n, d), torch.randn(v, d), torch.randint(0, v, (n,))
                with torch.no_grad():
                    fn(x, w, y)
                fn(x.requires_grad_(), w.requires_grad_(), y).backward()
        finally:
            torch._dynamo.reset()


def test_cuda_timer_times_at_least_reps_runs(monkeypatch):
    """do_bench times rep / estimate runs: a single one at the P6 shapes, where a fwd+bwd takes
    100-400 ms, and its median is then one sample.  Stubs: CUDA events on the host clock; the old
    do_bench path is triton's loop (testing.py) on those events."""
    import peers
    import triton.testing

    from host_clock import stub_cuda_timing

    samples = []
    Event = stub_cuda_timing(monkeypatch, samples)

    def do_bench(fn, warmup=25, rep=100, return_mode="mean", **kwargs):
        fn()
        start, end = Event(), Event()
        start.record()
        for _ in range(5):
            fn()
        end.record()
        estimate = start.elapsed_time(end) / 5
        samples.pop()  # the estimate is no timed run
        for _ in range(max(1, int(warmup / estimate))):
            fn()
        runs = [(Event(), Event()) for _ in range(max(1, int(rep / estimate)))]
        for s, e in runs:
            s.record()
            fn()
            e.record()
        return statistics.median(s.elapsed_time(e) for s, e in runs)

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    ms = peers.Timer(torch.device("cuda"), reps=5)(lambda: time.sleep(0.04))
    assert len(samples) >= 5, samples
    assert 35 < ms < 80, ms


def test_gpu_suite_keeps_its_rows_when_eager_runs_out_of_memory(monkeypatch, tmp_path):
    """The eager baseline holds H float32 [N, V] log-softmaxes: over 80 GB at H = 8 and the default
    shape.  Its out-of-memory error ended the suite before it wrote anything, our kernels' checks too."""
    import gpu_suite

    def eager_oom(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (stub)")

    monkeypatch.setattr(gpu_suite, "eager_mhce", eager_oom)
    monkeypatch.setattr(gpu_suite, "check_device", lambda p, args: torch.device("cpu"))
    monkeypatch.setattr(gpu_suite, "device_label", lambda device: "GPU")
    gpu_suite.main(["--small", "--tokens", "9", "--vocab", "67", "--hidden", "8", "--heads", "2", "--dtypes",
                    "bfloat16", "--reps", "1", "--out", str(tmp_path)])
    (record,) = tmp_path.glob("*.json")
    (row,) = json.loads(record.read_text())
    assert row["eager_note"] == "out of memory" and row["err_loss"] < 1e-2 and "ours_ms" in row, row



def test_gpu_suite_softcap_row(tmp_path):
    """--softcap reaches both the fused loss and the eager baseline: the errors against the float64
    reference stay at float32's level (a softcap missing on either side would be O(1) off), and the
    record's name says it."""
    pytest.importorskip("triton")
    import gpu_suite

    gpu_suite.main(["--device", "cpu", "--small", "--tokens", "9", "--vocab", "67", "--hidden", "8", "--heads", "2",
                    "--dtypes", "bfloat16", "--softcap", "2.5", "--reps", "1", "--out", str(tmp_path)])
    (record,) = tmp_path.glob("*-softcap2.5-*.json")
    (row,) = json.loads(record.read_text())
    # bf16 at this size: ~2e-5 (loss) and ~5e-3 (gradients) on both sides; without the softcap on the
    # eager side 7e-3 and 0.14
    for side in ("err", "eager_err"):
        assert row[f"{side}_loss"] < 1e-3, row
        assert all(row[f"{side}_{g}"] < 2e-2 for g in ("dx", "dw", "db")), row


def test_peers_table_names_the_versions():
    """Liger and CCE change their defaults and speed between releases (CCE's impl names too): a table
    without the versions it ran cannot be compared with the next one."""
    import peers

    row = {"shape": "gpt2", "D": 8, "V": 37, "N": 9, "floor_fwd_ms": 1.0, "floor_fwd_bwd_ms": 3.0, "variant": "hf_eager"}
    table = peers.markdown([row], "GPU", "2026-01-01")
    assert f"torch {torch.__version__}" in table and "liger-kernel " in table and "cut-cross-entropy " in table, table


def test_cce_exact_is_a_call_the_installed_cce_accepts(monkeypatch):
    """CCE 25.1.1 (PyPI's newest) knows impl "cce" and "torch_compile" only: impl="cce_exact" raised
    NotImplementedError there, which left the row empty on the device.  Its exact form is the cce impl
    without the gradient filter; later releases name it impl="cce_exact".  The table says which ran."""
    import enum
    import types

    import peers

    for members, exact in ((("CCE", "TORCH_COMPILE"), {"impl": "cce", "filter_eps": None}),
                           (("CCE", "CCE_EXACT", "CCE_KAHAN_FULL_C", "TORCH_COMPILE"), {"impl": "cce_exact"})):
        fake = types.ModuleType("cut_cross_entropy")
        fake.LinearCrossEntropyImpl = enum.IntEnum("LinearCrossEntropyImpl", members)
        monkeypatch.setitem(sys.modules, "cut_cross_entropy", fake)
        assert peers.cce_options("cce_exact") == exact
        assert peers.cce_options("cce") == {"impl": "cce"}  # the default filter
        row = {"shape": "gpt2", "D": 8, "V": 37, "N": 9, "floor_fwd_ms": 1.0, "floor_fwd_bwd_ms": 3.0, "variant": "cce"}
        call = ", ".join(f"{k}={v!r}" for k, v in exact.items())
        assert f"cce_exact called linear_cross_entropy(x, w, labels, {call})." in peers.markdown([row], "GPU", "2026-01-01")
