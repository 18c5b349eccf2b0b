"""The benchmark scripts' option checks and record naming, without running a benchmark.

A wrong option must stop a script at once with a message that says what to do, not minutes later
inside torch or Triton (or on the device, where time is scarce), and no run may silently replace a
committed record.  Every check here happens before any work: where a script would start work, the
work is stubbed out, and each test writes only under tmp_path.
"""

import datetime
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from script_runs import output, run_scripts

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # the scripts import records (and peers) as top-level modules
GPU_SCRIPTS = ["peers", "gpu_suite", "gpu_ties", "tile_sweep"]


def today() -> str:
    return datetime.date.today().isoformat()


def refused(capsys, script: str, *argv: str) -> str:
    """Run ``script.main(argv)``, which must exit with an argparse error (2); return its stderr."""
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(script).main(list(argv))
    assert exc.value.code == 2, exc.value.code
    return capsys.readouterr().err


def results_listing():
    return sorted((p.name, p.stat().st_mtime_ns) for p in (BENCH / "results").iterdir())


@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_cuda_without_gpu_says_what_to_do(capsys, monkeypatch, tmp_path, script):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = refused(capsys, script, "--out", str(tmp_path))
    assert "no CUDA GPU" in err and "--device cpu --small" in err and "TRITON_INTERPRET=1" in err, err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_cpu_without_interpreter_is_refused(capsys, monkeypatch, tmp_path, script):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    err = refused(capsys, script, "--device", "cpu", "--small", "--out", str(tmp_path))
    assert "set TRITON_INTERPRET=1" in err, err


@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_cpu_needs_small(capsys, monkeypatch, tmp_path, script):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    err = refused(capsys, script, "--device", "cpu", "--out", str(tmp_path))
    assert "add --small" in err, err


def test_peers_without_triton_rows_needs_no_interpreter(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    err = refused(capsys, "peers", "--device", "cpu", "--variants", "hf_eager", "--out", str(tmp_path))
    assert "TRITON_INTERPRET" not in err and "add --small" in err, err


@pytest.mark.parametrize("script, argv, message", [
    ("gpu_suite", ["--dtypes", "float23"], "invalid choice: 'float23'"),
    ("peers", ["--dtype", "float23"], "invalid choice: 'float23'"),
    ("gpu_suite", ["--reps", "0"], "must be a positive whole number"),
    ("gpu_suite", ["--device", "cpu", "--small", "--heads", "5"], "must divide the hidden size 48"),
    ("gpu_suite", ["--device", "cpu", "--small", "--lora-rank", "-1"], "--lora-rank must be 0"),
    ("gpu_ties", ["--heads", "0"], "must be a positive whole number"),
    ("gpu_ties", ["--reps", "3"], "unrecognized arguments: --reps"),  # it times nothing
    ("peers", ["--device", "cpu", "--small", "--shapes", "llama3"], "--small runs its own tiny shape"),
    ("peers", ["--tokens", "0"], "must be a positive whole number"),
    ("peers", ["--rotate", "0"], "must be a positive whole number"),
    ("tile_sweep", ["--budget-s", "0"], "must be positive"),
    ("tile_sweep", ["--device", "cpu", "--small", "--heads", "5"], "must divide the hidden size 48"),
])
def test_gpu_script_options_are_checked(capsys, tmp_path, script, argv, message):
    assert message in refused(capsys, script, *argv, "--out", str(tmp_path))


@pytest.fixture
def fake_children(monkeypatch):
    """cpu_llama_step's child processes, replaced by made-up rows (the calls are kept)."""
    import cpu_llama_step

    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        row = {"variant": cmd[cmd.index("--variant") + 1], "process_peak_mb": 1.0, "step_extra_mb": 1.0,
               "rss_before_steps_mb": 1.0, "step_seconds": 1.0, "times": [1.0], "loss": 1.0, "parameters": 1}
        return SimpleNamespace(returncode=0, stdout=json.dumps(row) + "\n", stderr="")

    monkeypatch.setattr(cpu_llama_step.subprocess, "run", run)
    return calls


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "100", "--seq", "64"], "must be a multiple of --seq"),
    (["--tokens", "10", "--seq", "32"], "must be a multiple of --seq"),
    (["--steps", "0"], "must be a positive whole number"),
    (["--seq", "0"], "must be a positive whole number"),
    (["--threads", "0"], "must be a positive whole number"),
    (["--hidden", "12"], "must be a multiple of 8"),
])
def test_cpu_llama_step_options_are_checked(capsys, fake_children, tmp_path, argv, message):
    assert message in refused(capsys, "cpu_llama_step", *argv, "--out", str(tmp_path))
    assert not fake_children and not any(tmp_path.iterdir())


