"""hf-mhce train on the inputs users get wrong: text files (documents, not lines), BOS-adding
tokenizers, block sizes beyond the model's positions, columns without text, options files that
hold no options.  Refusals come before any data is read where they can, and on the command line
as usage errors (exit status 2, no traceback)."""

import json
import random

import pytest
import torch
from test_train_job import REDUCED

from hf_mhce.cli import main as hf_mhce_main
from hf_mhce.rbe.data import token_stream
from hf_mhce.train import cli, corpus, job, parse
from hf_mhce.train.arguments import DataArguments

pytestmark = pytest.mark.usefixtures("single_thread")
WORDS = "the quick brown fox jumps over a lazy dog while cats sleep".split()


def _lines(seed: int, n: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, 10))) for _ in range(n)]


def _cli(tmp_path, *argv) -> int:
    return cli([*REDUCED, "--no_rbe_plots", "--output_dir", str(tmp_path / "out"), *map(str, argv)])


def test_eval_sets_are_named_after_their_split(tmp_path):
    """The Trainer prefixes a named eval set's metrics with eval_<name>_: the held-out set was named "eval"
    (eval_eval_loss); it is named after the split it was read from, or held_out."""
    import datasets

    data = datasets.DatasetDict({split: datasets.Dataset.from_dict({"text": _lines(i)})
                                 for i, split in enumerate(["train", "validation", "test"])})
    data.save_to_disk(tmp_path / "saved")
    for split, name in ((None, "validation"), ("test", "test"), ("train", "held_out")):
        args = DataArguments(dataset=str(tmp_path / "saved"), **({"eval_split": split} if split else {}))
        train, evals = job.build_datasets(args)
        assert list(evals) == [name], split
        if name != "held_out":
            assert train == _lines(0) and evals[name] == _lines(["train", "validation", "test"].index(name))


@pytest.mark.parametrize("split, name", [("validation", "validation"), ("validation[:10%]", "validation_10"),
                                         ("test+validation", "test_validation"), ("[:5%]", "eval_5"), ("%", "eval")])
def test_eval_set_name_of_a_split(split, name):
    assert job.eval_set_name(split) == name


def test_a_text_file_is_trained_as_one_document(tmp_path):
    """Each line of a .txt was a row, and token_stream put an EOS after each: the model learnt EOS where
    the text has line breaks, and never a line break."""
    text = "\n".join(_lines(1)) + "\n"
    (tmp_path / "c.txt").write_text(text)
    train, evals = job.build_datasets(DataArguments(dataset=str(tmp_path / "c.txt"), eval_fraction=0.2))
    held = evals["held_out"]
    assert len(train) == len(held) == 1 and train[0] + held[0] == text  # cut between two lines
    assert train[0].endswith("\n") and 0.1 < len(held[0]) / len(text) < 0.3
    tok = corpus.train_tokenizer(train, 300)
    stream = token_stream(train, tok)
    assert stream.count(tok.eos_token_id) == 1 and stream[-1] == tok.eos_token_id
    assert tok.decode(stream[:-1]) == train[0]  # its line breaks are tokens of the text


