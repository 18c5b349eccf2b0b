"""hf-mhce train refuses what it cannot do before any data is read, and does what it accepts (CLI review):
each case was a traceback after the data was read (or after training), or a silent wrong result."""

import json
import os
import re

import pytest
from test_train_job import REDUCED

import hf_mhce
from hf_mhce.train import parse

pytestmark = pytest.mark.usefixtures("single_thread")
SHORT = ["--max_steps", "2", "--eval_steps", "2", "--logging_steps", "1", "--no_rbe_plots", "--sample_tokens", "0"]


def _run(out, *extra):
    return hf_mhce.train.main(REDUCED + ["--output_dir", str(out), *SHORT, *extra])


def _refused_before_data(monkeypatch, message, *argv):
    from hf_mhce.train import job

    monkeypatch.setattr(job, "build_datasets", lambda *_: pytest.fail("data read before the options were checked"))
    with pytest.raises(ValueError, match=re.escape(message)):
        hf_mhce.train.main(REDUCED + list(argv))


def test_an_output_dir_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    """A file as --output_dir (FileExistsError / NotADirectoryError) and an empty one came from the Trainer."""
    (tmp_path / "afile").write_text("x")
    for given in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        _refused_before_data(monkeypatch, f"--output_dir {given}: {tmp_path / 'afile'} is a file, not a directory",
                             "--output_dir", str(given))
    _refused_before_data(monkeypatch, "--output_dir is empty", "--output_dir", "")
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "ro").mkdir(mode=0o500)
        _refused_before_data(monkeypatch, "is not writable", "--output_dir", str(tmp_path / "ro" / "out"))


def test_a_reporting_integration_that_is_not_installed_is_named(tmp_path, monkeypatch):
    from transformers.integrations import get_available_reporting_integrations

    assert "wandb" not in get_available_reporting_integrations()
    _refused_before_data(monkeypatch, "--report_to wandb: not installed here", "--output_dir", str(tmp_path / "o"),
                         "--report_to", "wandb")
    _refused_before_data(monkeypatch, "--report_to tensorbord: no such integration (one of", "--output_dir",
                         str(tmp_path / "o"), "--report_to", "tensorbord")


def test_resuming_from_a_folder_that_is_no_checkpoint_names_the_checkpoint_in_it(tmp_path, monkeypatch):
    """A finished run's output_dir as --resume_from_checkpoint: FileNotFoundError (trainer_state.json) mid-job."""
    run = tmp_path / "run"
    for step in (2, 10):
        (run / f"checkpoint-{step}").mkdir(parents=True)
    _refused_before_data(monkeypatch, f"--resume_from_checkpoint {run} is no checkpoint (no trainer_state.json): "
                         f"give a checkpoint-N folder of an earlier run with --save_strategy steps or epoch: the latest "
                         f"one in it is {run / 'checkpoint-10'}", "--output_dir", str(tmp_path / "o"),
                         "--resume_from_checkpoint", str(run))


def test_label_smoothing_options_are_checked_together_before_any_data(tmp_path, monkeypatch):
    """An explicit --label_smoothing 0 was taken for "not given" (the factor's 0.1 was trained and saved), and a
    factor out of range was refused only after the data was read."""
    out = ["--output_dir", str(tmp_path / "o")]
    _refused_before_data(monkeypatch, "--label_smoothing_factor 0.1 and --label_smoothing 0.0 disagree", *out,
                         "--label_smoothing", "0", "--label_smoothing_factor", "0.1")
    _refused_before_data(monkeypatch, "--label_smoothing_factor 1.5 must be in [0, 1]", *out,
                         "--label_smoothing_factor", "1.5")
    from hf_mhce.train import check_options

    with pytest.raises(ValueError, match=re.escape("--label_smoothing_factor 1.5 must be in [0, 1]")):
        check_options([*out, "--label_smoothing_factor", "1.5"])


