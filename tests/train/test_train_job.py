"""hf-mhce train: the main job end to end at a reduced size (same code path, smaller options)."""

import json
import math
import os
import re
import subprocess
import sys

import pytest

import hf_mhce
from hf_mhce.train import parse

# A few steps of the embedded default: smaller model, tokenizer and blocks; everything else default.
REDUCED = ["--vocab_size", "300", "--hidden_size", "32", "--num_hidden_layers", "1", "--intermediate_size", "64",
           "--block_size", "32", "--max_train_blocks", "64", "--max_eval_blocks", "8", "--max_steps", "6",
           "--eval_steps", "3", "--logging_steps", "3", "--per_device_train_batch_size", "4",
           "--per_device_eval_batch_size", "4", "--sample_tokens", "5"]


pytestmark = pytest.mark.usefixtures("single_thread")


def test_parse_defaults_and_config_file(tmp_path):
    model_args, data_args, loss_args, lora_args, train_args = parse([])
    assert (loss_args.loss, loss_args.num_heads) == (None, None)  # the checkpoint's, else FRESH_MODEL_LOSS
    assert data_args.dataset is None and model_args.model is None and train_args.eval_strategy == "steps"
    cfg = tmp_path / "job.json"
    cfg.write_text(json.dumps({"loss": "ce", "max_steps": 7, "output_dir": str(tmp_path / "o")}))
    _, _, loss_args, _, train_args = parse([str(cfg)])
    assert loss_args.loss == "ce" and train_args.max_steps == 7
    yaml_cfg = tmp_path / "job.yaml"
    yaml_cfg.write_text("loss: mhce\nnum_heads: 2\nlora_r: 4\n")
    _, _, loss_args, lora_args, _ = parse([str(yaml_cfg)])
    assert loss_args.num_heads == 2 and lora_args.lora_r == 4


