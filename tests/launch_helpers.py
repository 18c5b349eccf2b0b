"""Starting test processes: a free port and an environment without a parent's distributed settings."""

from __future__ import annotations

import os
import socket

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
