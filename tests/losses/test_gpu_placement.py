"""Where the kernels run on a GPU machine, checked here with the CUDA queries stubbed: the inputs' GPU is the
current device while they run, and GPUs older than Volta take the torch path."""

import contextlib

import pytest
import torch

from hf_mhce.losses import dispatch
from hf_mhce.losses.functions import kernels_on


def test_kernels_run_with_the_inputs_gpu_current(monkeypatch):
    """Triton launches on the current device and its stream: a head on cuda:1 (device_map="auto") while cuda:0
    was current was read across devices (a crash, or without waiting for cuda:1's stream, a wrong loss)."""
    entered = []
    monkeypatch.setattr(torch.cuda, "device", lambda device: entered.append(device) or contextlib.nullcontext())
    with kernels_on(torch.device("cuda", 1)):
        assert not torch.is_autocast_enabled("cuda")
    with kernels_on(torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
    assert entered == [torch.device("cuda", 1)]


def test_gpus_older_than_volta_take_the_torch_path(monkeypatch):
    """The bias gradient's atomic (since replaced) did not compile for sm_60 (a P100): the first backward failed
    with Triton's "Internal Triton PTX codegen error"; no older GPU has run the kernels since."""
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(dispatch, "_triton_ops", lambda: "triton ops")
    gpu = torch.device("cuda", 0)
    for capability, ops in (((6, 0), dispatch._TORCH_OPS), ((7, 0), "triton ops"), ((9, 0), "triton ops")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert dispatch.resolve("auto", gpu, torch.bfloat16) is ops
        assert dispatch.resolve("auto", gpu, torch.float64) is dispatch._TORCH_OPS  # no float64 kernels
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (6, 1))
    with pytest.raises(ValueError, match=r"compute capability 7.0 \(Volta\) or newer, cuda:0 has 6.1"):
        dispatch.resolve("triton", gpu, torch.bfloat16)
