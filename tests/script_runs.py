"""Run several scripts one after the other in one Python process, each as ``python SCRIPT ARGS...``
would run it (as ``__main__``, its folder first on sys.path, sys.argv set).

The example and benchmark tests run a handful of scripts each; one interpreter start (torch,
transformers, triton, hf_mhce imported once) instead of one per script is most of their time on CI.
Each run's output at the file descriptors (Python's and C's) goes to BASE/<name>.stdout and
.stderr, and its exit status to BASE/status.json; a run that fails is recorded (its traceback in its
.stderr) and the next one still runs.

Usage: python tests/script_runs.py BASE RUNS_JSON     (RUNS_JSON: {name: [script path, *args]}, or
{name: ["-m", "package.module", *args]} for ``python -m``)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_scripts(runs: dict[str, list[str]], base: Path, env: dict[str, str], timeout: int,
                cwd: str | None = None) -> dict[str, int]:
    """Run ``runs`` in one subprocess (see the module docstring); returns {name: exit status}."""
    proc = subprocess.run([sys.executable, __file__, str(base), json.dumps(runs)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    status = Path(base) / "status.json"
    assert proc.returncode == 0 and status.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(status.read_text())


def output(base: Path, name: str) -> tuple[str, str]:
    """(stdout, stderr) of run ``name``."""
    return tuple((Path(base) / f"{name}.{ext}").read_text() for ext in ("stdout", "stderr"))


def _exit_status(err: SystemExit) -> int:
    if err.code is None or isinstance(err.code, int):
        return err.code or 0
    print(err.code, file=sys.stderr)  # what the interpreter does with sys.exit("message")
    return 1


def _run_one(script: str, args: list[str]) -> int:
    import runpy
    import traceback

    module = args.pop(0) if script == "-m" else None  # ["-m", "package.module", *args]: python -m
    if module is None:
        folder = os.path.dirname(os.path.abspath(script))
        if folder not in sys.path:
            sys.path.insert(0, folder)
    sys.argv = [script if module is None else module, *args]
    try:
        if module is None:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as err:
        return _exit_status(err)
    except BaseException:
        traceback.print_exc()
        return 1


def main(base: str, runs: dict[str, list[str]]) -> None:
    status = {}
    for name, (script, *args) in runs.items():
        saved = []
        for fd, ext in ((1, "stdout"), (2, "stderr")):
            sys.stdout.flush(), sys.stderr.flush()
            saved.append(os.dup(fd))
            with open(os.path.join(base, f"{name}.{ext}"), "w") as f:
                os.dup2(f.fileno(), fd)
        status[name] = _run_one(script, args)
        sys.stdout.flush(), sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
    with open(os.path.join(base, "status.json"), "w") as f:
        json.dump(status, f)


if __name__ == "__main__":
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]  # the scripts see their folder, not tests/
    main(sys.argv[1], json.loads(sys.argv[2]))
