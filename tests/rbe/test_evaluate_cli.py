"""hf_mhce.rbe.evaluate on rows, a datasets.Dataset and a DataLoader against a brute-force eval-mode
reference (model state restored afterwards), and the `hf-mhce rbe` command line."""

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from rbe_helpers import METRICS, rank_histogram, reference_token_stats
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from hf_mhce import apply_patch, from_pretrained
from hf_mhce.patching import CONFIG_KEY, is_patched
from hf_mhce.rbe import RBEReport, evaluate
from hf_mhce.rbe.evaluate import pad_collate
from hf_mhce.rbe.stats import check_identity

VOCAB = 61


def tiny_gpt2(vocab=VOCAB, seed=0):
    """Dropout on: a forward in train mode differs from the eval-mode reference."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.2,
                        embd_pdrop=0.2, attn_pdrop=0.2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    assert model.training
    return model


def ragged_rows(n=7, vocab=VOCAB, seed=3):
    """Rows of different lengths (padded per batch by evaluate); some with ignored label prefixes."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(4, 20, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g)
        row = {"input_ids": ids.tolist()}
        if i % 3 == 1:
            labels = ids.clone()
            labels[: length // 2] = -100
            row["labels"] = labels.tolist()
        rows.append(row)
    return rows


def _check_against_reference(report, model, rows, loss="ce", num_heads=1):
    assert isinstance(report, RBEReport)
    d = report.decomposition
    nll, ranks, hits = reference_token_stats(model, rows, loss=loss, num_heads=num_heads)
    assert d.num_tokens == nll.numel() == report.stats.num_tokens
    assert d.cross_entropy == pytest.approx(nll.mean().item(), rel=1e-5)
    assert d.top1 == hits.double().mean().item() and 0 < d.top5 < 1
    assert int((report.stats.counts - rank_histogram(ranks, report.stats.vocab_size)).abs().sum()) <= 2
    assert check_identity(d)
    assert report.as_dict() == {k: getattr(d, k) for k in METRICS}


def test_evaluate_unpatched_rows_restores_model():
    model = tiny_gpt2()
    rows = ragged_rows()
    report = evaluate(model, rows, batch_size=3)
    # patched for the evaluation only; training mode back as it was
    assert not is_patched(model) and "forward" not in model.__dict__
    assert not hasattr(model.config, CONFIG_KEY)
    assert model.training
    _check_against_reference(report, model, rows)
    # the same rows as a datasets.Dataset of token ids, and a batch limit
    import datasets

    ds = datasets.Dataset.from_list([{"input_ids": r["input_ids"], "labels": r.get("labels", r["input_ids"])}
                                     for r in rows])
    again = evaluate(model, ds, batch_size=2)
    assert again.decomposition.num_tokens == report.decomposition.num_tokens
    assert again.decomposition.cross_entropy == pytest.approx(report.decomposition.cross_entropy, rel=1e-6)
    first = evaluate(model, rows, batch_size=3, max_batches=1)
    nll3, _, _ = reference_token_stats(model, rows[:3])
    assert first.decomposition.num_tokens == nll3.numel() < report.decomposition.num_tokens
    assert first.decomposition.cross_entropy == pytest.approx(nll3.mean().item(), rel=1e-5)


def test_evaluate_patched_mhce_dataloader():
    model = apply_patch(tiny_gpt2(seed=1), loss="mhce", num_heads=2)
    saved = dict(getattr(model.config, CONFIG_KEY))
    model.eval()  # the mode to restore this time
    rows = ragged_rows(9, seed=4)
    loader = DataLoader(rows, batch_size=4, collate_fn=pad_collate)
    report = evaluate(model, loader)
    assert is_patched(model) and dict(getattr(model.config, CONFIG_KEY)) == saved
    assert not model.training
    _check_against_reference(report, model, rows, loss="mhce", num_heads=2)
    # the mixture ranks are not the ranks of either head alone nor of plain CE on the same weights
    ce = evaluate(apply_patch(tiny_gpt2(seed=1)), rows, batch_size=4)
    assert ce.decomposition.cross_entropy != pytest.approx(report.decomposition.cross_entropy, rel=1e-3)


def test_evaluate_dataloader_without_labels_skips_padding():
    """A DataLoader giving input_ids and attention_mask only (a padding collator): the padded
    positions are not targets."""
    model = apply_patch(tiny_gpt2(seed=2))
    rows = [{"input_ids": r["input_ids"]} for r in ragged_rows(6, seed=8)]

    def collate(batch):
        out = pad_collate(batch, pad_id=7)
        return {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"]}

    report = evaluate(model, DataLoader(rows, batch_size=3, collate_fn=collate))
    assert any(len(r["input_ids"]) != len(rows[0]["input_ids"]) for r in rows[:3])  # padding happens
    _check_against_reference(report, model, rows)


def test_evaluate_warns_on_padding_distributed_sampler():
    from torch.utils.data.distributed import DistributedSampler

    model = apply_patch(tiny_gpt2())
    rows = ragged_rows(5)
    even = DistributedSampler(rows[:4], num_replicas=2, rank=0, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluate(model, DataLoader(rows[:4], batch_size=2, sampler=even, collate_fn=pad_collate))
    padded = DistributedSampler(rows, num_replicas=2, rank=1, shuffle=False)  # 5 rows -> 6
    with pytest.warns(UserWarning, match="count twice"):
        evaluate(model, DataLoader(rows, batch_size=2, sampler=padded, collate_fn=pad_collate))


def test_padding_takes_the_models_ignore_index():
    """Padded labels and attention-masked positions get the label the model ignores: -100 was written
    whatever the patch said ("label -100 is outside the vocabulary" with ignore_index=-1)."""
    from hf_mhce.patching import LossConfig

    rows = [r["input_ids"] for r in ragged_rows(5, seed=9)]  # bare token ids of different lengths
    reference = evaluate(apply_patch(tiny_gpt2(seed=5)), rows, batch_size=5).as_dict()
    model = apply_patch(tiny_gpt2(seed=5), ignore_index=-1)
    assert evaluate(model, rows, batch_size=5).as_dict() == pytest.approx(reference, rel=1e-12)

    def without_labels(batch):
        out = pad_collate(batch, pad_id=7)
        return {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"]}

    loader = DataLoader(rows, batch_size=5, collate_fn=without_labels)
    assert evaluate(model, loader).as_dict() == pytest.approx(reference, rel=1e-12)
    unpatched = tiny_gpt2(seed=5)  # patched for the evaluation with the ignore_index its config records
    setattr(unpatched.config, CONFIG_KEY, LossConfig(ignore_index=-1).to_saved())
    assert evaluate(unpatched, rows, batch_size=5).as_dict() == pytest.approx(reference, rel=1e-12)
    assert (pad_collate(rows, ignore_index=-1)["labels"] == -1).sum() == sum(max(map(len, rows)) - len(r) for r in rows)


# -- command line -------------------------------------------------------------------------------

TEXT = """the cat sat on the mat
the dog sat on the log

a cat and a dog met on the mat
the log was under the dog and the mat was under the cat
on the mat the cat sat and on the log the dog sat
"""


def _tokenizer(path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXT.splitlines(), trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(path)
    return fast


def test_cli_rbe(tmp_path):
    model_dir, text_file = tmp_path / "model", tmp_path / "corpus.txt"
    tokenizer = _tokenizer(model_dir)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=4, n_positions=64,
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    apply_patch(GPT2LMHeadModel(config), loss="mhce", num_heads=4).save_pretrained(model_dir)
    text_file.write_text(TEXT)
    out_json, out_png = tmp_path / "out.json", tmp_path / "p.png"

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "cache"),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "hf_mhce.cli", "rbe", str(model_dir), "--dataset", str(text_file),
           "--json", str(out_json), "--plot", str(out_png), "--no-progress", "--block-size", "16",
           "--batch-size", "2", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout

    # the same blocks in-process: the file is one document -> its tokens and EOS -> blocks of 16 tokens
    stream = tokenizer(TEXT, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    rows = [{"input_ids": stream[i:i + 16]} for i in range(0, len(stream), 16)]
    rows = [r for r in rows if len(r["input_ids"]) > 1]
    assert len(rows) >= 3
    model = from_pretrained(model_dir)
    assert is_patched(model) and getattr(model.config, CONFIG_KEY)["loss"] == "mhce"
    expected = evaluate(model, rows, batch_size=2).decomposition
    assert expected.num_tokens == sum(len(r["input_ids"]) - 1 for r in rows)

    report = json.loads(out_json.read_text())
    assert report["model"] == str(model_dir) and report["dataset"] == str(text_file)
    # what was evaluated, to tell reports apart and run one again (block size and split were not recorded)
    assert {k: report[k] for k in ("dataset_config", "split", "text_column", "tokenizer", "block_size", "blocks")} == {
        "dataset_config": None, "split": None, "text_column": "text", "tokenizer": str(model_dir), "block_size": 16,
        "blocks": len(rows)}
    assert set(METRICS) <= report.keys()
    assert report["num_tokens"] == expected.num_tokens
    for key in METRICS:
        assert report[key] == pytest.approx(getattr(expected, key), rel=1e-9, abs=1e-12), key
    assert math.isclose(report["error_entropy"] + report["self_alignment"] - report["confidence"],
                        report["cross_entropy"], rel_tol=1e-9)

    # the printed table
    assert f"({len(rows)} blocks)" in out
    table = {}
    for line in out.splitlines():
        parts = line.rsplit(None, 1)
        if len(parts) == 2:
            table[parts[0].strip()] = parts[1]
    for label, key in (("cross-entropy", "cross_entropy"), ("Error-Entropy", "error_entropy"),
                       ("Self-Alignment", "self_alignment"), ("Confidence", "confidence"),
                       ("top-1 accuracy", "top1"), ("mean rank", "mean_rank")):
        assert float(table[label]) == pytest.approx(report[key], abs=1e-6), label
    assert float(table["perplexity"]) == pytest.approx(math.exp(report["cross_entropy"]), abs=1e-5)
    assert int(table["tokens"]) == expected.num_tokens
    assert f"wrote {out_json}" in out and f"wrote {out_png}" in out
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"



def test_evaluate_through_data_parallel_wrapper():
    """A model still inside nn.DataParallel is evaluated through .module: the same report as the bare model."""
    model = apply_patch(tiny_gpt2(seed=2), loss="mhce", num_heads=2)
    rows = ragged_rows(5, seed=8)
    wrapped = evaluate(torch.nn.DataParallel(model), rows, batch_size=3)
    _check_against_reference(wrapped, model, rows, loss="mhce", num_heads=2)
    assert wrapped.as_dict() == evaluate(model, rows, batch_size=3).as_dict()


def test_evaluate_through_a_deepspeed_engine_and_fsdp1_refused():
    """What deepspeed.initialize returns (and accelerate's DeepSpeed prepare) is evaluated through .module, as
    DDP is; an FSDP1 root wrapper is refused by name.  Both were taken for the model to patch:
    a real engine gave UnsupportedModelError "cannot patch DeepSpeedEngine: it is not a transformers PreTrainedModel"."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    class DeepSpeedEngine(torch.nn.Module):  # deepspeed.runtime.engine's name and place; its forward is not needed
        def __init__(self, module):
            super().__init__()
            self.module = module

    DeepSpeedEngine.__module__ = "deepspeed.runtime.engine"
    model = apply_patch(tiny_gpt2(seed=2), loss="mhce", num_heads=2)
    rows = ragged_rows(5, seed=8)
    assert evaluate(DeepSpeedEngine(model), rows, batch_size=3).as_dict() == evaluate(model, rows, batch_size=3).as_dict()
    with pytest.raises(TypeError, match="FSDP1 FullyShardedDataParallel root wrapper.*fully_shard"):
        evaluate(FullyShardedDataParallel.__new__(FullyShardedDataParallel), rows)  # checked before it is used


def test_a_directory_without_data_is_named(tmp_path):
    from hf_mhce.rbe.data import load_texts

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("not data")
    with pytest.raises(ValueError, match="is a directory but neither a saved dataset .* nor a folder of data files"):
        load_texts(str(tmp_path / "notes"))
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("one line\nanother line\n")
    assert load_texts(str(tmp_path / "texts"), split="train")["text"] == ["one line\nanother line\n"]  # a document


def test_evaluate_bare_token_id_rows():
    """"A dataset of token ids": a [B, T] tensor and a list of id lists are rows of input_ids too;
    what is not token ids is named."""
    model = tiny_gpt2()
    ids = torch.randint(0, VOCAB, (5, 11), generator=torch.Generator().manual_seed(4))
    want = evaluate(model, [{"input_ids": r} for r in ids]).decomposition.cross_entropy
    for data in (ids, ids.tolist(), list(ids)):
        assert evaluate(model, data).decomposition.cross_entropy == pytest.approx(want, rel=1e-6)
    _check_against_reference(evaluate(model, ids), model, [{"input_ids": r.tolist()} for r in ids])
    with pytest.raises(TypeError, match="tokenize text first"):
        evaluate(model, ["some text", "more text"])
    with pytest.raises(ValueError, match="'input_ids' entry"):
        evaluate(model, [{"text": "hello"}])


def test_what_is_not_a_model_batches_of_dicts_or_its_token_ids_is_named():
    """A hub id given as the model, a DataLoader of tensors (not dicts) and token ids outside the embedding
    failed deep inside torch (AttributeError on .parameters / .items, the embedding's IndexError)."""
    model = tiny_gpt2()
    ids = torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(5))
    for wrong in ("gpt2", None):
        with pytest.raises(TypeError, match="evaluate expects the model .* hf_mhce.from_pretrained"):
            evaluate(wrong, ids)
    with pytest.raises(TypeError, match="the DataLoader gave a (list|Tensor) batch: evaluate reads dicts"):
        evaluate(model, DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2))
    for bad in (VOCAB, -2):
        rows = ids.clone()
        rows[3, 4] = bad
        with pytest.raises(ValueError, match=f"batch 1 holds token id {bad}, outside the model's input embedding "
                                             rf"\[0, {VOCAB}\)"):
            evaluate(model, rows, batch_size=2)
    assert model.training  # restored after the refusal


def test_numpy_rows_and_misaligned_rows():
    """Integer numpy rows are token ids (they were refused as not "sequences of token ids"); float ones are
    refused; labels or a mask not one per input id are named by their row's index in the data (they failed
    in pad_collate with a bare RuntimeError), before the model runs on that row's batch."""
    import numpy as np

    model = tiny_gpt2()
    ids = np.random.default_rng(4).integers(0, VOCAB, (5, 11))
    want = evaluate(model, torch.as_tensor(ids)).decomposition.cross_entropy
    for data in (ids, list(ids), ids.astype(np.int32), [{"input_ids": r, "labels": r} for r in ids]):
        assert evaluate(model, data).decomposition.cross_entropy == pytest.approx(want, rel=1e-6)
    with pytest.raises(TypeError, match="row 0 .* must be a 1-D sequence of integer token ids.* ndarray of float64"):
        evaluate(model, ids.astype(np.float64))
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    rows = [{"input_ids": [1, 2, 3, 4]}] * 3
    with pytest.raises(ValueError, match="row 2 has 2 labels for 4 input_ids"):
        evaluate(model, rows[:2] + [{"input_ids": [1, 2, 3, 4], "labels": [1, 2]}], batch_size=4)
    with pytest.raises(ValueError, match="row 1 has 5 attention_mask for 4 input_ids"):
        evaluate(model, rows[:1] + [{"input_ids": [1, 2, 3, 4], "attention_mask": [1] * 5}], batch_size=4)
    assert not calls
    with pytest.raises(ValueError, match="row 2 has 2 labels"):  # a later batch: its index in data still
        evaluate(model, rows[:2] + [{"input_ids": [1, 2, 3, 4], "labels": [1, 2]}], batch_size=1)


def test_rows_with_their_own_attention_mask():
    """Rows padded by the tokenizer (padding="max_length") carry an attention_mask: the padding is no
    target, as with a DataLoader over the same rows (it used to be counted: 33 tokens for 15)."""
    model = tiny_gpt2()
    g = torch.Generator().manual_seed(7)
    rows, real = [], []
    for length in (5, 9, 3):
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        real.append({"input_ids": ids})
        rows.append({"input_ids": ids + [0] * (12 - length), "attention_mask": [1] * length + [0] * (12 - length)})
    report = evaluate(model, rows)
    assert report.decomposition.num_tokens == (5 - 1) + (9 - 1) + (3 - 1)
    nll, ranks, _ = reference_token_stats(model, real)
    assert report.decomposition.cross_entropy == pytest.approx(nll.mean().item(), rel=1e-5)
    assert torch.equal(report.stats.counts, rank_histogram(ranks, report.stats.vocab_size).to(report.stats.counts.dtype))
    batch = pad_collate(rows)
    assert (batch["labels"] == -100).sum() == 3 * 12 - 17 and torch.equal(batch["attention_mask"].sum(1), torch.tensor([5, 9, 3]))


def test_left_padded_rows_count_what_the_unpadded_rows_count():
    """Left padding (a tokenizer's padding_side="left"): the first real token follows a padding position,
    which predicts nothing; it used to be a target (14 tokens for 13, and a different decomposition)."""
    from rbe_helpers import make_model

    model = make_model("llama").eval()  # rotary positions: a left-padded row computes what the unpadded one does
    g = torch.Generator().manual_seed(4)
    real = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (6, 9)]
    padded = [{"input_ids": [0] * 3 + real[0], "attention_mask": [0] * 3 + [1] * 6}, real[1]]
    want = evaluate(model, real).decomposition
    assert want.num_tokens == 5 + 8
    loader = DataLoader(padded, batch_size=2, collate_fn=lambda rows: {
        k: v for k, v in pad_collate(rows).items() if k != "labels"})  # labels made by evaluate from the mask
    for got in (evaluate(model, padded).decomposition, evaluate(model, loader).decomposition):
        assert got.num_tokens == want.num_tokens
        for k in METRICS:
            assert getattr(got, k) == pytest.approx(getattr(want, k), rel=1e-5, abs=1e-6), k


@pytest.mark.parametrize("labels", [True, False])
def test_packed_rows_count_what_the_rows_alone_count(labels):
    """Sequences packed in a row (DataCollatorWithFlattening: position_ids restart at 0), as separate rows:
    evaluated with a cache, transformers let them attend to one another (CE 5.041 for 5.029), and without
    labels the first token of each sequence was a target of the sequence before (15 tokens for 13)."""
    from rbe_helpers import make_model
    from transformers import DataCollatorWithFlattening

    model = make_model("llama").eval()
    assert model.config.use_cache
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (5, 4, 7)]
    flatten = DataCollatorWithFlattening()
    loader = DataLoader([{"input_ids": s} for s in seqs], batch_size=3, collate_fn=lambda rows: {
        k: v for k, v in flatten(rows).items() if labels or k != "labels"})
    want, got = evaluate(model, seqs).decomposition, evaluate(model, loader).decomposition
    assert got.num_tokens == want.num_tokens == 4 + 3 + 6
    for k in METRICS:
        assert getattr(got, k) == pytest.approx(getattr(want, k), rel=1e-5, abs=1e-6), k


def test_rows_with_position_ids_are_refused():
    """A packed row given as a row: its position_ids were dropped by the padding, so the sequences were
    read as one (15 targets for 13, attending across sequences)."""
    model = tiny_gpt2()
    with pytest.raises(ValueError, match="row 1 has position_ids"):
        evaluate(model, [[1, 2, 3], {"input_ids": [1, 2, 3, 4, 5], "position_ids": [0, 1, 0, 1, 2]}])
