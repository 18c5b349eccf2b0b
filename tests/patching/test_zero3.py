"""The fused loss under DeepSpeed ZeRO-3 (two CPU processes, DeepSpeed's CPU accelerator over gloo):
every parameter partitioned, lm_head.weight an empty placeholder outside the head's call.  Loss and
every gradient (gathered from ZeRO's partitions) equal the single-process run, for CE, MHCE and PEFT
LoRA on attention and lm_head."""

from pathlib import Path

import pytest
import torch
from launch_helpers import LOSS_BACKENDS, child_env, run_worker_pair
from patching_models import assert_step_equal

import deepspeed  # noqa: E402,F401  (in the [test] extra: a missing install fails, never skips)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CASES = ["zero3_ce", "zero3_mhce", "zero3_lora_mhce", "zero3_tokens_mhce"]


@pytest.fixture(scope="module", params=list(LOSS_BACKENDS))
def runs(request, tmp_path_factory):
    env = child_env(str(HERE), str(HERE.parent), str(ROOT), DS_ACCELERATOR="cpu", **LOSS_BACKENDS[request.param])
    return run_worker_pair(HERE / "zero3_worker.py", tmp_path_factory.mktemp("zero3"), env)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_zero3_matches_single_process(runs, case):
    dist, single = runs
    assert dist[case]["placeholder_shape"] == [0], "ZeRO-3 did not partition the head: the test would prove nothing"
    assert_step_equal(dist[case], single[case], case)
    if "lora" in case:
        assert any("lm_head.lora_B" in n for n in dist[case]["grads"])
    if "tokens" in case:  # its ParameterDict of deltas was called as a module (TypeError) before
        assert any("trainable_tokens_delta" in n for n in dist[case]["grads"])


def test_a_head_partitioned_as_it_loads_is_patched():
    """accelerate's deepspeed_zero3.yaml (zero3_init_flag) has from_pretrained partition the weights as it
    loads: apply_patch then sees lm_head.weight as ZeRO-3's empty placeholder, whose shape gave an IndexError
    for the hidden size.  It is read from ds_shape, the full shape, as elsewhere."""
    import torch

    import hf_mhce
    from sharding_worker import build

    model = build("zero3_mhce")
    full = model.lm_head.weight.shape
    placeholder = torch.nn.Parameter(torch.empty(0))
    placeholder.ds_shape = full  # what deepspeed.zero.Init leaves on a partitioned parameter
    model.lm_head.weight = placeholder
    hf_mhce.apply_patch(model, loss="mhce", num_heads=2)
    with pytest.raises(ValueError, match=f"does not divide the hidden size {full[1]}"):
        hf_mhce.apply_patch(model, loss="mhce", num_heads=full[1] - 1, override_saved=True)


@pytest.mark.timeout(300)
def test_sharded_head_mixed_adapter_batch(tmp_path):
    """PEFT's mixed-adapter batch (adapter_names=...) with LoRA on a sharded head, the ranks holding
    different sets of adapters: every row group is computed in one call of the head, as unpatched.
    Was: one call per group, so under ZeRO-3 the rank with two groups gathered the head once more than
    its peer and both hung; and under FSDP2 (the LoRA head its own unit) PEFT's pre-hook handed the
    unit's call an adapter_names keyword, a TypeError.  Loss and logits equal the single-process run."""
    env = child_env(str(HERE), str(HERE.parent), str(ROOT), DS_ACCELERATOR="cpu")
    dist, single = run_worker_pair(HERE / "mixed_batch_worker.py", tmp_path, env, timeout=240)
    unpatched = single["unpatched_lora"]["loss"]
    assert abs(single["zero3_lora_mixed_ce"]["loss"] - unpatched) <= 1e-5 * unpatched
    for case, got in dist.items():
        ref = single[case]
        assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (case, got["loss"], ref["loss"])
        torch.testing.assert_close(torch.tensor(got["logits"]), torch.tensor(ref["logits"]), rtol=1e-5, atol=1e-5)
