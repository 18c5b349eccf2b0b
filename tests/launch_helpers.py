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


# The fused loss on each backend, for worker processes: the torch sweeps, and the Triton kernels under the
# interpreter, whose training losses compute their gradients in the forward (HF_MHCE_BACKEND=triton: every
# loss call runs the kernels or raises).
LOSS_BACKENDS = {"torch": {"HF_MHCE_BACKEND": "torch"},
                 "triton": {"HF_MHCE_BACKEND": "triton", "TRITON_INTERPRET": "1"}}


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
    """Run ``worker OUT_JSON SINGLE_JSON`` under torch.distributed.run with 2 processes; returns the two
    JSON results (rank 0's, and the single-process reference's).

    The reference comes from the same launch: rank 0 computes it first (``single_reference``), before
    any process group exists and with the launcher's variables out of the environment, as the worker
    run alone would; one interpreter start (torch, transformers, DeepSpeed imports) fewer than a
    separate single-process run."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(worker), str(tmp / "dist.json"),
           str(tmp / "single.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(tmp))
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-5000:])
    return json.loads((tmp / "dist.json").read_text()), json.loads((tmp / "single.json").read_text())


def single_reference(compute, argv: list[str]) -> None:
    """In a worker launched by ``run_worker_pair`` (``argv``: OUT_JSON SINGLE_JSON), rank 0 writes
    ``compute()`` -- the single-process reference -- to SINGLE_JSON.  Call it before the process group
    is set up: it runs with no process group and with the launcher's variables (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_*, ...) removed from the environment, then restored.  The other rank waits
    for it in the process group's rendezvous.  The global torch RNG state is restored afterwards."""
    import json

    import torch

    if len(argv) < 2 or os.environ.get("RANK", "0") != "0":
        return
    launcher = {k: os.environ.pop(k) for k in list(os.environ)
                if k in DISTRIBUTED_VARS or k.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_", "LOCAL_WORLD"))}
    rng = torch.random.get_rng_state()
    try:
        results = compute()
    finally:
        os.environ.update(launcher)
        torch.random.set_rng_state(rng)  # the distributed run starts from the same state as on rank 1
    with open(argv[1], "w") as f:
        json.dump(results, f)


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
