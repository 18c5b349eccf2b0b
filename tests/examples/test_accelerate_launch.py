"""examples/finetune.py under ``accelerate launch`` with examples/accelerate/cpu_multi_process.yaml
(two CPU processes, gloo DDP) against one process with the same global batch: the same loss curve,
the same evaluation losses and RBE metrics; with and without PEFT LoRA on attention and lm_head."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import child_env, free_port
from script_runs import output, run_scripts

ROOT = Path(__file__).resolve().parents[2]
FINETUNE = ROOT / "examples" / "finetune.py"
CONFIG = ROOT / "examples" / "accelerate" / "cpu_multi_process.yaml"
ENV = child_env()


LORA = ["--lora_r", "4", "--lora_target_modules", "q_proj,v_proj,lm_head", "--no_merge_lora"]
EXTRA = {"full": [], "lora_attention_and_head": LORA}


def _args(out: Path, checkpoint: Path, processes: int, extra: list[str]) -> list[str]:
    return ["--quick", "--model", str(checkpoint), "--out", str(out), "--max_steps", "4", "--logging_steps", "1",
            "--eval_steps", "4", "--per_device_train_batch_size", str(4 // processes),
            "--per_device_eval_batch_size", "2", "--report_to", "none", "--use_cpu", *extra]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """(checkpoint, {case: results.json of the one-process run, or the failure})."""
    base = tmp_path_factory.mktemp("one_process")
    checkpoint = base / "ckpt"
    # a small MHCE (H=2) checkpoint from the main job, as a user's --model; then the one-process runs of
    # finetune.py; all in one process started once (tests/script_runs.py)
    train = ["-m", "hf_mhce.cli", "train", "--output_dir", str(checkpoint), "--vocab_size", "300", "--hidden_size", "32",
             "--num_hidden_layers", "1", "--intermediate_size", "64", "--block_size", "32", "--max_train_blocks", "16",
             "--max_eval_blocks", "4", "--max_steps", "2", "--eval_strategy", "no", "--per_device_train_batch_size",
             "4", "--no_rbe_plots", "--sample_tokens", "2", "--num_heads", "2"]
    runs = {"checkpoint": train,
            **{case: [str(FINETUNE), *_args(base / case, checkpoint, 1, extra)] for case, extra in EXTRA.items()}}
    status = run_scripts(runs, base, ENV, timeout=480, cwd=str(ROOT))
    assert status["checkpoint"] == 0, output(base, "checkpoint")[1][-5000:]
    return checkpoint, {case: (json.loads((base / case / "results.json").read_text()) if status[case] == 0
                               else (status[case], output(base, case)[1][-5000:])) for case in EXTRA}


def _launch(out: Path, checkpoint: Path, extra: list[str]) -> dict:
    """finetune.py under accelerate launch, two processes."""
    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
    cmd = [launcher, "launch", "--config_file", str(CONFIG), "--main_process_port", str(free_port()),
           str(FINETUNE), *_args(out, checkpoint, 2, extra)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=240, cwd=str(ROOT))
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    return json.loads((out / "results.json").read_text())


def _curve(result: dict) -> list[tuple[int, float]]:
    return [(h["step"], h["loss"]) for h in result["log_history"] if "loss" in h]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(EXTRA))
def test_two_processes_match_one(tmp_path, one_process, case):
    checkpoint, results = one_process
    one = results[case]
    assert isinstance(one, dict), one  # else (the one-process run's failure, its output)
    two = _launch(tmp_path / "two", checkpoint, EXTRA[case])
    lora = case != "full"
    assert one["config"]["world_size"] == 1 and two["config"]["world_size"] == 2
    assert one["config"]["loss"] == two["config"]["loss"] == {**one["config"]["loss"], "loss": "mhce", "num_heads": 2}
    curve1, curve2 = _curve(one), _curve(two)
    assert [s for s, _ in curve1] == [1, 2, 3, 4] and [s for s, _ in curve2] == [1, 2, 3, 4]
    assert len({round(v, 4) for _, v in curve1}) > 1  # the loss moves: the comparison means something
    for (_, a), (_, b) in zip(curve1, curve2):
        assert b == pytest.approx(a, rel=1e-4)
    # evaluation (before and after) and its RBE decomposition: the same numbers
    assert [(r["eval_set"], r["when"]) for r in one["rows"]] == [(r["eval_set"], r["when"]) for r in two["rows"]]
    for r1, r2 in zip(one["rows"], two["rows"]):
        assert r2["num_tokens"] == r1["num_tokens"]
        for key in ("loss", "cross_entropy", "error_entropy", "self_alignment", "confidence", "top1"):
            assert r2[key] == pytest.approx(r1[key], rel=1e-4, abs=1e-6), (r1["eval_set"], r1["when"], key)
    if lora:
        assert 0 < two["config"]["trainable_parameters"] < two["config"]["parameters"]