def test_help_lists_every_option():
    out = subprocess.run([sys.executable, "-m", "hf_mhce.cli", "train", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for option in ("--num_heads", "--lora_r", "--dataset", "--model", "--trust_remote_code", "--learning_rate",
                   "--gradient_accumulation_steps"):
        assert option in out


def test_embedded_mhce_run_writes_everything(tmp_path, capsys):
    out_dir = tmp_path / "run"
    summary = hf_mhce.train.main(REDUCED + ["--output_dir", str(out_dir)])
    printed = capsys.readouterr().out
    for name in ("docs", "code"):
        p = f"eval_{name}"
        final = summary["final_eval"]
        ce = final[f"{p}_rbe_cross_entropy"]
        parts = final[f"{p}_rbe_error_entropy"] + final[f"{p}_rbe_self_alignment"] - final[f"{p}_rbe_confidence"]
        assert math.isclose(parts, ce, rel_tol=1e-9)
        assert name in printed
    assert "Err-Ent" in printed and "sample:" in printed
    for f in ("config.json", "tokenizer.json", "metrics.json", "README.md", "model.safetensors"):
        assert (out_dir / f).exists(), f
    assert sorted(os.listdir(out_dir / "rbe"))  # plots
    card = (out_dir / "README.md").read_text()
    assert "mixture of 4 softmaxes" in card and "hf_mhce.from_pretrained" in card
    assert "### RBE evaluation" in card and "| eval_docs |" in card and "rbe/eval_docs_components.png" in card
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert metrics["loss"] == "mhce"
    # 6 steps end on an evaluation: the final one is that evaluation, not a second pass with repeated rows
    rows = [(row["step"], row["prefix"]) for row in metrics["rbe_history"]]
    assert rows == [(3, "eval_docs"), (3, "eval_code"), (6, "eval_docs"), (6, "eval_code")], rows
    assert summary["final_eval"]["eval_code_rbe_cross_entropy"] == metrics["rbe_history"][-1]["cross_entropy"]
    assert summary["final_eval"]["eval_docs_loss"] > 0 and "step" not in summary["final_eval"]
    # the saved model reloads as MHCE and reproduces the logits
    reloaded = hf_mhce.from_pretrained(str(out_dir))
    assert reloaded.config.hf_mhce["loss"] == "mhce" and reloaded.config.hf_mhce["num_heads"] == 4


def _tiny_checkpoint(path, texts):
    """A small random Llama and a BPE tokenizer saved where --model can read them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_mhce.train.corpus import train_tokenizer

    tokenizer = train_tokenizer(texts, 300)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=4)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_text_file_dataset_ce_with_lora(tmp_path, monkeypatch):
    from transformers import GenerationMixin

    def broken_generate(*args, **kwargs):  # e.g. a remote-code model whose cache transformers cannot build
        raise RuntimeError("no cache for this model")

    monkeypatch.setattr(GenerationMixin, "generate", broken_generate)
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"line {i}: the quick brown fox jumps over the lazy dog {i % 7}" for i in range(400)))
    base = _tiny_checkpoint(tmp_path / "base", text.read_text().splitlines())
    out_dir = tmp_path / "lora"
    with pytest.warns(UserWarning, match="generating the sample failed .RuntimeError: no cache for this model"):
        summary = hf_mhce.train.main(REDUCED + ["--model", base, "--output_dir", str(out_dir), "--dataset", str(text),
                                                "--loss", "ce", "--lora_r", "4", "--lora_target_modules",
                                                "q_proj,v_proj,lm_head", "--label_smoothing_factor", "0.05"])
    # the sample is the last step: a failure there keeps the trained model and its metrics
    assert summary["sample"] is None and "no cache" in summary["sample_error"]
    assert json.loads((out_dir / "metrics.json").read_text())["sample_error"] == summary["sample_error"]
    assert "eval_held_out_rbe_error_entropy" in summary["final_eval"]
    assert summary["loss"] == "ce"
    saved = json.loads((out_dir / "hf_mhce.json").read_text())  # beside the adapter
    assert saved["label_smoothing"] == 0.05  # the Trainer's smoothing went to the fused loss
    assert hf_mhce.patching.is_patched(hf_mhce.from_pretrained(out_dir))  # base found through the adapter


def test_options_are_checked_before_any_data_is_read(tmp_path, monkeypatch):
    from hf_mhce.train import job

    monkeypatch.setattr(job, "build_datasets", lambda *_: pytest.fail("data read before the options were checked"))
    cases = [(["--lora_r", "4"], "--lora_r adapts a pretrained model: give its checkpoint with --model"),
             (["--loss", "ce", "--num_heads", "4"], "num_heads=4 only applies to loss='mhce'"),
             (["--num_heads", "3"], "--num_heads 3 does not divide --hidden_size 32"),
             (["--z_loss", "-1"], "z_loss must be a finite number >= 0")]
    for extra, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            hf_mhce.train.main(REDUCED + ["--output_dir", str(tmp_path / "o"), *extra])
    with pytest.raises(SystemExit):  # argparse's "invalid choice", at once
        parse(["--loss", "focal"])


def test_a_checkpoint_keeps_its_loss_unless_asked(tmp_path):
    """--model without --loss / --num_heads continues with the checkpoint's loss; a different one needs
    --override_saved, and the error says so in the CLI's words."""
    first = hf_mhce.train.main(REDUCED + ["--output_dir", str(tmp_path / "a"), "--num_heads", "2", "--max_steps", "2",
                                          "--eval_steps", "2"])
    assert (first["loss"], first["num_heads"]) == ("mhce", 2)
    again = hf_mhce.train.main(REDUCED + ["--model", str(tmp_path / "a"), "--output_dir", str(tmp_path / "b"),
                                          "--max_steps", "2", "--eval_steps", "3"])
    assert (again["loss"], again["num_heads"]) == ("mhce", 2)
    # no evaluation at the last step: the final one is a new pass
    assert [(row["step"], row["prefix"]) for row in again["rbe_history"]] == [(2, "eval_docs"), (2, "eval_code")]
    assert again["final_eval"]["eval_docs_rbe_cross_entropy"] == again["rbe_history"][0]["cross_entropy"]
    with pytest.raises(ValueError, match="--override_saved, or leave out --loss / --num_heads"):
        hf_mhce.train.main(REDUCED + ["--model", str(tmp_path / "a"), "--output_dir", str(tmp_path / "c"),
                                      "--num_heads", "4"])


def test_label_smoothing_factor_goes_to_the_fused_loss():
    from hf_mhce.train.arguments import fuse_label_smoothing

    _, _, loss_args, _, train_args = parse(["--label_smoothing_factor", "0.1"])
    fuse_label_smoothing(loss_args, train_args)
    assert loss_args.label_smoothing == 0.1 and train_args.label_smoothing_factor == 0.0
    _, _, loss_args, _, train_args = parse(["--label_smoothing_factor", "0.1", "--label_smoothing", "0.2"])
    with pytest.raises(ValueError, match="label_smoothing_factor 0.1 and --label_smoothing 0.2"):
        fuse_label_smoothing(loss_args, train_args)


def test_without_matplotlib_the_job_runs_without_plots_unless_asked_for_them(tmp_path, monkeypatch, capsys):
    """Without matplotlib (a plain install, no [plot] extra) the default job runs and says it writes no plots; an
    explicit --rbe_plots is refused at once (was: an ImportError at the first evaluation, after the training steps)."""
    from hf_mhce.train import job

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with monkeypatch.context() as m:
        m.setattr(job, "build_datasets", lambda *_: pytest.fail("data read before the options were checked"))
        with pytest.raises(ValueError, match=re.escape("RBE plots need matplotlib: pip install 'hf-mhce[plot]', or "
                                                       "pass --no_rbe_plots")):
            hf_mhce.train.main(REDUCED + ["--output_dir", str(tmp_path / "o"), "--rbe_plots"])
    with pytest.raises(ImportError, match=r"or RBECallback\(plot=False\)"):
        hf_mhce.RBECallback(plot=True)
    summary = hf_mhce.train.main(REDUCED + ["--output_dir", str(tmp_path / "p"), "--max_steps", "2", "--eval_steps", "2"])
    assert summary["final_eval"] and not (tmp_path / "p" / "rbe").exists()
    assert "no RBE plots: matplotlib is not installed" in capsys.readouterr().err
