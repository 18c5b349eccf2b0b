"""The README's first command: its entry point, run as written, reduced by options only."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from test_train_job import REDUCED

README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_opens_with_the_two_commands():
    main_job, tests = _readme_commands()[:2]
    assert main_job.rstrip().endswith("hf-mhce train")
    assert '-e ".[plot]"' in main_job  # the job's default writes RBE plots (matplotlib is an extra)
    ci = (README.parent / ".ci" / "run").read_text()
    assert tests.strip() in ci  # .ci/run runs exactly the README's test command


def test_readme_main_job_runs(tmp_path):
    # The installs before it are what CI itself does; the job command runs as written (through the
    # installed console script's module), with options appended to keep it short.
    job = shlex.split(_readme_commands()[0].split("&&")[-1])
    assert job[:2] == ["hf-mhce", "train"]
    cmd = [sys.executable, "-m", "hf_mhce.cli", *job[1:], *REDUCED, "--output_dir", str(tmp_path / "out")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hf-mhce train: mhce (H=4)" in result.stdout and "sample:" in result.stdout
    assert (tmp_path / "out" / "metrics.json").exists()
