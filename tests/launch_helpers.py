"""Starting test processes: a free port and an environment without a parent's distributed settings;
and how a launched worker leaves."""

from __future__ import annotations

import os
import socket
import sys

DISTRIBUTED_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(*pythonpath: str, **extra: str) -> dict[str, str]:
    """os.environ with one torch thread per process, ``pythonpath`` first on PYTHONPATH, ``extra``
    set, and none of the variables that would make a child join the parent's process group."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **extra)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*pythonpath, os.environ.get("PYTHONPATH", "")])
    for var in DISTRIBUTED_VARS:
        env.pop(var, None)
    return env


def run_worker_pair(worker, tmp, env: dict[str, str], timeout: int = 400) -> tuple[dict, dict]:
    """Run ``worker OUT_JSON`` under torch.distributed.run with 2 processes, then alone (its
    single-process reference); returns the two JSON results (rank 0's, and the single run's)."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(worker), str(tmp / "dist.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(tmp))
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-5000:])
    single = subprocess.run([sys.executable, str(worker), str(tmp / "single.json")],
                            capture_output=True, text=True, env=env, timeout=timeout, cwd=str(tmp))
    assert single.returncode == 0, single.stderr[-4000:]
    return json.loads((tmp / "dist.json").read_text()), json.loads((tmp / "single.json").read_text())


def leave_without_teardown() -> None:
    """End a launched worker whose results are written: meet the other ranks, then exit without the
    process group's teardown.  At exit, gloo / DDP / DeepSpeed destructors now and then abort a
    finished process (SIGABRT, "terminate called without an active exception") or deadlock
    (torch 2.13), which would fail a run whose results are all there."""
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def finish(results: dict, out: str, distributed: bool) -> None:
    """Rank 0 (or the only process) writes ``results`` as JSON to ``out``; a launched worker then leaves."""
    import json

    import torch.distributed as dist

    if not distributed or dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    if distributed:
        leave_without_teardown()
