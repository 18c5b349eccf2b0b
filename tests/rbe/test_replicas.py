"""RBECallback refuses to report metrics from processes that train different models: the upstream
pitfall (trainer.evaluate() before trainer.train() leaves the model without DDP) raises after the
first steps, naming the cause; a synchronised run (eval_on_start) passes the same check."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch_helpers import child_env, free_port

from hf_mhce.rbe.replicas import check_replicas_in_sync, parameter_checksum

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


@pytest.mark.timeout(400)
def test_unsynchronised_processes_raise(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(HERE / "replicas_worker.py"),
           str(tmp_path / "out.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(str(HERE), str(HERE.parent), str(ROOT)), timeout=380,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["evaluate_first"] and "trainer.evaluate() before trainer.train()" in result["evaluate_first"]
    assert result["eval_on_start"] is None


def test_checksum_and_single_process_noop():
    layer = torch.nn.Linear(3, 2)
    frozen = torch.nn.Linear(3, 2).requires_grad_(False)
    model = torch.nn.Sequential(layer, frozen)
    expected = sum(float(p.detach().double().abs().sum() + p.detach().double().sum()) for p in layer.parameters())
    assert float(parameter_checksum(model)) == pytest.approx(expected)
    check_replicas_in_sync(model)  # no process group: nothing to compare, no error
