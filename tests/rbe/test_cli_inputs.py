"""`hf-mhce rbe` on the inputs users get wrong: checkpoints without a tokenizer or without an LM head,
dataset paths, block sizes, splits, padded token-id datasets, counts, outputs.  Reports are checked against
plain transformers losses; refusals must name the problem before any numbers are printed.  Documents,
columns and labels: test_cli_documents.py; the shared checkpoints: conftest.py."""

import json
import sys
from pathlib import Path

import datasets
import pytest
import torch
from cli_helpers import POSITIONS, TEXT, reference_ce, refused, run_rbe, text_stream
from transformers import GPT2LMHeadModel

from hf_mhce.cli import main
from hf_mhce.rbe.data import DataError, load_texts, token_blocks
from hf_mhce.train import corpus

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "patching"))
from test_remote_code import REPLACED_FORWARD, remote_code_checkpoint  # noqa: E402


# -- tokenizers ---------------------------------------------------------------------------------

def test_checkpoint_without_tokenizer_is_refused(ckpt, capsys):
    root, _ = ckpt
    # GPT-2 got an empty tokenizer and a report over EOS tokens; Llama asked for sentencepiece
    for name in ("gpt2_notok", "llama_notok"):
        msg = refused(root / name, "--dataset", root / "c.txt", "--block-size", 16, capsys=capsys)
        assert f"no tokenizer in {root / name}: pass --tokenizer" in msg
    msg = refused(root / "adapter_bare", "--dataset", root / "c.txt", "--block-size", 16, capsys=capsys)
    assert f"no tokenizer in {root / 'adapter_bare'} nor in its base model {root / 'gpt2_notok'}: pass --tokenizer" in msg


def test_tokenizer_option_and_adapter_base_tokenizer(ckpt, tmp_path):
    root, tok = ckpt
    model = GPT2LMHeadModel.from_pretrained(root / "gpt2")
    stream = text_stream(tok)
    rows = [stream[i:i + 16] for i in range(0, len(stream), 16)]
    want, n = reference_ce(model, rows)
    report = run_rbe(root / "gpt2_notok", "--dataset", root / "c.txt", "--block-size", 16, "--tokenizer", root / "gpt2",
                  tmp_path=tmp_path)
    assert report["num_tokens"] == n and report["cross_entropy"] == pytest.approx(want, rel=1e-5)
    # an adapter saved without a tokenizer: its base model's (adapter_config's base_model_name_or_path)
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(root / "gpt2"), root / "adapter_notok")
    want_lora, _ = reference_ce(adapted, rows)
    assert want_lora != pytest.approx(want, rel=1e-4)  # the adapter changes the model
    report = run_rbe(root / "adapter_notok", "--dataset", root / "c.txt", "--block-size", 16, tmp_path=tmp_path)
    assert report["num_tokens"] == n and report["cross_entropy"] == pytest.approx(want_lora, rel=1e-5)


