"""hf-mhce demo: the fused ops on a random problem, with its argument check."""

import pytest

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


def test_demo_refuses_heads_that_do_not_divide_the_hidden_size():
    with pytest.raises(SystemExit, match=r"--heads \[5\]: every head count must be positive and divide --hidden 24"):
        main(["demo", "--tokens", "8", "--vocab", "50", "--hidden", "24", "--heads", "1", "5"])
