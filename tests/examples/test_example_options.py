"""The examples' bad options are usage errors (exit status 2, a line naming the option) raised before
any work: no tokenizer trained, no model pretrained, nothing written.  Each of these was a traceback,
a division by zero, or a silent run of the wrong thing."""

import re
import sys

import pytest
from test_examples import load


def _usage_error(capsys, message: str, call, *args) -> None:
    with pytest.raises(SystemExit) as exit_:
        call(*args)
    assert exit_.value.code == 2
    assert re.search(r"error: .*" + re.escape(message), capsys.readouterr().err)


@pytest.mark.parametrize("script,argv,message", [
    # options passed through to every hf-mhce train run: checked before the tokenizer is trained
    # (they failed as RuntimeError "run ... failed" after it, or in the first run's log)
    ("rbe_scaling", ["--foo", "3"], "hf-mhce train refuses its options: unrecognized arguments: --foo 3"),
    ("rbe_scaling", ["--block_size", "0"], "refuses its options: --block_size 0: a block needs at least 2 tokens"),
    ("mhce_vs_ce", ["--max_steps", "abc"], "refuses its options: argument --max_steps/--max-steps: invalid int value"),
    ("rbe_scaling", ["--sizes", "25x1", "32x1", "48x1", "--head_dim", "32"], "rotary embedding needs an even"),
    # the sweeps' own options
    ("rbe_scaling", ["--sizes", "abc", "1x1", "2x2"], "--sizes ['abc']: each size is DxL with positive integers"),
    ("rbe_scaling", ["--sizes", "16x1", "16X1", "32x1"], "give each size once"),
    ("rbe_scaling", ["--head_dim", "0"], "--head_dim 0 must be at least 1"),
    ("rbe_scaling", ["--head_dim", "-8"], "--head_dim -8 must be at least 1"),
    ("rbe_scaling", ["--seed", "-1"], "--seed -1 must be at least 0"),
    ("rbe_scaling", ["--sizes", "16x1", "24x1", "50x1", "--head_dim", "16"], "--sizes 50x1: hidden size 50 of 50x1 is not"),
    ("mhce_vs_ce", ["--workers", "0"], "--workers 0 must be at least 1"),
    ("mhce_vs_ce", ["--steps", "0"], "--steps 0 must be at least 1"),
    ("mhce_vs_ce", ["--seeds", "0", "0"], "give distinct seeds"),
    ("mhce_vs_ce", ["--heads", "1", "4", "4"], "--heads [1, 4, 4]: give each H once"),
    ("mhce_vs_ce", ["--hidden_size", "abc"], "--hidden_size (passed to every run) must be an integer"),
    ("mhce_vs_ce", ["--replot"], "results.json does not exist (give that run's --out)"),
])
def test_sweep_options_are_refused_before_the_tokenizer_is_trained(script, argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    _usage_error(capsys, message, load(script).main, ["--quick", "--workers", "1", "--out", str(out), *argv]
                 if "--workers" not in argv else ["--quick", "--out", str(out), *argv])
    assert not (out / "tokenizer").exists() and not (out / "runs").exists()


@pytest.mark.parametrize("argv,message", [
    (["--block_size", "0"], "--block_size 0: a block needs at least 2 tokens"),
    (["--bogus", "3"], "unrecognized arguments: --bogus 3"),
    (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0 must be at least 1"),
    (["--max_steps", "0"], "--max_steps 0 with --num_train_epochs 3.0 trains nothing"),  # saved an untrained model
    (["--pretrain_steps", "0"], "--pretrain_steps 0 must be at least 1"),
    (["--lora_dropout", "1"], "--lora_dropout 1.0 must be in [0, 1)"),
    (["--model", "no/such/checkpoint"], "--model no/such/checkpoint: no such directory"),
    (["--max_steps", "abc"], "argument --max_steps/--max-steps: invalid int value: 'abc'"),
])
def test_finetune_options_are_refused_before_anything_is_trained(argv, message, tmp_path, capsys, monkeypatch):
    finetune = load("finetune")
    monkeypatch.setattr(finetune, "pretrain", lambda *_: pytest.fail("pretrained before the options were checked"))
    _usage_error(capsys, message, finetune.cli, ["--quick", "--out", str(tmp_path / "out"), *argv])
    assert not (tmp_path / "out").exists()


def test_finetune_reports_a_refusal_of_its_pretraining_run_as_a_usage_error(tmp_path, capsys):
    """The pretraining run (hf-mhce train) refuses its model options before reading data; finetune.py
    says so in one line (it was a traceback)."""
    _usage_error(capsys, "--hidden_size 20 / --num_attention_heads 4 = 5: the Llama's rotary embedding needs an even",
                 load("finetune").cli, ["--quick", "--out", str(tmp_path / "out"), "--hidden_size", "20"])


def test_finetune_quick_false_and_the_output_dir_of_an_options_file(tmp_path, capsys):
    finetune = load("finetune")
    example, model_args, *_, training_args = finetune.parse(["--quick", "False", "--out", str(tmp_path)])
    assert not example.quick and model_args.hidden_size != 32  # "--quick False" applied the reduced sizes
    assert training_args.output_dir == str(tmp_path / "model")
    options = tmp_path / "options.yaml"
    options.write_text(f"out: {tmp_path}\noutput_dir: {tmp_path / 'mine'}\n")
    assert finetune.parse([str(options)])[-1].output_dir == str(tmp_path / "mine")  # was replaced by <out>/model
    options.write_text("quick: true\n")
    _usage_error(capsys, "--quick is a command-line option", finetune.parse, [str(options)])


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "--steps 0 must be at least 1"),  # was a ZeroDivisionError after training
    (["--batch", "0"], "--batch 0 must be at least 1"),
    (["--hidden", "0"], "--hidden 0 must be at least 1"),  # was silently 4 * dim
    (["--corpus-tokens", "1"], "--corpus-tokens 1 must be at least 2"),
    (["--lr", "nan"], "--lr nan and --weight-decay 0.0 must be >= 0"),
    (["--init-std", "0"], "--init-std 0.0 > 0"),
    (["--seeds", "0", "0"], "give each once"),
    (["--dim", "64", "--heads", "1", "3"], "--dim 64 is not divisible by heads [3]"),
])
def test_toy_language_options(argv, message, tmp_path, capsys):
    _usage_error(capsys, message, load("toy_language").parse_args, ["--quick", "--out", str(tmp_path), *argv])