def test_empty_or_wrong_tokenizer_is_refused(ckpt, tmp_path, capsys):
    root, tok = ckpt
    # a --tokenizer that cannot be loaded: one line, which does not ask for the option that was given
    msg = refused(root / "gpt2", "--dataset", root / "c.txt", "--tokenizer", tmp_path / "no_such_tok", capsys=capsys)
    assert f"could not load a tokenizer from {tmp_path / 'no_such_tok'}" in msg and msg.rstrip().endswith("check --tokenizer")
    assert "\n" not in str(msg).split("usage")[0].rstrip()
    # tokenizer_config.json alone: AutoTokenizer builds a GPT2Tokenizer with 1 token, every text -> []
    (tmp_path / "empty_tok").mkdir()
    (tmp_path / "empty_tok" / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
    msg = refused(root / "gpt2", "--dataset", root / "c.txt", "--tokenizer", tmp_path / "empty_tok", capsys=capsys)
    assert "has 1 token(s)" in msg and "--tokenizer" in msg
    # a tokenizer with more tokens than the model's embeddings (was an IndexError in torch.embedding)
    big = corpus.train_tokenizer([TEXT] + corpus.embedded_texts()[0][:8], vocab_size=600)
    big.save_pretrained(tmp_path / "big_tok")
    top = max(text_stream(big))
    assert top >= len(tok)
    msg = refused(root / "gpt2", "--dataset", root / "c.txt", "--tokenizer", tmp_path / "big_tok", capsys=capsys)
    assert f"gives token id {top}" in msg and f"has {len(tok)} token embeddings" in msg


def test_text_of_special_tokens_only_is_refused():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator(["alpha beta gamma"], trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    other = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="<eos>")
    ds = datasets.Dataset.from_dict({"text": TEXT.splitlines()})
    with pytest.raises(DataError, match=r"special tokens only \(\d+ of them\).*--tokenizer"):
        token_blocks(ds, other, block_size=16)  # every word is <unk>
    ok = datasets.Dataset.from_dict({"text": ["alpha beta", "gamma"]})
    assert token_blocks(ok, other, block_size=16) == [{"input_ids": [2, 3, 1, 4, 1]}]


# -- checkpoints --------------------------------------------------------------------------------

def test_checkpoint_without_lm_head_is_refused(ckpt, capsys):
    root, _ = ckpt
    msg = refused(root / "seqcls", "--dataset", root / "c.txt", "--block-size", 16, capsys=capsys)
    assert f"{root / 'seqcls'} has no language-model head" in msg
    assert "LlamaForSequenceClassification" in msg and "lm_head.weight not in the checkpoint" in msg


@pytest.mark.filterwarnings(REPLACED_FORWARD)
def test_a_remote_code_checkpoint_is_run_with_the_flag(ckpt, tmp_path, capsys):
    """A checkpoint whose model is custom code (auto_map): there was no way to pass trust_remote_code, and
    transformers' refusal named that Python argument; --trust-remote-code runs it, and without it the
    refusal names the flag."""
    from transformers import AutoModelForCausalLM

    root, tok = ckpt
    remote = remote_code_checkpoint(tmp_path / "remote", tok)
    msg = refused(remote, "--dataset", root / "c.txt", "--block-size", 16, capsys=capsys)
    assert f"The repository {remote} contains custom code" in msg and "Pass --trust-remote-code to run it" in msg
    stream = text_stream(tok)
    rows = [stream[i:i + 16] for i in range(0, len(stream), 16)]
    want, n = reference_ce(AutoModelForCausalLM.from_pretrained(remote, trust_remote_code=True), rows)
    report = run_rbe(remote, "--dataset", root / "c.txt", "--block-size", 16, "--trust-remote-code", tmp_path=tmp_path)
    assert report["num_tokens"] == n and report["cross_entropy"] == pytest.approx(want, rel=1e-5)


# -- datasets -----------------------------------------------------------------------------------

def test_dataset_paths(ckpt, tmp_path, capsys):
    root, _ = ckpt
    model = ("--block-size", 16)
    for missing in ("sub/missing.txt", str(tmp_path / "nothing"), "./notes.md"):
        msg = refused(root / "gpt2", "--dataset", missing, *model, capsys=capsys)
        assert f"no such file or directory: {missing!r}" in msg
    for name, content in (("empty.txt", ""), ("empty.jsonl", ""), ("blank.jsonl", "\n  \n")):
        (tmp_path / name).write_text(content)
        msg = refused(root / "gpt2", "--dataset", tmp_path / name, *model, capsys=capsys)
        assert f"no text in {str(tmp_path / name)!r}: the file is empty" in msg
    for name, content in (("header.csv", "text\n"), ("none.json", "[]")):  # datasets' own "corresponds to no data"
        (tmp_path / name).write_text(content)
        msg = refused(root / "gpt2", "--dataset", tmp_path / name, *model, capsys=capsys)
        assert f"no rows in {str(tmp_path / name)!r}: datasets read it as" in msg
    import datasets

    datasets.Dataset.from_dict({"text": []}).save_to_disk(tmp_path / "saved_empty")
    msg = refused(root / "gpt2", "--dataset", tmp_path / "saved_empty", *model, capsys=capsys)
    assert f"no rows in the saved dataset {str(tmp_path / 'saved_empty')!r}" in msg
    (tmp_path / "weights.bin").write_bytes(b"\x00\x01\xff" * 100)
    msg = refused(root / "gpt2", "--dataset", tmp_path / "weights.bin", *model, capsys=capsys)
    assert "is neither a text file nor one of the data files" in msg and ".jsonl" in msg
    # a text file with another extension (or none) is plain text, one document, as a .txt is
    want = run_rbe(root / "gpt2", "--dataset", root / "c.txt", *model, tmp_path=tmp_path)
    for name in ("c.md", "corpus"):
        (tmp_path / name).write_text(TEXT)
        assert run_rbe(root / "gpt2", "--dataset", tmp_path / name, *model, tmp_path=tmp_path) == {
            **want, "dataset": str(tmp_path / name)}


def test_unreadable_data_is_named_not_a_traceback(ckpt, tmp_path, capsys):
    """datasets' json reader keeps bytes that are not UTF-8 (the column failed with UnicodeDecodeError as it was
    read); a folder with a malformed file failed inside datasets (DatasetGenerationError)."""
    root, _ = ckpt
    model = ("--block-size", 16)
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9 au lait"}\n' * 20)
    msg = refused(root / "gpt2", "--dataset", tmp_path / "latin1.jsonl", *model, capsys=capsys)
    assert "column 'text' is not UTF-8 text ('utf-8' codec can't decode byte 0xe9" in msg
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.jsonl").write_text('{"text": "a good row"}\n' * 20)
    (tmp_path / "bad" / "b.jsonl").write_text('{"text": "ok"}\n{not json\n')
    msg = refused(root / "gpt2", "--dataset", tmp_path / "bad", *model, capsys=capsys)
    assert f"could not read {str(tmp_path / 'bad')!r}: JSON parse error" in msg


def test_split_of_single_file_is_refused_not_ignored(ckpt, tmp_path, capsys):
    root, _ = ckpt
    msg = refused(root / "gpt2", "--dataset", root / "c.txt", "--split", "validation", "--block-size", 16,
                   capsys=capsys)
    assert "is a single file, which has no splits" in msg and "leave out --split" in msg
    assert load_texts(str(root / "c.txt"), split="train")["text"] == load_texts(str(root / "c.txt"))["text"] == [TEXT]
    lines = [f"line {i}" for i in range(5)]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": lines}),
                          "validation": datasets.Dataset.from_dict({"text": lines[:2]})}).save_to_disk(tmp_path / "dd")
    assert load_texts(str(tmp_path / "dd"), split="validation")["text"] == lines[:2]
    with pytest.raises(DataError, match=r"has splits \['train', 'validation'\], not 'test'"):
        load_texts(str(tmp_path / "dd"))
    datasets.Dataset.from_dict({"text": lines}).save_to_disk(tmp_path / "one")
    with pytest.raises(DataError, match="is a saved Dataset, which has no splits"):
        load_texts(str(tmp_path / "one"), split="test")


