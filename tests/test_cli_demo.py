"""hf-mhce demo: the fused ops on a random problem, with its argument check."""

import math

import pytest
import torch

from hf_mhce.cli import main


def test_demo_prints_the_fused_losses(capsys):
    assert main(["demo", "--tokens", "40", "--vocab", "301", "--hidden", "24", "--heads", "1", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    eager = next(line for line in lines if line.startswith("HF eager")).split()
    fused = next(line for line in lines if line.startswith("fused CE")).split()
    mhce = next(line for line in lines if line.startswith("fused MHCE H=4")).split()
    assert abs(float(fused[2]) - float(eager[3])) < 1e-5  # same loss as the logits path
    assert float(fused[-1]) < 1e-5 and mhce[-1] == "-"  # dX agrees; MHCE has no eager counterpart
    sums = lines[-1].split("sum to ")[1].strip("[]").split(",")
    assert all(abs(float(v) - 1) < 1e-5 for v in sums)


def test_demo_refuses_heads_that_do_not_divide_the_hidden_size(capsys):
    """A usage error (exit 2, the usage line), as every other bad option; it was exit 1 without usage."""
    with pytest.raises(SystemExit) as info:
        main(["demo", "--tokens", "8", "--vocab", "50", "--hidden", "24", "--heads", "1", "5"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("usage: hf-mhce")
    assert "error: --heads [5]: every head count must divide --hidden 24" in err


def test_top_level_help_keeps_its_usage_lines(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "\n    hf-mhce demo                      the fused ops on a random problem" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--tokens", "--vocab", "--hidden", "--heads"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_demo_refuses_counts_below_one(flag, value, capsys):
    """--vocab 0 was a traceback in random_, --tokens 0 a table of empty rows: argparse names the flag."""
    with pytest.raises(SystemExit) as info:
        main(["demo", "--tokens", "8", "--vocab", "50", "--hidden", "24", flag, value])
    assert info.value.code == 2
    assert f"argument {flag}: {value}: must be a positive whole number" in capsys.readouterr().err


def test_demo_with_few_tokens_keeps_targets(capsys):
    """Under 16 tokens every label was ignored (a step of 1), and every loss printed NaN."""
    for tokens in ("1", "2", "9"):
        assert main(["demo", "--tokens", tokens, "--vocab", "50", "--hidden", "8", "--heads", "1", "2"]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("HF eager", "fused"))]
        values = [float(row[-3]) for row in rows]
        assert len(values) == 3 and all(math.isfinite(v) and v > 0 for v in values), rows


@pytest.mark.parametrize("interpreter", ["0", "1"])
def test_triton_backend_without_a_gpu_is_one_line_before_any_work(interpreter, monkeypatch, capsys):
    """HF_MHCE_BACKEND=triton on a machine with no GPU printed the eager row, then a traceback from the
    first fused loss: the command now stops at once, unless Triton's interpreter is on (then it runs)."""
    monkeypatch.setenv("HF_MHCE_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", interpreter)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status = main(["demo", "--tokens", "8", "--vocab", "50", "--hidden", "8", "--heads", "1"])
    captured = capsys.readouterr()
    if interpreter == "1":
        assert status == 0 and "fused" in captured.out
    else:
        assert status == 2 and captured.out == "" and "Traceback" not in captured.err
        assert captured.err.startswith("hf-mhce: error: HF_MHCE_BACKEND=triton needs a CUDA GPU")
        assert "TRITON_INTERPRET=1" in captured.err


@pytest.mark.parametrize("command", [["demo", "--tokens", "8", "--vocab", "50", "--hidden", "8"],
                                     ["train", "--max_steps", "1", "--output_dir", "unused"],
                                     ["rbe", "some/model", "--dataset", "x.txt"]])
@pytest.mark.parametrize("name,value", [("HF_MHCE_CHUNK_MB", "abc"), ("HF_MHCE_WORKSPACE_MB", "-1"),
                                        ("HF_MHCE_BACKEND", "cuda"), ("HF_MHCE_GRAD_IN_FORWARD", "yes")])
def test_a_bad_environment_setting_is_one_line_before_any_work(command, name, value, monkeypatch, capsys):
    """An unusable HF_MHCE_* value was a traceback from inside the first loss (demo), or after the data
    were read (train): every command now says which variable, and stops at once.  Help still prints."""
    monkeypatch.setenv(name, value)
    assert main(command) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"hf-mhce: error: {name} must be") and "Traceback" not in captured.err
    assert captured.out == ""
    with pytest.raises(SystemExit) as info:
        main([command[0], "--help"])
    assert info.value.code == 0 and "usage" in capsys.readouterr().out.lower()
