"""`hf-mhce rbe` on documents, columns and labels: text files as documents (BOS and EOS as the tokenizer
adds them), folders mixing file types, columns without text, blank rows, a labels column evaluated as
given.  The shared checkpoints: conftest.py."""

import json
import random

import datasets
import pytest
import torch
from cli_helpers import TEXT, refused, run_rbe
from transformers import GPT2LMHeadModel

from hf_mhce.rbe.data import DataError, load_texts, token_blocks


def _random_lines(seed, n=12):
    rng = random.Random(seed)
    words = TEXT.split()
    return [" ".join(rng.choices(words, k=rng.randint(1, 9))) for _ in range(n)]


def _bos_tokenizer(tok):
    """``tok`` with a BOS its encodings start with, as Llama's tokenizers add one."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    backend.add_special_tokens(["<s>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token=tok.eos_token)


def test_text_files_are_documents_that_start_with_the_tokenizers_bos(ckpt, tmp_path):
    """Each line of a .txt was a row, so every line break became an EOS; and no BOS was ever added, though a
    Llama-like tokenizer starts every text it encodes with one (the model then sees at inference what it
    never saw in the evaluation or in training)."""
    _, tok = ckpt
    docs = ["\n".join(_random_lines(seed)) + "\n\n" for seed in (1, 2)]
    (tmp_path / "one").mkdir()
    for i, doc in enumerate(docs):
        (tmp_path / "one" / f"{i}.txt").write_text(doc)
    assert load_texts(str(tmp_path / "one" / "0.txt"))["text"] == docs[:1]
    texts = load_texts(str(tmp_path / "one"), split="train")
    assert sorted(texts["text"]) == sorted(docs)
    eos = tok.eos_token_id
    plain = [tok(doc, add_special_tokens=False)["input_ids"] for doc in texts["text"]]
    rows = token_blocks(texts, tok, block_size=10_000)
    assert rows == [{"input_ids": plain[0] + [eos] + plain[1] + [eos]}]  # EOS between files, line breaks kept
    assert tok.decode(rows[0]["input_ids"]).count("\n") == sum(doc.count("\n") for doc in docs)
    with_bos = _bos_tokenizer(tok)
    bos = with_bos.bos_token_id
    assert with_bos(docs[0])["input_ids"][0] == bos != eos
    assert token_blocks(texts, with_bos, block_size=10_000) == [
        {"input_ids": [bos] + plain[0] + [eos] + [bos] + plain[1] + [eos]}]
    # `tok` is the default job's tokenizer (BOS = EOS = <|endoftext|>, which it never adds): no BOS above
    assert tok.bos_token_id == eos and tok(docs[0])["input_ids"] == tok(docs[0], add_special_tokens=False)["input_ids"]


def test_a_folder_mixing_file_types_is_refused(tmp_path):
    """datasets read only one type of a folder holding a .txt and a .jsonl, silently dropping the other."""
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("\n".join(_random_lines(3)))
    (tmp_path / "mixed" / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _random_lines(4)))
    with pytest.raises(DataError, match=r"mixes data files of different types: json \(\.jsonl\), text \(\.txt\)"):
        load_texts(str(tmp_path / "mixed"), split="train")


def test_columns_without_text_are_refused_and_blank_rows_skipped(ckpt, tmp_path, capsys):
    """A chat 'messages' column or a column of numbers reached the tokenizer (a raw ValueError); rows of
    whitespace only were tokenised as text while empty ones were skipped."""
    root, tok = ckpt
    lines = _random_lines(5, n=6)
    chat = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": t}] for t in lines]})
    with pytest.raises(DataError, match=r"column 'messages' holds List\(.*'content'.*\), not text .* with --text-column; "
                                        "render chat messages"):
        token_blocks(chat, tok, "messages")
    numbers = datasets.Dataset.from_dict({"text": list(range(6))})
    with pytest.raises(DataError, match=r"column 'text' holds Value\('int64'\), not text"):
        token_blocks(numbers, tok)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in chat["messages"]))
    msg = refused(root / "gpt2", "--dataset", tmp_path / "chat.jsonl", "--text-column", "messages", capsys=capsys)
    assert "column 'messages' holds" in msg and "--text-column" in msg
    blank = datasets.Dataset.from_dict({"text": ["  ", lines[0], "\n\t", None, "", lines[1]]})
    assert token_blocks(blank, tok, block_size=64) == token_blocks(datasets.Dataset.from_dict({"text": lines[:2]}), tok,
                                                                   block_size=64)


def test_a_labels_column_is_evaluated_as_given(ckpt, tmp_path):
    """A token-id dataset with labels (a masked prompt): the labels were recomputed from input_ids, so
    the prompt's tokens were evaluated too."""
    root, tok = ckpt
    g = torch.Generator().manual_seed(11)
    rows = []
    for _ in range(5):
        length = int(torch.randint(6, 20, (1,), generator=g))
        ids = torch.randint(0, len(tok), (length,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(1, length - 2, (1,), generator=g))] = -100
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    rows.append({"input_ids": rows[0]["input_ids"][:4], "labels": [5, -100, -100, -100]})  # no target: dropped
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "ids")
    model = GPT2LMHeadModel.from_pretrained(root / "gpt2").eval()
    total = count = 0.0
    with torch.no_grad():
        for r in rows[:-1]:
            n = sum(label != -100 for label in r["labels"][1:])
            total += model(input_ids=torch.tensor([r["input_ids"]]), labels=torch.tensor([r["labels"]])).loss.item() * n
            count += n
    report = run_rbe(root / "gpt2", "--dataset", tmp_path / "ids", "--batch-size", 2, tmp_path=tmp_path)
    assert report["num_tokens"] == count < sum(len(r["input_ids"]) - 1 for r in rows[:-1])
    assert report["cross_entropy"] == pytest.approx(total / count, rel=1e-5)
    bad = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]], "labels": [[1, 2]]})
    with pytest.raises(DataError, match="row 0 has 2 labels for 3 input_ids"):
        token_blocks(bad, tok)