# -- block sizes --------------------------------------------------------------------------------

def test_block_size_checks(ckpt, tmp_path, capsys):
    root, tok = ckpt
    for bad in ("0", "1", "-3"):
        msg = refused(root / "gpt2", "--dataset", root / "c.txt", "--block-size", bad, capsys=capsys)
        assert "argument --block-size" in msg and "at least 2 tokens" in msg
    msg = refused(root / "gpt2", "--dataset", root / "c.txt", "--block-size", 64, capsys=capsys)
    assert f"--block-size 64 is more than the {POSITIONS} positions {root / 'gpt2'} takes" in msg
    # the default is min(256, the model's positions): blocks of 32 here
    stream = text_stream(tok)
    rows = [stream[i:i + POSITIONS] for i in range(0, len(stream), POSITIONS)]
    assert len(rows) >= 3
    want, n = reference_ce(GPT2LMHeadModel.from_pretrained(root / "gpt2"), rows)
    report = run_rbe(root / "gpt2", "--dataset", root / "c.txt", tmp_path=tmp_path)
    assert capsys.readouterr().out.count(f"({len(rows)} blocks)") == 1
    assert report["num_tokens"] == n and report["cross_entropy"] == pytest.approx(want, rel=1e-5)
    # a token-id dataset keeps its rows: one longer than the model's positions is named
    datasets.Dataset.from_dict({"input_ids": [stream[:40], stream[:10]]}).save_to_disk(tmp_path / "long")
    msg = refused(root / "gpt2", "--dataset", tmp_path / "long", capsys=capsys)
    assert f"has rows of up to 40 token ids, more than the {POSITIONS} positions" in msg