def test_partial_run_lands_beside_the_full_record(capsys, fake_children, tmp_path):
    import cpu_llama_step

    full = tmp_path / f"cpu_llama_step-{today()}"
    for ext in (".json", ".md"):
        full.with_suffix(ext).write_text("the full record")
    # the docstring's example: a partial run gets its own name, the full record stays
    cpu_llama_step.main(["--tokens", "2048", "--variants", "eager", "ce", "--out", str(tmp_path)])
    partial = tmp_path / f"cpu_llama_step-{today()}-tokens_2048-variants_eager-ce.json"
    assert json.loads(partial.read_text())["tokens"] == 2048
    assert all(full.with_suffix(ext).read_text() == "the full record" for ext in (".json", ".md"))
    # the same run again, or the full run, stops before starting any child
    calls = len(fake_children)
    for argv in (["--tokens", "2048", "--variants", "eager", "ce"], []):
        assert "exists, and a run never replaces a record" in refused(capsys, "cpu_llama_step", *argv, "--out", str(tmp_path))
    assert len(fake_children) == calls
    cpu_llama_step.main(["--force", "--out", str(tmp_path)])  # replacing is asked for
    assert json.loads(full.with_suffix(".json").read_text())["tokens"] == 4096


def test_main_job_names_its_options(capsys, monkeypatch, tmp_path):
    import main_job_cpu

    run = {"wall_seconds": 1.0, "user_seconds": 1.0, "system_seconds": 0.0, "train_runtime": 1.0, "max_rss_mb": 1,
           "load_average_before": 0.0, "final_eval": {"eval_loss": 1.0}}
    monkeypatch.setattr(main_job_cpu, "run_once", lambda extra: run)
    assert "must be a positive whole number" in refused(capsys, "main_job_cpu", "--repeats", "0", "--out", str(tmp_path))
    main_job_cpu.main(["--out", str(tmp_path), "--", "--loss", "ce"])
    assert (tmp_path / f"main_job_cpu-{today()}-loss-ce.json").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "must be a positive whole number"), (["--world", "0"], "must be a positive whole number"),
    (["--batch", "-1"], "must be a positive whole number"), (["--hidden", "20"], "must be a multiple of 8"),
])
def test_distributed_step_options_are_checked(capsys, monkeypatch, tmp_path, argv, message):
    import distributed_step

    monkeypatch.setattr(distributed_step, "run_config", lambda *a: pytest.fail("ran a configuration"))
    assert message in refused(capsys, "distributed_step", *argv, "--out", str(tmp_path))


def test_record_names_non_defaults_and_rewrites_only_its_own(capsys, tmp_path):
    import argparse

    import records

    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, nargs="+", default=[1])
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--small", action="store_true")
    records.add_out_options(p)
    args = p.parse_args(["--heads", "1", "4", "--budget-s", "300", "--small", "--out", str(tmp_path)])
    record = records.Record(p, args, "sweep-cpu-2026-01-01")
    assert Path(record.path).name == "sweep-cpu-2026-01-01-heads_1-4-budget-s_300-small"
    record.write([1], "# one")
    record.write([1, 2], "# two")  # peers.py: the same run rewrites after every shape
    assert json.loads(Path(record.path + ".json").read_text()) == [1, 2]
    with pytest.raises(SystemExit):
        records.Record(p, args, "sweep-cpu-2026-01-01")
    assert "--force" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        records.Record(p, p.parse_args(["--out", ""]), "x")
    assert "--out is empty" in capsys.readouterr().err