@pytest.mark.parametrize("codec", ["gz", "bz2", "xz"])
def test_compressed_data_files_are_read_as_the_type_inside(codec, tmp_path):
    """data.jsonl.gz (datasets reads it as it is) was refused as "neither a text file nor a data file"."""
    import bz2
    import gzip
    import lzma

    write = {"gz": gzip.open, "bz2": bz2.open, "xz": lzma.open}[codec]
    rows = _random_lines(5, n=4)
    plain = {"jsonl": "\n".join(json.dumps({"text": r}) for r in rows), "csv": "text\n" + "\n".join(rows),
             "txt": "\n".join(rows), "notes": "\n".join(rows)}  # notes: no known type inside -> plain text
    for ext, body in plain.items():
        path = tmp_path / f"data.{ext}.{codec}"
        with write(path, "wt", encoding="utf-8") as f:
            f.write(body)
        assert load_texts(str(path))["text"] == (["\n".join(rows)] if ext in ("txt", "notes") else rows), ext
    (tmp_path / "folder").mkdir()
    (tmp_path / f"data.jsonl.{codec}").rename(tmp_path / "folder" / f"a.jsonl.{codec}")
    assert load_texts(str(tmp_path / "folder"), split="train")["text"] == rows
    (tmp_path / "folder" / "b.txt").write_text("x")  # mixed types are still named
    with pytest.raises(DataError, match="mixes data files of different types"):
        load_texts(str(tmp_path / "folder"), split="train")
    with write(tmp_path / f"empty.txt.{codec}", "wb"):
        pass
    with pytest.raises(DataError, match="the file is empty or holds only whitespace"):
        load_texts(str(tmp_path / f"empty.txt.{codec}"))
    (tmp_path / f"broken.jsonl.{codec}").write_bytes(b"not compressed")
    with pytest.raises(DataError, match=f"could not decompress .*broken.jsonl.{codec}"):
        load_texts(str(tmp_path / f"broken.jsonl.{codec}"))
    datasets.Dataset.from_dict({"text": rows}).to_parquet(tmp_path / "d.parquet")  # pyarrow reads no compressed one
    with write(tmp_path / f"d.parquet.{codec}", "wb") as f:
        f.write((tmp_path / "d.parquet").read_bytes())
    with pytest.raises(DataError, match=r"is neither a text file nor .*all but \.parquet also"):
        load_texts(str(tmp_path / f"d.parquet.{codec}"))
