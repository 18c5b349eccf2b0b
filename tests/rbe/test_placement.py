"""Sizes and devices read through sharding and offloading (hf_mhce.rbe.placement): the head's vocabulary
under DeepSpeed ZeRO-3 (an empty placeholder weight), FSDP1 (an empty view), accelerate's offloading
(a meta weight); where the batches go for an offloaded model; where a collective's tensors go (NCCL:
CUDA only).  ZeRO-3 end to end: two CPU processes (DeepSpeed's CPU accelerator over gloo) give the
single process's RBE statistics, from hf_mhce.rbe.evaluate and from RBECallback."""

import tempfile
from pathlib import Path

import deepspeed  # noqa: F401  (in the [test] extra: a missing install fails, never skips)
import pytest
import torch
import torch.distributed as dist
from launch_helpers import child_env, run_worker_pair
from rbe_helpers import make_model

import hf_mhce
from hf_mhce.rbe import RBEStats, evaluate
from hf_mhce.rbe.placement import collective_device, head_vocab_size, input_device

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def _replace_head_weight(model, weight):
    head = model.get_output_embeddings()
    del head.weight
    head.weight = weight
    return model


def test_head_vocab_size_without_the_weights_data():
    assert head_vocab_size(make_model("llama", vocab=61)) == 61
    # ZeRO-3: an empty placeholder between calls, the full shape in ds_shape
    placeholder = torch.nn.Parameter(torch.empty(0))
    placeholder.ds_shape = torch.Size([61, 32])
    assert head_vocab_size(_replace_head_weight(make_model("llama", vocab=61), placeholder)) == 61
    # FSDP1's empty view: the Linear's out_features; accelerate's offload: a meta weight keeps its shape
    assert head_vocab_size(_replace_head_weight(make_model("llama", vocab=61), torch.nn.Parameter(torch.empty(0)))) == 61
    meta = torch.nn.Parameter(torch.empty(61, 32, device="meta"))
    assert head_vocab_size(_replace_head_weight(make_model("llama", vocab=61), meta)) == 61
    # no output embedding: the config's vocabulary
    model = make_model("llama", vocab=61)
    model.get_output_embeddings = lambda: None
    assert head_vocab_size(model) == 61


def test_a_model_with_an_offloaded_head_is_evaluated_where_it_runs():
    """device_map with lm_head on "disk": its weight is on the meta device, where the batches went."""
    from accelerate import dispatch_model

    model = make_model("llama", vocab=61)
    ids = torch.randint(0, 61, (2, 8))
    reference = evaluate(hf_mhce.apply_patch(make_model("llama", vocab=61)), ids).decomposition
    with tempfile.TemporaryDirectory() as offload:
        model = dispatch_model(model, device_map={"model": "cpu", "lm_head": "disk"}, offload_dir=offload)
        assert model.lm_head.weight.is_meta
        assert input_device(model) == torch.device("cpu")
        report = evaluate(hf_mhce.apply_patch(model), ids)
    assert report.decomposition.num_tokens == reference.num_tokens == 14
    assert report.decomposition.cross_entropy == pytest.approx(reference.cross_entropy, rel=1e-6)


@pytest.fixture
def gloo_group():
    """A one-process gloo group, torn down afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_collective_device_follows_the_backend(gloo_group, monkeypatch):
    assert collective_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for backend, device in [("nccl", torch.device("cuda", 3)), ("cpu:gloo,cuda:nccl", torch.device("cpu")),
                            ("gloo", torch.device("cpu")), ("mpi", torch.device("cpu"))]:
        monkeypatch.setattr(dist, "get_backend", lambda group=None, backend=backend: backend)
        assert collective_device() == device, backend


def test_all_reduce_runs_on_the_collective_device(gloo_group, monkeypatch):
    stats = RBEStats(5).add(torch.tensor([0, 2, 2]), torch.tensor([0.5, 1.0, 2.0]))
    counts, sums = stats.counts, stats.nll_sums
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)  # so that the one-process collective runs
    stats.all_reduce()
    assert stats.counts is counts and stats.counts.tolist() == [1, 0, 2, 0, 0]
    assert stats.nll_sums is sums and stats.nll_sums.tolist() == [0.5, 0, 3.0, 0, 0]
    # NCCL reduces CUDA tensors only: the statistics (on the CPU) go to the backend's device
    seen = []

    def all_reduce(tensor, group=None):
        seen.append(tensor.device)
        raise InterruptedError  # the device is all this checks (no other device to copy back from here)

    monkeypatch.setattr("hf_mhce.rbe.stats.collective_device", lambda group=None: torch.device("meta"), raising=False)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with pytest.raises(InterruptedError):
        stats.all_reduce()
    assert seen == [torch.device("meta")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")
def test_all_reduce_of_cpu_statistics_under_nccl(monkeypatch):
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)  # the real one-process collective
        stats = RBEStats(5).add(torch.tensor([1, 1]), torch.tensor([0.25, 0.5]))
        stats.all_reduce()
        assert stats.counts.device.type == "cpu" and stats.counts.tolist() == [0, 2, 0, 0, 0]
        assert stats.nll_sums.tolist() == [0, 0.75, 0, 0, 0]
    finally:
        dist.destroy_process_group()


# -- DeepSpeed ZeRO-3 -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory):
    env = child_env(str(HERE), str(HERE.parent), str(HERE.parent / "patching"), str(ROOT), DS_ACCELERATOR="cpu")
    return run_worker_pair(HERE / "zero3_worker.py", tmp_path_factory.mktemp("rbe_zero3"), env)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["ce", "lora_mhce"])
def test_zero3_rbe_matches_single_process(zero3_runs, case):
    dist_run, single = (runs[case] for runs in zero3_runs)
    assert dist_run["placeholder_shape"] == [0], "ZeRO-3 did not partition the head: the test would prove nothing"
    assert dist_run["vocab"] == single["vocab"] == len(single["evaluate"]["counts"])
    for path in ("evaluate", "callback"):
        got, ref = dist_run[path], single[path]
        assert got["counts"] == ref["counts"] and sum(ref["counts"]) > 0, path
        torch.testing.assert_close(torch.tensor(got["nll_sums"], dtype=torch.float64),
                                   torch.tensor(ref["nll_sums"], dtype=torch.float64), rtol=1e-9, atol=1e-12)
    assert single["callback"] == single["evaluate"]