@pytest.mark.parametrize("body,message", [
    ("block_size: 16.5", "block_size: 16.5 is not an integer"),
    ("max_steps: .inf", "max_steps: inf is not an integer"),  # was an OverflowError traceback
    ("block_size: null", "block_size is empty (null): give a value, or leave it out for its default"),
    ("max_steps: true", "max_steps: True is not an integer"),
    ("learning_rate: [1]", "learning_rate: [1] is not a number"),
    ("bf16: 3", "bf16: 3 is not true or false"),
    ("loss: focal", "loss: 'focal' is not one of ce, mhce"),
    ("dataset: {a: 1}", "dataset: {'a': 1} is not a string"),
])
def test_options_file_values_of_the_wrong_type_are_usage_errors(body, message, tmp_path, capsys):
    (tmp_path / "o.yaml").write_text(body + "\n")
    with pytest.raises(SystemExit) as info:
        parse([str(tmp_path / "o.yaml")])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_options_file_values_are_read_as_the_command_line_reads_them(tmp_path):
    (tmp_path / "o.yaml").write_text("lora_target_modules: [q_proj, v_proj]\nblock_size: 16.0\nsample_prompt: 123\n"
                                     "num_heads: null\nreport_to: [none]\n")
    model_args, data_args, loss_args, lora_args, train_args = parse([str(tmp_path / "o.yaml")])
    assert lora_args.lora_target_modules == "q_proj,v_proj"
    assert (data_args.block_size, loss_args.sample_prompt, loss_args.num_heads) == (16, "123", None)
    assert train_args.report_to == []


def test_best_model_at_end_compares_the_first_eval_sets_loss(tmp_path):
    """TrainingArguments' default metric "loss" is eval_loss, which a dict of eval sets never logs (KeyError at
    the first save, after training, nothing saved)."""
    summary = _run(tmp_path / "o", "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2",
                   "--load_best_model_at_end")
    state = json.loads((tmp_path / "o" / "checkpoint-4" / "trainer_state.json").read_text())
    losses = {e["step"]: e["eval_docs_loss"] for e in state["log_history"] if "eval_docs_loss" in e}
    best = min(losses, key=losses.get)
    assert state["best_model_checkpoint"].endswith(f"checkpoint-{best}")
    assert state["best_metric"] == pytest.approx(losses[best])
    assert summary["final_eval"]["eval_docs_loss"] == pytest.approx(losses[best], rel=1e-5)  # the best one, loaded


def test_resuming_without_model_or_tokenizer_keeps_the_checkpoints_tokenizer(tmp_path):
    """The BPE was trained again on the data, which a different --eval_fraction changes: token ids then meant other
    tokens than the ones the resumed weights were trained on (saved together, silently)."""
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in list(topics.values())[:60]))
    _run(tmp_path / "o", "--dataset", str(data), "--save_strategy", "steps", "--save_steps", "1")
    checkpoint = tmp_path / "o" / "checkpoint-1"
    _run(tmp_path / "o", "--dataset", str(data), "--resume_from_checkpoint", str(checkpoint), "--eval_fraction", "0.3")
    assert (AutoTokenizer.from_pretrained(tmp_path / "o").get_vocab()
            == AutoTokenizer.from_pretrained(checkpoint).get_vocab())


def test_options_the_run_does_not_use_are_named(tmp_path, capsys):
    """The default Llama's sizes beside --model, and --vocab_size where a tokenizer is loaded, were ignored
    silently; they are named on stderr (a sweep's shared options may carry them, so not refused)."""
    parse(["--model", "some/model", "--hidden_size", "64", "--intermediate_size", "96", "--vocab_size", "500"])
    err = capsys.readouterr().err
    assert "--hidden_size, --intermediate_size not used: they size the default Llama, and --model some/model" in err
    assert "--vocab_size not used: it sizes the BPE trained when no tokenizer is given, and this run loads the " \
           "tokenizer of --model some/model" in err
    parse(["--tokenizer", "my/tok", "--vocab_size", "500"])
    assert "this run loads --tokenizer my/tok" in capsys.readouterr().err
    parse(["--model", "some/model", "--hidden_size", "64"])
    assert "--hidden_size not used: it sizes the default Llama" in capsys.readouterr().err
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "tokenizer.json").write_text("{}")
    parse(["--vocab_size", "500", "--resume_from_checkpoint", str(tmp_path / "checkpoint-2")])
    assert f"loads the tokenizer saved in {tmp_path / 'checkpoint-2'}" in capsys.readouterr().err
    options = tmp_path / "options.json"
    options.write_text(json.dumps({"model": "some/model", "num_hidden_layers": 3}))
    parse([str(options)])
    assert "--num_hidden_layers not used" in capsys.readouterr().err
    # used, or not given: nothing said
    parse(["--hidden_size", "64", "--vocab_size", "500", "--resume_from_checkpoint", str(tmp_path)])
    parse(["--model", "some/model", "--block_size", "32"])
    assert "not used" not in capsys.readouterr().err