@pytest.mark.parametrize("ids,message", [([[5, -3, 7]], "holds token id -3: token ids are never negative"),
                                         ([[5.0, 6.5, 7.0]], "must be a 1-D sequence of integer token ids")],
                         ids=["negative", "float"])
def test_bad_token_ids_are_named_before_the_model_loads(ckpt, tmp_path, capsys, ids, message, monkeypatch):
    """Negative ids were an IndexError from the embedding, float ids a TypeError traceback from inside
    the evaluation: one line each now, before the model is loaded."""
    import hf_mhce.cli as cli

    root, _ = ckpt
    datasets.Dataset.from_dict({"input_ids": ids}).save_to_disk(tmp_path / "bad")
    loads = []
    real = cli._load_model
    monkeypatch.setattr(cli, "_load_model", lambda *a: loads.append(a) or real(*a))
    msg = refused(root / "gpt2", "--dataset", tmp_path / "bad", capsys=capsys)
    assert message in msg and "Traceback" not in msg
    assert not loads  # refused before the model loads


# -- token-id datasets with padding -------------------------------------------------------------

def test_padded_token_id_rows_carry_their_mask(ckpt, tmp_path):
    root, tok = ckpt
    stream = text_stream(tok)
    real = [stream[:12], stream[12:17], stream[17:29], stream[29:30]]  # the last: one token, no target
    width = 12
    ids = [r + [tok.eos_token_id] * (width - len(r)) for r in real]
    mask = [[1] * len(r) + [0] * (width - len(r)) for r in real]
    ds = datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": mask})
    rows = token_blocks(ds, tok)
    # a mask only where it masks something; a row of one real token is dropped
    assert rows == [{"input_ids": ids[0]}, {"input_ids": ids[1], "attention_mask": mask[1]},
                    {"input_ids": ids[2]}]
    ds.save_to_disk(tmp_path / "padded")
    want, n = reference_ce(GPT2LMHeadModel.from_pretrained(root / "gpt2"), real[:3])
    report = run_rbe(root / "gpt2", "--dataset", tmp_path / "padded", "--batch-size", 3, tmp_path=tmp_path)
    assert report["num_tokens"] == n == 11 + 4 + 11
    assert report["cross_entropy"] == pytest.approx(want, rel=1e-5)


# -- counts -------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag,value", [("--max-blocks", "-1"), ("--max-blocks", "0"), ("--batch-size", "0"),
                                        ("--batch-size", "-4")])
def test_counts_below_one_are_refused_by_name(flag, value, tmp_path, capsys):
    """--max-blocks -1 evaluated all blocks but one, --max-blocks 0 said the file had no text, --batch-size 0
    failed in the DataLoader after the model was loaded: now argparse names the flag before anything loads."""
    msg = refused(tmp_path / "not-loaded", "--dataset", tmp_path / "not-read.txt", flag, value, capsys=capsys)
    assert f"argument {flag}: {value}: must be a positive whole number" in msg


def test_max_blocks_limits_the_blocks(ckpt, tmp_path, capsys):
    root, _ = ckpt
    report = run_rbe(root / "gpt2", "--dataset", root / "c.txt", "--block-size", 16, "--max-blocks", 1, "--batch-size", 1,
                  tmp_path=tmp_path)
    assert report["num_tokens"] == 15 and "(1 blocks)" in capsys.readouterr().out


def test_a_missing_checkpoint_directory_is_named(ckpt, tmp_path, capsys):
    """transformers took the path for a malformed hub id: a raw OSError ("Repo id must be in the form ...")."""
    root, _ = ckpt
    missing = tmp_path / "no" / "such_ckpt"
    msg = refused(missing, "--dataset", root / "c.txt", capsys=capsys)
    assert f"no such checkpoint directory: {str(missing)!r}" in msg
    # a file: two chained tracebacks ending in transformers' OSError
    msg = refused(root / "c.txt", "--dataset", root / "c.txt", capsys=capsys)
    assert f"{str(root / 'c.txt')!r} is a file, not a checkpoint directory (MODEL is a checkpoint" in msg