@pytest.mark.parametrize("argv,message", [
    (["--heads", "3"], "--heads 3 does not divide --hidden 128"),  # was a traceback from the library
    (["--tokens", "0"], "--tokens 0 must be at least 1"),
    (["--vocab", "-1"], "--vocab -1 must be at least 1"),
])
def test_fused_ops_options(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["fused_ops.py", *argv])
    _usage_error(capsys, message, load("fused_ops").main)


def test_fused_ops_odd_sizes_run(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["fused_ops.py", "--vocab", "7", "--tokens", "1", "--hidden", "3", "--heads", "3"])
    load("fused_ops").main()
    out = capsys.readouterr().out
    assert "CE    fused" in out and "(H=3)" in out and "shape (1, 7)" in out


@pytest.mark.parametrize("script", ["toy_language", "mhce_vs_ce", "rbe_scaling"])
def test_examples_whose_result_is_a_figure_need_matplotlib_before_any_work(script, tmp_path, capsys, monkeypatch):
    """Without the plot extra, hf-mhce train's runs go without their plots; the sweeps' and the toy experiment's own
    figure then failed after all the training (toy_language: ModuleNotFoundError)."""
    from hf_mhce.rbe import plots

    monkeypatch.setattr(plots, "available", lambda: False)
    _usage_error(capsys, "need matplotlib: pip install 'hf-mhce[plot]'", load(script).parse_args,
                 ["--quick", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_finetune_quick_sizes_only_the_model_it_pretrains(tmp_path, capsys):
    """--quick's reduced sizes were given with a --model too, which does not use them (a note on stderr)."""
    finetune = load("finetune")
    _, model_args, *_ = finetune.parse(["--quick", "--model", "some/model", "--out", str(tmp_path)])
    assert model_args.hidden_size != 32 and "not used" not in capsys.readouterr().err
    assert finetune.parse(["--quick", "--out", str(tmp_path)])[1].hidden_size == 32
    finetune.parse(["--quick", "--tokenizer", "my/tok", "--out", str(tmp_path)])  # the pretraining uses the sizes
    assert "not used" not in capsys.readouterr().err
    finetune.parse(["--quick", "--model", "some/model", "--hidden_size", "64", "--out", str(tmp_path)])
    assert capsys.readouterr().err.count("--hidden_size not used") == 1  # what the user wrote, said once