def test_default_out_is_the_checkout_results_whatever_the_cwd(monkeypatch, tmp_path):
    import records

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OUT", "")  # empty: unset, not the current directory
    assert records.default_out() == str(BENCH / "results")
    monkeypatch.setenv("OUT", str(tmp_path))
    assert records.default_out() == str(tmp_path)


def test_compile_check_partial_run_and_refusal(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OUT")}
    records = tmp_path / "records"
    records.mkdir()
    full = records / f"compile-check-{today()}.json"
    full.write_text("the full record")
    # a partial run, then the full run (refused before compiling anything), in one interpreter (tests/script_runs.py)
    script = str(BENCH / "compile_check.py")
    runs = {"partial": [script, "--arch", "sm_80", "--variants", "ce fp32", "--out", str(records)],
            "full": [script, "--out", str(records)]}
    status = run_scripts(runs, tmp_path, env, timeout=300)
    assert status["partial"] == 0, output(tmp_path, "partial")
    assert (records / f"compile-check-{today()}-arch_sm_80-variants_ce-fp32.json").is_file()
    assert full.read_text() == "the full record"
    stdout, stderr = output(tmp_path, "full")
    assert status["full"] == 2 and "exists, and a run never replaces a record" in stderr, stderr
    assert not stdout


def _device_run(tmp_path, *args, cwd=None, fake=None):
    """bash benchmarks/device_run.sh ARGS from ``cwd`` (default: an empty folder), with $OUT under
    tmp_path and the commands in ``fake`` ({name: shell body}) ahead of PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (fake or {}).items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    work = tmp_path / "cwd"
    work.mkdir(exist_ok=True)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PATH": f"{bin_dir}:{os.environ['PATH']}", "TMPDIR": str(tmp_path)}
    return subprocess.run(["bash", str(BENCH / "device_run.sh"), *args], cwd=cwd or work, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args", [[], ["tunee"], ["tune", "llama3"], ["peers", "llama4"], ["peers", "llama3", "0"],
                                  ["peers", "4k"], ["peers", "llama3", "04096"], ["peers", ""]],
                         ids=["none", "unknown", "tune_with_shape", "unknown_shape", "zero_tokens", "tokens_not_a_number",
                              "leading_zero", "empty"])
def test_device_run_usage(tmp_path, args):
    before = results_listing()
    proc = _device_run(tmp_path, *args)
    assert proc.returncode == 2 and proc.stderr.startswith("usage: bash benchmarks/device_run.sh tune | peers"), proc
    assert not (tmp_path / "out").exists() and not any((tmp_path / "cwd").iterdir())
    assert results_listing() == before


@pytest.mark.parametrize("fake, message", [
    ({"nvidia-smi": "exit 9"}, "nvidia-smi failed"),
    ({"nvidia-smi": "echo name; echo H100", "python3": "exit 1"}, "torch sees no CUDA GPU"),
], ids=["no_gpu", "no_cuda_torch"])
def test_device_run_checks_the_gpu_before_writing(tmp_path, fake, message):
    before = results_listing()
    proc = _device_run(tmp_path, "peers", "gpt2", "mistral7b", cwd=BENCH, fake=fake)  # from benchmarks/ too
    assert proc.returncode == 1 and message in proc.stderr, proc
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "cwd"] and results_listing() == before


def test_device_run_tune_steps_get_distinct_records(monkeypatch, tmp_path):
    """The tune stage's command lines, run with the GPU work stubbed: every step's options parse and
    each step's record gets its own name (six gpu_suite runs, two of them once under one name)."""
    import torch

    monkeypatch.setenv("HF_MHCE_WORKSPACE_MB", "512")  # gpu_suite --workspace-mb sets it: restored after the test
    text = (BENCH / "device_run.sh").read_text().replace("\\\n", " ").replace('"$sweep_s"', "300")  # a computed budget
    tune = text[text.index("  tune)\n"):text.index("  peers)\n")]
    steps = re.findall(r'python3 benchmarks/(\w+)\.py (.*?)--out "\$RECORDS"(.*)', tune)
    assert [s for s, *_ in steps] == ["gpu_suite"] * 6 + ["gpu_ties"] * 2 + ["tile_sweep"], steps
    stubs = {"gpu_suite": ("run_case", lambda *a: {"dtype": "bfloat16", "err_loss": 0.0}),
             "gpu_ties": ("run_case", lambda *a: {"forward": a[-1], "wrong_ranks": 0}), "tile_sweep": ("run", lambda *a: [])}
    for script, before, after in steps:
        module = importlib.import_module(script)
        monkeypatch.setattr(module, stubs[script][0], stubs[script][1])
        monkeypatch.setattr(module, "check_device", lambda p, args: torch.device("cpu"))
        monkeypatch.setattr(module, "device_label", lambda device: "GPU")
        module.main([*shlex.split(before), *shlex.split(after), "--out", str(tmp_path)])
    assert len(list(tmp_path.glob("*.json"))) == len(steps), sorted(p.name for p in tmp_path.iterdir())


@pytest.mark.parametrize("args, passed", [
    ([], ""), (["llama3"], "--shapes llama3"), (["32768"], "--tokens 32768"),
    (["gpt2", "4096", "mistral7b", "16384"], "--shapes gpt2 mistral7b --tokens 4096 16384"),
], ids=["defaults", "shape", "tokens", "both"])
def test_device_run_peers_passes_shapes_and_tokens(tmp_path, args, passed):
    """peers SHAPE... TOKENS...: a shape that a call could not finish is run again for the token counts left."""
    seen = tmp_path / "peers_args"
    python = (f'case "$1" in -c) exit 0 ;; -m) exit 1 ;; esac\n'
              f'[ "$1" = benchmarks/peers.py ] && shift 3 && echo "$@" > {shlex.quote(str(seen))}')  # past --out DIR
    proc = _device_run(tmp_path, "peers", *args, fake={"nvidia-smi": "echo name; echo H100", "python3": python})
    assert proc.returncode == 1 and "peer wheels not installed" in proc.stdout, proc  # pip is faked to fail
    assert seen.read_text() == passed + "\n"


def test_device_run_packs_the_records(tmp_path):
    """The peers stage on CPU (python3 faked: the GPU check passes, pip finds no wheels, peers.py runs
    at --small with two torch-only variants): the records come back packed, a failure is listed and
    sets the exit status, and $OUT holds no more files than the device tool returns."""
    python = (f'case "$1" in -c) exit 0 ;; -m) exit 1 ;; esac\nexec {shlex.quote(sys.executable)} "$@" --device cpu '
              "--small --tokens 37 --reps 1 --rotate 1 --variants hf_eager slab_fwdgrad")
    proc = _device_run(tmp_path, "peers", fake={"nvidia-smi": "echo name; echo H100", "python3": python})
    out = tmp_path / "out"
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["device.txt", "failures.txt", "log.txt", "records.tar.gz"]
    assert (out / "failures.txt").read_text() == "peer wheels not installed\n"
    with tarfile.open(out / "records.tar.gz") as tar:
        names = sorted(Path(n).name for n in tar.getnames() if n.endswith((".json", ".md")))
    assert [Path(n).suffix for n in names] == [".json", ".md"] and names[0].startswith(f"cpu-{today()}-peers-gpt2-small")
    assert "| hf_eager |" in (out / "log.txt").read_text()
    # its scratch folder removed (importing torch._dynamo makes $TMPDIR/torchinductor_<user> unless an earlier
    # test's process exported TORCHINDUCTOR_CACHE_DIR: not the script's)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_")) == ["bin", "cwd", "out"]



def test_device_run_stops_a_step_in_time_to_pack_it(tmp_path, monkeypatch):
    """The device tool kills a call at its limit with everything in it, packing too: a peers run cut
    there lost the shapes it had finished (written to the scratch folder, packed only after the step).
    A step still running at the budget is stopped by the script itself, and what it wrote comes back."""
    python = ('case "$1" in -c) exit 0 ;; -m) exit 1 ;; esac\n'
              'while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done\n'
              'echo "[1]" > "$out/first-shape.json"; echo "# first shape" > "$out/first-shape.md"\nsleep 20')
    monkeypatch.setenv("DEVICE_RUN_BUDGET_S", "3")
    proc = _device_run(tmp_path, "peers", fake={"nvidia-smi": "echo name; echo H100", "python3": python})
    out = tmp_path / "out"
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "peers stopped: time budget spent" in (out / "failures.txt").read_text()
    with tarfile.open(out / "records.tar.gz") as tar:
        assert sorted(Path(n).name for n in tar.getnames() if n.endswith((".json", ".md"))) == [
            "first-shape.json", "first-shape.md"]


@pytest.mark.parametrize("budget, slow_s, expected", [(100, 0, (35, 40)), (100, 3, (32, 37)), (70, 0, (20, 20))],
                         ids=["left", "after_slow_steps", "minimum"])
def test_device_run_gives_the_tile_sweep_what_is_left(tmp_path, monkeypatch, budget, slow_s, expected):
    """step stops the sweep at what is left of the call's budget after the nine steps before it; a fixed
    --budget-s 200 outlived that, the sweep was killed before it wrote anything.  Its budget is now the
    time left less a margin (60 s), never under 20 s (then step's SIGTERM makes it write what it has)."""
    log = tmp_path / "calls.txt"
    python = ('case "$1" in -c) exit 0 ;; -m) exit 1 ;; esac\n'
              f'echo "$@" >> {shlex.quote(str(log))}\n'
              f'case "$1" in benchmarks/gpu_ties.py) sleep {slow_s} ;; esac')
    monkeypatch.setenv("DEVICE_RUN_BUDGET_S", str(budget))
    _device_run(tmp_path, "tune", fake={"nvidia-smi": "echo name; echo H100", "python3": python})
    (sweep,) = [line.split() for line in log.read_text().splitlines() if line.startswith("benchmarks/tile_sweep.py")]
    assert expected[0] <= float(sweep[sweep.index("--budget-s") + 1]) <= expected[1], sweep


def test_each_row_runs_in_its_own_configuration_whatever_the_callers(monkeypatch):
    """hf_mhce_ce_lean runs under HF_MHCE_WORKSPACE_MB=64 (its backward reads it) and the default rows
    under the default workspace and schedule, even where the caller set others (a row labelled "512 MB,
    default" ran at the caller's workspace); after the run the caller's values are back."""
    import torch

    import peers

    seen = []

    def stub(name, device):
        seen.append((name, os.environ.get("HF_MHCE_WORKSPACE_MB"), os.environ.get("HF_MHCE_GRAD_IN_FORWARD")))
        raise peers.Unavailable("stub")

    monkeypatch.setattr(peers, "make_variant", stub)
    for before in (None, "300"):
        for key, value in (("HF_MHCE_WORKSPACE_MB", before), ("HF_MHCE_GRAD_IN_FORWARD", before and "0")):
            if value is None:
                monkeypatch.delenv(key, raising=False)
            else:
                monkeypatch.setenv(key, value)
        seen.clear()
        peers.run_shape("tiny", 8, 16, 4, ["hf_mhce_ce", "hf_mhce_ce_lean", "hf_mhce_ce_fast", "hf_mhce_ce"],
                        torch.device("cpu"), torch.bfloat16, 1, 1)
        assert seen == [("hf_mhce_ce", None, None), ("hf_mhce_ce_lean", "64", None), ("hf_mhce_ce_fast", "8192", None),
                        ("hf_mhce_ce", None, None)]
        assert os.environ.get("HF_MHCE_WORKSPACE_MB") == before
        assert os.environ.get("HF_MHCE_GRAD_IN_FORWARD") == (before and "0")
