"""Training data: the embedded corpus (no downloads), a BPE tokenizer trained on it, and fixed-size
token blocks for causal language modelling.

The embedded corpus is the text of Python's documentation shipped with every CPython
(``pydoc_data.topics``, ~80 topics, ~0.5 MB): topics are split into training and held-out
evaluation topics.  A second, out-of-domain evaluation set is Python source code of a few standard
library modules, so that the RBE metrics of two evaluation sets can be compared.
"""

from __future__ import annotations

import importlib
import inspect

from ..rbe.data import token_stream

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS]  # added to the BPE beside its 256 byte tokens
_CODE_MODULES = ("textwrap", "string", "json.decoder", "json.encoder", "shlex", "fnmatch")


def embedded_texts(eval_every: int = 8) -> tuple[list[str], list[str]]:
    """(train, eval) texts of pydoc's topics; every ``eval_every``-th topic (sorted) is held out."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    train = [topics[n] for i, n in enumerate(names) if i % eval_every]
    held_out = [topics[n] for i, n in enumerate(names) if not i % eval_every]
    return train, held_out


def stdlib_code_texts() -> list[str]:
    """Source code of a few pure-Python standard library modules (out-of-domain evaluation)."""
    return [inspect.getsource(importlib.import_module(name)) for name in _CODE_MODULES]


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """A byte-level BPE tokenizer trained on ``texts`` (transformers' fast tokenizer, EOS = PAD)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=EOS)


def token_blocks(texts: list[str], tokenizer, block_size: int, max_blocks: int | None = None) -> list[list[int]]:
    """Texts joined as rbe.data.token_stream joins them (each with BOS where the tokenizer adds one, then
    EOS) and cut into full blocks of ``block_size`` tokens (the tail is dropped)."""
    stream = token_stream(texts, tokenizer)
    blocks = [stream[i:i + block_size] for i in range(0, len(stream) - block_size + 1, block_size)]
    return blocks[:max_blocks] if max_blocks is not None else blocks


def lm_dataset(blocks: list[list[int]], what: str = "the data"):
    """A datasets.Dataset of equal-length blocks with labels = input_ids (transformers shifts)."""
    from datasets import Dataset

    if not blocks:
        raise ValueError(f"{what} has no full block of tokens: lower --block_size or provide more text")
    return Dataset.from_dict({"input_ids": blocks, "labels": [list(b) for b in blocks]})