@pytest.mark.parametrize("option,value,reason", [
    ("--json", "nodir/r.json", "no such directory"), ("--plot", "nodir/r.png", "no such directory"),
    ("--json", ".", "is a directory, not a file"), ("--device", "bogus", "is not a torch device"),
    ("--device", f"cuda:{torch.cuda.device_count()}", "is not available here"),
    *([("--device", "mps", "is not available here")] if not torch.backends.mps.is_available() else [])])
def test_outputs_and_device_are_checked_before_anything_loads(option, value, reason, tmp_path, capsys):
    """A --json/--plot directory that did not exist failed after the evaluation (--plot after writing the
    JSON), an unknown or absent --device after the model was loaded: now argparse names them first."""
    value = str(tmp_path / value) if option != "--device" else value
    with pytest.raises(SystemExit) as info:  # neither the checkpoint nor the data exist: nothing is loaded
        main(["rbe", str(tmp_path / "not-loaded"), "--dataset", str(tmp_path / "not-read.txt"), option, value])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"argument {option}: {value!r}" in err and reason in err


def test_plot_without_matplotlib_is_refused_before_loading(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("hf_mhce.rbe.plots.available", lambda: False)  # was an ImportError after the evaluation
    msg = refused(ckpt[0] / "gpt2", "--dataset", tmp_path / "not-read.txt", "--plot", tmp_path / "p.png", capsys=capsys)
    assert "--plot: RBE plots need matplotlib" in msg


def test_token_id_rows_with_position_ids_are_refused():
    """A packed token-id dataset (a position_ids column): the column was dropped, so each row's sequences
    were evaluated as one, the first token of each a target of the sequence before."""
    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8, 9]], "position_ids": [[0, 1, 0, 1, 2]]})
    with pytest.raises(DataError, match="position_ids column"):
        token_blocks(ds, None)


def test_a_mistyped_relative_checkpoint_is_named_not_a_hub_traceback(ckpt, tmp_path, capsys, monkeypatch):
    """`outputs/hf-mhce-trian` (a typo of the default output directory) reads as a Hub id "owner/name":
    it ended in transformers' raw OSError traceback about the internet connection."""
    root, _ = ckpt
    (tmp_path / "outputs").mkdir()
    monkeypatch.chdir(tmp_path)
    msg = refused("outputs/hf-mhce-trian", "--dataset", root / "c.txt", capsys=capsys)
    assert "'outputs/hf-mhce-trian' is no local directory, and loading it as a Hub id failed" in msg
    assert "'outputs' is a local directory, so this is likely a mistyped path" in msg


def test_rbe_options_take_either_spelling(monkeypatch):
    """hf-mhce train spells its options with "_", rbe with "-": rbe's "_" spellings were "unrecognized
    arguments" under the top-level usage."""
    import hf_mhce.cli as cli

    seen = []
    monkeypatch.setattr(cli, "_rbe", lambda args: seen.append(args) or 0)
    assert cli.main(["rbe", "m_1", "--dataset", "d_x.txt", "--block_size", "32", "--batch_size=2", "--max_blocks", "3",
                     "--text_column", "t_c", "--dataset_config", "c", "--no_progress", "--trust_remote_code"]) == 0
    args = seen[0]
    assert (args.model, args.dataset, args.block_size, args.batch_size, args.max_blocks, args.text_column,
            args.dataset_config) == ("m_1", "d_x.txt", 32, 2, 3, "t_c", "c")
    assert args.no_progress and args.trust_remote_code


def test_a_checkpoint_the_patch_refuses_is_a_usage_error(ckpt, tmp_path, capsys):
    """A saved loss that does not fit the model (num_heads 3 on hidden size 32) was a ValueError traceback, exit 1."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt[0] / "gpt2", bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hf_mhce": {"loss": "mhce", "num_heads": 3}}))
    msg = refused(bad, "--dataset", ckpt[0] / "c.txt", capsys=capsys)
    assert f"hf-mhce rbe: error: cannot evaluate {bad}: " in msg and "num_heads=3" in msg, msg