def test_the_sample_prompt_starts_like_the_training_documents(tmp_path):
    """Training documents start with BOS where the tokenizer adds one (token_stream); the sample's prompt
    had none, so the sample continued a text unlike any the model was trained on."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    default = corpus.train_tokenizer(_lines(2), 300)
    backend = Tokenizer.from_str(default.backend_tokenizer.to_str())
    backend.add_special_tokens(["<s>"])
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    llama_like = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token=default.eos_token)

    class Recorder(torch.nn.Linear):
        def generate(self, input_ids, **_):
            self.prompt = input_ids[0].tolist()
            return input_ids

    prompt = " ".join(_lines(3, 1))
    for tok, first in ((llama_like, [bos]), (default, [])):  # the default job's (BOS = EOS, never added): as before
        model = Recorder(1, 1)
        job.generate_sample(model, tok, prompt, 3)
        assert model.prompt == first + tok(prompt, add_special_tokens=False)["input_ids"]
        assert token_stream([prompt], tok)[: len(model.prompt)] == model.prompt


def test_a_block_longer_than_the_models_positions_is_refused_up_front(tmp_path, monkeypatch, capsys):
    """A GPT-2 checkpoint with 16 positions and --block_size 32: an IndexError in its position embedding
    after the data was read and the model built."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = corpus.train_tokenizer(_lines(4), 300)
    ckpt = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, n_positions=16)).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    monkeypatch.setattr(job, "build_datasets", lambda *_: pytest.fail("data read before the options were checked"))
    assert _cli(tmp_path, "--model", ckpt, "--block_size", 32) == 2
    err = capsys.readouterr().err
    assert (f"hf-mhce train: error: --block_size 32 is more than the 16 positions {ckpt} takes "
            "(max_position_embeddings in its config)") in err
    assert "pass --block_size 16 or less" in err and "Traceback" not in err
    with pytest.raises(pytest.fail.Exception, match="data read"):  # 16 fits: on to the data
        _cli(tmp_path, "--model", ckpt, "--block_size", 16)


def test_options_files_and_bad_values_are_usage_errors(tmp_path, capsys):
    """An empty or list-valued YAML file was an AttributeError, a missing file or an unknown key a
    traceback, and a refused value (--block_size 1) a ValueError traceback on the command line."""
    files = {"empty.yaml": ("", "holds nothing: it must map option names to values"),
             "list.yaml": ("- max_steps\n- 3\n", "holds a list: it must map option names to values"),
             "keys.json": (json.dumps({"max_steps": 3, "bogus_option": 1}), "keys.json: Some keys are not used"),
             "missing.json": (None, "cannot read the options file")}
    for name, (content, message) in files.items():
        if content is not None:
            (tmp_path / name).write_text(content)
        with pytest.raises(SystemExit) as info:
            parse([str(tmp_path / name)])
        assert info.value.code == 2 and message in capsys.readouterr().err, name
    assert hf_mhce_main(["train", "--block_size", "1", "--output_dir", str(tmp_path / "o")]) == 2
    assert "hf-mhce train: error: --block_size 1: a block needs at least 2 tokens" in capsys.readouterr().err


def test_columns_without_text_are_usage_errors_and_blank_rows_are_skipped(tmp_path, capsys):
    """A column of numbers was a TypeError deep in the job, a chat 'messages' column a tokenizer
    ValueError; rows of whitespace only were trained on as text."""
    lines = _lines(5)
    cases = {"nums.jsonl": ([{"text": i} for i in range(20)], "text", "column 'text' holds Value('int64'), not text"),
             "chat.jsonl": ([{"messages": [{"role": "user", "content": t}]} for t in lines], "messages",
                            "column 'messages' holds List("),
             "blank.jsonl": ([{"text": t} for t in (" ", "\n", "\t ")], "text", "every row is empty or blank")}
    for name, (rows, column, message) in cases.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert _cli(tmp_path, "--dataset", tmp_path / name, "--text_column", column) == 2, name
        err = capsys.readouterr().err
        assert "hf-mhce train: error: " in err and message in err and "Traceback" not in err, name
    rows = [t if i % 3 else " \n " for i, t in enumerate(lines)]
    (tmp_path / "some_blank.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    train, evals = job.build_datasets(DataArguments(dataset=str(tmp_path / "some_blank.jsonl")))
    assert train + evals["held_out"] == [t for i, t in enumerate(lines) if i % 3]


def test_an_error_during_training_keeps_its_traceback(tmp_path, monkeypatch):
    """Only refusals before training are usage errors: a ValueError of training itself is raised."""
    from transformers import Trainer

    def broken(*_, **__):
        raise ValueError("broken inside training")

    monkeypatch.setattr(Trainer, "train", broken)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _lines(6, 200)))
    with pytest.raises(ValueError, match="broken inside training"):
        _cli(tmp_path, "--dataset", tmp_path / "c.jsonl", "--block_size", 8)
