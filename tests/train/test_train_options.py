"""hf-mhce train driven as users drive it (user-testing pass): a plain checkpoint gets the documented
default loss, --resume_from_checkpoint and --num_train_epochs take effect, the card loads what was
saved, a used output directory is not mixed into, and bad values are named before any data is read."""

import json
import re
import sys
from pathlib import Path

import pytest
from test_train_job import REDUCED, _tiny_checkpoint

import hf_mhce
from hf_mhce.train import parse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "patching"))
from test_remote_code import REPLACED_FORWARD, remote_code_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
SHORT = ["--max_steps", "2", "--eval_steps", "2", "--logging_steps", "1"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A transformers checkpoint with no hf_mhce record, and a text file to train on."""
    root = tmp_path_factory.mktemp("plain")
    text = root / "corpus.txt"
    text.write_text("\n".join(f"line {i}: the quick brown fox jumps over the lazy dog {i % 7}" for i in range(300)))
    return _tiny_checkpoint(root / "ckpt", text.read_text().splitlines()), str(text)


def _run(out, *extra):
    return hf_mhce.train.main(REDUCED + ["--output_dir", str(out), *SHORT, *extra])


def test_a_plain_checkpoint_gets_the_documented_default_and_any_requested_loss(plain, tmp_path):
    """--help: "default: the loss saved in --model's checkpoint, else mhce" (with 4 heads); it trained CE,
    and --loss mhce was refused as a change of a 'saved' CE that from_pretrained had recorded itself."""
    ckpt, text = plain
    default = _run(tmp_path / "a", "--model", ckpt, "--dataset", text)
    assert (default["loss"], default["num_heads"]) == ("mhce", 4)
    asked = _run(tmp_path / "b", "--model", ckpt, "--dataset", text, "--loss", "mhce", "--num_heads", "2")
    assert (asked["loss"], asked["num_heads"]) == ("mhce", 2)
    card = (tmp_path / "b" / "README.md").read_text()  # loads what was saved here, not the base checkpoint
    assert f'hf_mhce.from_pretrained("{tmp_path / "b"}")' in card
    # a CE-recorded checkpoint switched to MHCE deliberately: 4 heads unless told otherwise
    ce = _run(tmp_path / "c", "--model", ckpt, "--dataset", text, "--loss", "ce")
    switched = _run(tmp_path / "d", "--model", str(tmp_path / "c"), "--dataset", text, "--loss", "mhce",
                    "--override_saved")
    assert ce["loss"] == "ce" and (switched["loss"], switched["num_heads"]) == ("mhce", 4)


def test_resume_and_epochs_take_effect(plain, tmp_path):
    ckpt, text = plain
    with pytest.raises(ValueError, match="checkpoint"):  # was accepted and ignored
        _run(tmp_path / "r", "--model", ckpt, "--dataset", text, "--resume_from_checkpoint", str(tmp_path / "none"))
    _run(tmp_path / "s", "--model", ckpt, "--dataset", text, "--save_strategy", "steps", "--save_steps", "1")
    resumed = _run(tmp_path / "s", "--model", ckpt, "--dataset", text, "--resume_from_checkpoint",
                   str(tmp_path / "s" / "checkpoint-1"))
    assert resumed["train"]["train_runtime"] >= 0
    state = json.loads((tmp_path / "s" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    *_, args = parse(["--num_train_epochs", "1"])  # the job's max_steps default would have overridden it
    assert args.max_steps == -1 and args.num_train_epochs == 1
    *_, args = parse(["--num_train_epochs", "1", "--max_steps", "9"])
    assert args.max_steps == 9
    *_, args = parse([])
    assert args.max_steps == 600


def test_abbreviated_options_are_refused_not_half_applied(capsys):
    """argparse took --num_train_epoch for --num_train_epochs, but parse() looked for the name as written:
    the run trained 600 steps instead of the epochs asked for, silently."""
    for argv in (["--num_train_epoch", "2"], ["--num_train_e=2"]):
        with pytest.raises(SystemExit):
            parse(argv)
        assert "unrecognized arguments: " + " ".join(argv) in capsys.readouterr().err
    for argv in (["--num-train-epochs", "2"], ["--num_train_epochs=2"]):  # written out in full, either spelling
        *_, args = parse(argv)
        assert (args.max_steps, args.num_train_epochs) == (-1, 2)


def test_a_tokenizer_without_eos_trains(tmp_path):
    """--tokenizer without an EOS token (a WordLevel one): its None id went between the texts and the
    data collator failed on it; the texts are joined as `hf-mhce rbe` joins them (no separator)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = "line the quick brown fox jumps over lazy dog".split()
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    assert tok.eos_token_id is None
    ckpt = tmp_path / "ckpt"
    tok.save_pretrained(ckpt)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=4)).save_pretrained(ckpt)
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join("line the quick brown fox jumps over the lazy dog" for _ in range(300)))
    summary = _run(tmp_path / "o", "--model", str(ckpt), "--dataset", str(text))
    assert summary["final_eval"]["eval_held_out_rbe_num_tokens"] > 0 and summary["sample"] is not None
    from hf_mhce.rbe.data import token_stream
    from hf_mhce.train.corpus import token_blocks

    texts = ["fox dog", "the fox"]
    assert token_stream(texts, tok) == [5, 9, 2, 5] and token_blocks(texts, tok, 2) == [[5, 9], [2, 5]]


