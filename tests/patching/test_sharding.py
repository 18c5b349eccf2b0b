"""The fused loss under FSDP2 (two CPU processes, gloo): the head in the root unit, the head as its
own unit (a sharded DTensor outside its call), PEFT LoRA on attention and lm_head with every LoRA
matrix its own unit; loss and gradients equal the single-process run.  Plus the guards: a sharded or
empty head weight that reaches the fused op is an error naming the problem, never a wrong number."""

from pathlib import Path

import pytest
import torch
from launch_helpers import LOSS_BACKENDS as BACKENDS, child_env, run_worker_pair
from patching_models import assert_step_equal, batch, make_model

import hf_mhce
from hf_mhce.patching import sharding

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


@pytest.fixture(scope="module", params=list(BACKENDS))
def runs(request, tmp_path_factory):
    env = child_env(str(HERE), str(HERE.parent), str(ROOT), **BACKENDS[request.param])
    return run_worker_pair(HERE / "sharding_worker.py", tmp_path_factory.mktemp("fsdp"), env)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["fsdp_root_ce", "fsdp_root_mhce", "fsdp_head_ce", "fsdp_head_mhce",
                                  "fsdp_lora_ce", "fsdp_lora_mhce"])
def test_fsdp2_matches_single_process(runs, case):
    dist, single = runs
    assert_step_equal(dist[case], single[case], case)
    if "lora" in case:  # LoRA on lm_head trains: its matrices get gradients, through the fused loss
        assert any("lm_head.lora_B" in n for n in dist[case]["grads"])


@pytest.mark.timeout(300)
def test_patched_ce_matches_unpatched_reference(runs):
    _, single = runs
    assert_step_equal(single["fsdp_root_ce"], single["unpatched"], "patched vs unpatched")


@pytest.mark.timeout(300)
def test_fsdp2_head_unit_read_directly_is_an_error(runs):
    """What peers do (read lm_head.weight without its unit's hooks) sees a DTensor shard: we raise."""
    dist, _ = runs
    assert dist["unguarded"]["error"] and "sharded DTensor" in dist["unguarded"]["error"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_fsdp1_head_in_its_own_unit(tmp_path, backend):
    """FSDP1 (FullyShardedDataParallel, accelerate's fsdp_version 1) with lm_head wrapped in its own unit,
    as a size-based policy does with a large head: the fused loss runs inside the wrapper's forward,
    which gathers the flat parameter (was: UnsupportedHeadError "the LM head is a
    FullyShardedDataParallel, not an nn.Linear" at the first step).  Loss and every gradient equal the
    single-process run, for CE, MHCE and LoRA on the head (its matrices wrapped too)."""
    env = child_env(str(HERE), str(HERE.parent), str(ROOT), **BACKENDS[backend])
    dist, single = run_worker_pair(HERE / "fsdp1_worker.py", tmp_path, env)
    for case in dist:
        assert_step_equal(dist[case], single[case], case)
    assert any("lm_head.lora_B" in n for n in dist["fsdp1_head_lora_mhce"]["grads"])


def test_empty_partitioned_weight_is_an_error():
    """ZeRO-3 leaves an empty placeholder outside the owning module's call: never computed on."""
    model = hf_mhce.apply_patch(make_model("llama"), loss="mhce", num_heads=2)
    model.lm_head.weight = torch.nn.Parameter(torch.empty(0))
    ids, labels = batch()
    with pytest.raises(sharding.ShardedHeadError, match=r"shape \(0,\).*ZeRO-3"):
        model(input_ids=ids, labels=labels)


def test_call_through_runs_inside_hooked_modules():
    """A module marked as owning sharded parameters (a ZeRO-3 ds_id) gets its forward hooks run
    around the loss, innermost module doing the work; the original forward is restored after."""
    model = hf_mhce.apply_patch(make_model("llama"), loss="ce")
    ref = hf_mhce.apply_patch(make_model("llama"), loss="ce")
    ids, labels = batch()
    calls = []
    model.lm_head.weight.ds_id = 7  # looks partitioned to call_through
    model.lm_head.register_forward_pre_hook(lambda m, args: calls.append(("pre", args[0].shape)))
    model.lm_head.register_forward_hook(lambda m, args, out: calls.append(("post", out.shape)))
    forward_before = model.lm_head.forward
    loss = model(input_ids=ids, labels=labels).loss
    assert calls == [("pre", torch.Size([2, 12, 32])), ("post", torch.Size([]))]
    assert "forward" not in model.lm_head.__dict__ and model.lm_head.forward == forward_before
    torch.testing.assert_close(loss, ref(input_ids=ids, labels=labels).loss)


@pytest.mark.parametrize("place", ["cpu", "disk"])
def test_head_offloaded_by_accelerate(tmp_path, place):
    """A device_map that offloads lm_head leaves a meta weight outside the head's call; its hook loads
    the weight around the fused loss and the mixture, as around an ordinary head call.  With the head
    in "cpu" the execution device is also the CPU here; the hook's weights map is what is exercised."""
    from transformers import AutoModelForCausalLM

    make_model("llama").save_pretrained(tmp_path / "ckpt")
    if place == "cpu":  # an explicit CPU offload: accelerate keeps the weights in a map, meta on the module
        from accelerate import cpu_offload

        model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
        cpu_offload(model.lm_head, execution_device=torch.device("cpu"))
    else:
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", device_map={"model": "cpu", "lm_head": "disk"},
                                                     offload_folder=str(tmp_path / "offload"))
    assert model.lm_head.weight.is_meta
    ids, labels = batch()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    with torch.no_grad():
        expected = plain(input_ids=ids, labels=labels).loss
        hf_mhce.apply_patch(model, loss="ce")
        torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, expected)
        hf_mhce.apply_patch(model, loss="mhce", num_heads=2, override_saved=True)
        hf_mhce.apply_patch(plain, loss="mhce", num_heads=2)
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)
        torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, plain(input_ids=ids, labels=labels).loss)
    assert model.lm_head.weight.is_meta  # offloaded again after each call


def test_meta_head_weight_is_an_error():
    model = hf_mhce.apply_patch(make_model("llama"), loss="ce")
    model.lm_head.weight = torch.nn.Parameter(torch.empty(97, 32, device="meta"))
    ids, labels = batch()
    with pytest.raises(sharding.ShardedHeadError, match="meta device"):
        model(input_ids=ids, labels=labels)
