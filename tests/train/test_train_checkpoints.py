"""hf-mhce train on checkpoints other than its own default (audit pass): a GPT-2 checkpoint reports its
cross-entropy as eval_loss and takes LoRA with PEFT's default modules, an adapter given as --model trains
on, a checkpoint to resume must match the loss, saved loss options are kept, options files are typed as
the command line types them, and 0 blocks means all."""

import json
import math
import os

import pytest
from checkpoints import gpt2_checkpoint
from test_train_job import REDUCED

import hf_mhce
from hf_mhce.train import parse
from hf_mhce.train.arguments import check_arguments

pytestmark = pytest.mark.usefixtures("single_thread")
SHORT = ["--max_steps", "2", "--eval_steps", "2", "--logging_steps", "1", "--no_rbe_plots", "--sample_tokens", "0"]


def _run(out, *extra):
    return hf_mhce.train.main(REDUCED + ["--output_dir", str(out), *SHORT, *extra])


def _no_data(monkeypatch):
    from hf_mhce.train import job

    monkeypatch.setattr(job, "build_datasets", lambda *_: pytest.fail("data read before the options were checked"))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A small random GPT-2 (no loss_type, no BOS added) with a BPE tokenizer, and a text file."""
    root = tmp_path_factory.mktemp("gpt2")
    text = root / "corpus.txt"
    lines = [f"row {i}: a lazy dog sleeps while the quick fox {i % 11} runs" for i in range(300)]
    text.write_text("\n".join(lines))
    return gpt2_checkpoint(root / "ckpt", lines), str(text)


def test_gpt2_eval_loss_is_its_cross_entropy_and_lora_finds_its_modules(gpt2, tmp_path, monkeypatch):
    """GPT-2 has no loss_type, so the Trainer counted position 0 of every block as a target: eval_loss and
    the training loss were (T - 1) / T of the cross-entropy. The default --lora_target_modules
    (q_proj,v_proj) does not exist in GPT-2: PEFT's per-architecture default (c_attn) is used now.
    A base given by a relative path was recorded so in the adapter, which then loaded from that folder only."""
    ckpt, text = gpt2
    monkeypatch.chdir(os.path.dirname(os.path.abspath(ckpt)))
    for out, model, extra in (("full", ckpt, []), ("lora", os.path.basename(ckpt), ["--lora_r", "4"])):
        final = _run(tmp_path / out, "--model", model, "--dataset", text, "--loss", "ce", *extra)["final_eval"]
        assert math.isclose(final["eval_held_out_loss"], final["eval_held_out_rbe_cross_entropy"], rel_tol=1e-5), out
    adapter = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert adapter["target_modules"] == ["c_attn"]
    assert adapter["base_model_name_or_path"] == os.path.abspath(ckpt)
    with pytest.raises(ValueError, match="--lora_target_modules 'no_such_proj': .*no_such_proj"):
        _run(tmp_path / "x", "--model", ckpt, "--dataset", text, "--lora_r", "4", "--lora_target_modules", "no_such_proj")


def test_an_adapter_as_model_trains_on_and_refuses_a_second_adapter(gpt2, tmp_path, monkeypatch):
    """PEFT loads an adapter frozen: training failed in backward ('does not require grad'); with --lora_r
    the refusal came after the data was read and said it was not a PeftModel."""
    import torch
    from safetensors.torch import load_file

    ckpt, text = gpt2
    _run(tmp_path / "first", "--model", ckpt, "--dataset", text, "--loss", "ce", "--lora_r", "4")
    before = load_file(tmp_path / "first" / "adapter_model.safetensors")
    _run(tmp_path / "again", "--model", str(tmp_path / "first"), "--dataset", text)
    after = load_file(tmp_path / "again" / "adapter_model.safetensors")
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    _no_data(monkeypatch)
    with pytest.raises(ValueError, match="is a LoRA adapter: leave out --lora_r"):
        _run(tmp_path / "x", "--model", str(tmp_path / "first"), "--dataset", text, "--lora_r", "4")


def test_resume_needs_the_checkpoints_loss_and_saved_options_are_kept(tmp_path, monkeypatch):
    """Resuming a 2-head checkpoint without --num_heads 2 trained its weights on as a 4-head mixture and
    saved 4, silently; --model of a checkpoint trained with label smoothing / z-loss reset both to 0."""
    _run(tmp_path / "a", "--num_heads", "2", "--label_smoothing", "0.1", "--z_loss", "0.001",
         "--save_strategy", "steps", "--save_steps", "1")
    kept = _run(tmp_path / "b", "--model", str(tmp_path / "a"))
    saved = json.loads((tmp_path / "b" / "config.json").read_text())["hf_mhce"]
    assert (kept["num_heads"], saved["label_smoothing"], saved["z_loss"]) == (2, 0.1, 0.001)
    _run(tmp_path / "c", "--model", str(tmp_path / "a"), "--z_loss", "0")  # given: replaces the saved value
    assert json.loads((tmp_path / "c" / "config.json").read_text())["hf_mhce"]["z_loss"] == 0
    _no_data(monkeypatch)
    with pytest.raises(ValueError, match="was trained with --loss mhce --num_heads 2, this run patches --loss mhce "
                                         "--num_heads 4"):
        _run(tmp_path / "a", "--resume_from_checkpoint", str(tmp_path / "a" / "checkpoint-1"))


def test_options_files_are_typed_as_the_command_line(tmp_path, capsys):
    """YAML reads 1e-4 as a string (AdamW then failed deep in torch), "3" was a string max_steps, and
    "false" a true --rbe_plots."""
    (tmp_path / "o.yaml").write_text("learning_rate: 1e-4\nmax_steps: '3'\nrbe_plots: 'false'\nmax_eval_blocks: 0\n")
    model_args, data_args, loss_args, lora_args, train_args = parse([str(tmp_path / "o.yaml")])
    assert (train_args.learning_rate, train_args.max_steps, loss_args.rbe_plots) == (1e-4, 3, False)
    check_arguments(model_args, data_args, loss_args, lora_args)
    assert data_args.max_eval_blocks is None  # 0: all blocks ("None" cannot be written on a command line)
    (tmp_path / "bad.json").write_text(json.dumps({"max_steps": "three"}))
    with pytest.raises(SystemExit) as info:
        parse([str(tmp_path / "bad.json")])
    assert info.value.code == 2 and "max_steps: 'three'" in capsys.readouterr().err