def test_a_used_output_dir_is_not_mixed_into(plain, tmp_path):
    """A LoRA run, then a full run into the same directory: the old adapter, its hf_mhce.json and its
    PEFT card stayed, and from_pretrained of the directory loaded the old adapter."""
    ckpt, text = plain
    out = tmp_path / "o"
    _run(out, "--model", ckpt, "--dataset", text, "--lora_r", "2")
    assert (out / "adapter_config.json").exists()
    _run(out, "--model", ckpt, "--dataset", text)
    assert not (out / "adapter_config.json").exists() and not (out / "hf_mhce.json").exists()
    assert "library_name: peft" not in (out / "README.md").read_text()
    reloaded = hf_mhce.from_pretrained(out)  # the full model of the second run, not the old adapter
    assert hf_mhce.patching.is_patched(reloaded) and type(reloaded).__name__ == "LlamaForCausalLM"


@pytest.mark.parametrize("extra,message", [
    (["--num_heads", "0"], "num_heads must be a positive int, got 0"),
    (["--block_size", "1"], "--block_size 1: a block needs at least 2 tokens"),
    (["--eval_fraction", "1.5"], "--eval_fraction 1.5 must be in (0, 1)"),
    (["--max_eval_blocks", "-1"], "--max_eval_blocks -1 must be at least 0 (0: all blocks)"),
    (["--sample_tokens", "-1"], "--sample_tokens must be >= 0"),
    (["--sample_prompt", ""], "--sample_prompt not empty"),
    (["--model", "./no/such/dir"], "--model ./no/such/dir: no such directory"),
    (["--vocab_size", "10"], "--vocab_size 10 is less than 257, the smallest byte-level BPE"),
    (["--hidden_size", "0"], "--hidden_size 0 must be at least 1"),
    (["--num_attention_heads", "3"], "--num_attention_heads 3 does not divide --hidden_size 32"),
    (["--hidden_size", "20", "--num_attention_heads", "4"], "= 5: the Llama's rotary embedding needs an even"),
    (["--lora_r", "-1"], "--lora_r -1 must be >= 0"),
    (["--lora_dropout", "2"], "--lora_dropout 2.0 must be in [0, 1)"),
    (["--max_steps", "0"], "--max_steps 0 with --num_train_epochs 3.0 trains nothing"),
    (["--max_steps", "-1", "--num_train_epochs", "0"], "--max_steps -1 with --num_train_epochs 0.0 trains nothing"),
    (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0 must be at least 1"),
    (["--per_device_eval_batch_size", "0"], "--per_device_eval_batch_size 0 must be at least 1"),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps 0 must be at least 1"),
    (["--learning_rate", "-1"], "--learning_rate -1.0 must be a non-negative number"),
    (["--model", __file__], f"--model {__file__} is a file: give a checkpoint directory"),
])
def test_bad_values_are_named_before_any_data_is_read(extra, message, tmp_path, monkeypatch):
    from hf_mhce.train import job

    monkeypatch.setattr(job, "build_datasets", lambda *_: pytest.fail("data read before the options were checked"))
    with pytest.raises(ValueError, match=re.escape(message)):
        _run(tmp_path / "o", *extra)


@pytest.mark.parametrize("argv,message", [
    (["--max_steps", "abc"], "--max_steps/--max-steps: invalid int value: 'abc'"),
    (["--no_such_option", "1"], "unrecognized arguments: --no_such_option 1"),
    (["--block_size", "0"], "--block_size 0: a block needs at least 2 tokens"),
    (["--max_steps", "0"], "--max_steps 0 with --num_train_epochs 3.0 trains nothing"),
    (["--loss", "mhce", "--num_heads", "5"], "--num_heads 5 does not divide --hidden_size 128"),
])
def test_check_options_names_what_the_job_would_refuse_as_a_value_error(argv, message, tmp_path, capsys):
    """What the sweep examples call on every run's options: a ValueError, never argparse's exit."""
    from hf_mhce.train import check_options

    with pytest.raises(ValueError, match=re.escape(message)):
        check_options(["--output_dir", str(tmp_path / "o"), *argv])
    check_options(["--output_dir", str(tmp_path / "o"), "--loss", "mhce", "--num_heads", "4"])
    assert capsys.readouterr().err == ""


def test_checkpoint_facts_are_checked_before_any_data_is_read(plain, tmp_path, monkeypatch):
    from hf_mhce.train import job

    ckpt, _ = plain
    monkeypatch.setattr(job, "build_datasets", lambda *_: pytest.fail("data read before the options were checked"))
    with pytest.raises(ValueError, match=re.escape(f"--num_heads 3 does not divide the hidden size 32 of {ckpt}")):
        _run(tmp_path / "o", "--model", ckpt, "--num_heads", "3")


def test_a_refused_loss_change_is_named_before_any_data_is_read(tmp_path, monkeypatch):
    """--loss ce on an MHCE checkpoint: the explained SavedLossMismatchError came from build_model, after
    the data was read and tokenized (the README says inconsistent options fail before)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_mhce.train import corpus, job
    from hf_mhce.train.arguments import checkpoint_facts

    ckpt = tmp_path / "mhce"
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=4))
    hf_mhce.apply_patch(model, loss="mhce", num_heads=2).save_pretrained(ckpt)  # records mhce, 2 heads
    for name in ("build_datasets", "build_tokenizer", "build_model"):
        monkeypatch.setattr(job, name, lambda *_, **__: pytest.fail("data or model read before the options were checked"))
    monkeypatch.setattr(corpus, "embedded_texts", lambda *_: pytest.fail("corpus read"))
    for extra in (["--loss", "ce"], ["--num_heads", "4"]):
        with pytest.raises(hf_mhce.patching.SavedLossMismatchError,
                           match="--override_saved, or leave out --loss / --num_heads"):
            _run(tmp_path / "o", "--model", str(ckpt), *extra)
    # a plain PEFT adapter (no hf_mhce.json beside it) is loaded with its base's record: checked against it
    base = LlamaForCausalLM.from_pretrained(ckpt)  # transformers' own load: the adapter records ckpt as its base
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "a")
    assert not (tmp_path / "a" / "hf_mhce.json").exists()
    assert checkpoint_facts(str(tmp_path / "a"))[0] == hf_mhce.from_pretrained(ckpt).config.hf_mhce


def test_vocab_size_minimum_is_what_the_tokenizer_trainer_makes():
    from hf_mhce.train.arguments import check_arguments, min_vocab_size
    from hf_mhce.train.corpus import train_tokenizer

    assert len(train_tokenizer(["a small text"], 1)) == min_vocab_size() == 257  # 1 was raised to it silently
    assert check_arguments(*parse(["--vocab_size", "257", "--no_rbe_plots"])[:4]) == (None, None)


def test_help_shows_the_jobs_own_defaults(capsys, monkeypatch):
    """Options this job redefines had no help text, so --help printed no default for them (3e-3, cosine,
    batch 8, ...) while it printed TrainingArguments' --num_train_epochs 3.0, which max_steps overrides."""
    from hf_mhce.train.arguments import ALL_ARGUMENTS, TrainArguments

    monkeypatch.setenv("COLUMNS", "1000")  # one line per help text
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = capsys.readouterr().out
    helps = dict(re.findall(r"^  --(\w+)[^\n]*?(?:\n {20,}|  )(\S[^\n]*)$", out, re.M))
    fields = {name: f for cls in ALL_ARGUMENTS for name, f in cls.__dataclass_fields__.items()}
    own = [name for cls in ALL_ARGUMENTS[:-1] for name in cls.__dataclass_fields__]
    for name in own + list(TrainArguments.__annotations__):  # TrainingArguments' fields given new defaults
        assert f"(default: {fields[name].default})" in helps.get(name, ""), name
    for shown in ("0.003", "cosine", "600", "8", "50", "150", "no"):
        assert f"(default: {shown})" in out
    assert "applies only without --max_steps" in helps["num_train_epochs"]
    *_, args = parse(["--warmup_steps", "0.1", "--eval_steps", "0.5"])  # ratios, as TrainingArguments takes them
    assert (args.warmup_steps, args.eval_steps, args.learning_rate, args.max_steps) == (0.1, 0.5, 3e-3, 600)


def test_plots_by_default_only_where_matplotlib_is_installed(capsys, monkeypatch, tmp_path):
    """A plain `pip install hf-mhce` (no [plot] extra) ran `hf-mhce train` into a usage error: plots were on by
    default and refused without matplotlib.  Now the default follows matplotlib, an explicit --rbe_plots is still
    refused without it, and --no_rbe_plots has a help of its own (it repeated --rbe_plots' text)."""
    from hf_mhce.rbe import plots
    from hf_mhce.train.arguments import check_arguments

    monkeypatch.setattr(plots, "available", lambda: False)
    (tmp_path / "o.yaml").write_text("max_steps: 3\n")
    for argv in ([], [str(tmp_path / "o.yaml")]):
        assert parse(argv)[2].rbe_plots is False
        assert "no RBE plots: matplotlib is not installed (pip install 'hf-mhce[plot]')" in capsys.readouterr().err
    asked = parse(["--rbe_plots"])
    assert asked[2].rbe_plots is True and capsys.readouterr().err == ""
    with pytest.raises(ValueError, match=re.escape("RBE plots need matplotlib: pip install 'hf-mhce[plot]', or pass")):
        check_arguments(*asked[:4])
    assert parse(["--no_rbe_plots"])[2].rbe_plots is False and capsys.readouterr().err == ""
    monkeypatch.undo()
    assert parse([])[2].rbe_plots is True and capsys.readouterr().err == ""

    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = capsys.readouterr().out
    assert re.search(r"--no_rbe_plots, --no-rbe-plots\s+set --rbe_plots to false\n", out)
    assert re.search(r"--no_remove_unused_columns, --no-remove-unused-columns\s+set --remove_unused_columns to false\n",
                     out)


def test_tokenizer_and_split_problems_are_named(plain, tmp_path):
    from hf_mhce.rbe.data import DataError

    ckpt, text = plain
    bare = tmp_path / "bare"
    hf_mhce.from_pretrained(ckpt).save_pretrained(bare)  # no tokenizer files
    with pytest.raises(DataError, match="no tokenizer in .*: pass --tokenizer"):
        _run(tmp_path / "o", "--model", str(bare), "--dataset", text)
    big = tmp_path / "big_tok"
    from hf_mhce.train.corpus import train_tokenizer

    train_tokenizer([open(text).read()], 600).save_pretrained(big)
    with pytest.raises(ValueError, match=r"has \d+ tokens but .* embeds 300: it is not the model's tokenizer"):
        _run(tmp_path / "o", "--model", ckpt, "--tokenizer", str(big), "--dataset", text)
    with pytest.raises(DataError, match="leave out --train_split"):
        _run(tmp_path / "o", "--model", ckpt, "--dataset", text, "--train_split", "validation")
    with pytest.raises(DataError, match="leave out --eval_split"):  # named, so a typo is not skipped silently
        _run(tmp_path / "o", "--model", ckpt, "--dataset", text, "--eval_split", "validaton")
    summary = _run(tmp_path / "z", "--model", ckpt, "--dataset", text, "--sample_tokens", "0")
    assert summary["sample"] is None


def test_the_table_prints_the_cross_entropy_not_the_smoothed_objective():
    """With label smoothing eval_loss is the training objective; the table's CE and ppl are the NLL's,
    which its footnote decomposes (they used to disagree with the card)."""
    from hf_mhce.train.job import summary_table

    final = {"eval_docs_loss": 6.0301, "eval_docs_rbe_cross_entropy": 5.7046, "eval_docs_rbe_error_entropy": 5.5,
             "eval_docs_rbe_self_alignment": 0.3046, "eval_docs_rbe_confidence": 0.1, "eval_docs_rbe_top1": 0.1}
    table = summary_table({"loss": "ce", "num_heads": 1, "parameters": 1e6, "train_tokens": 10, "wall_seconds": 1,
                           "final_eval": final, "sample": None}, ["docs"])
    assert "5.7046" in table and "300.25" in table and "6.0301" not in table and "sample" not in table


@pytest.mark.filterwarnings(REPLACED_FORWARD)
def test_a_remote_code_checkpoint_trains_with_the_flag(plain, tmp_path, monkeypatch):
    """--model with custom code (auto_map): there was no option for trust_remote_code, and transformers'
    refusal named the Python argument; --trust_remote_code reaches every load (config, tokenizer, model),
    and without it the refusal names the flag before any data is read."""
    from hf_mhce.train import corpus, job

    _, text = plain
    tok = corpus.train_tokenizer(open(text).read().splitlines(), 300)
    remote = remote_code_checkpoint(tmp_path / "remote", tok)
    with monkeypatch.context() as m:
        m.setattr(job, "build_datasets", lambda *_: pytest.fail("data read before the options were checked"))
        with pytest.raises(ValueError, match=re.escape(f"The repository {remote} contains custom code") +
                           ".*Pass --trust_remote_code to run it"):
            _run(tmp_path / "o", "--model", remote, "--dataset", text)
    # (no sample: the toy model has no generation cache)
    summary = _run(tmp_path / "o", "--model", remote, "--dataset", text, "--trust_remote_code", "--sample_tokens", "0")
    assert (summary["loss"], summary["num_heads"]) == ("mhce", 4) and summary["final_eval"]
    out = tmp_path / "o"
    assert (out / "modeling_toy_remote.py").exists()  # the code is saved with the model, and the card opts in
    assert f'hf_mhce.from_pretrained("{out}", trust_remote_code=True)' in (out / "README.md").read_text()
    assert hf_mhce.from_pretrained(out, trust_remote_code=True).config.hf_mhce["num_heads"] == 4


def test_a_mistyped_relative_model_is_named_not_a_hub_traceback(tmp_path, monkeypatch):
    """--model outputs/hf-mhce-trian reads as a Hub id: a raw OSError traceback, not a usage error."""
    from hf_mhce.train import job

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "outputs").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(job, "build_datasets", lambda *_: pytest.fail("data read before the options were checked"))
    with pytest.raises(ValueError, match=re.escape("--model 'outputs/hf-mhce-trian' is no local directory, and "
                                                   "loading it as a Hub id failed")):
        _run(tmp_path / "o", "--model", "outputs/hf-mhce-trian")
