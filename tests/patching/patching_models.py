"""Tiny random causal LMs built from configs (no downloads) and small helpers for the patching tests."""

from __future__ import annotations

import copy

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

VOCAB = 97
HIDDEN = 32


def make_model(family: str, *, tied: bool = False, vocab: int = VOCAB, hidden: int = HIDDEN, seed: int = 0):
    torch.manual_seed(seed)
    if family == "gpt2":  # GPT-2 ties its head to the input embedding by default
        config = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=2, n_head=4, n_positions=64,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(config)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=tied)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    if family == "mistral":
        return MistralForCausalLM(MistralConfig(sliding_window=8, **common))
    raise ValueError(family)


FAMILIES = ["llama", "mistral", "gpt2"]


def saved_base(tmp_path, family: str = "llama"):
    """A base checkpoint on disk, loaded back, so that an adapter records where its base is."""
    from transformers import AutoModelForCausalLM

    make_model(family).save_pretrained(tmp_path / "base")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "base")


def batch(batch_size: int = 2, seq: int = 12, vocab: int = VOCAB, seed: int = 1, pad_first: int = 3):
    """input_ids and labels with the first ``pad_first`` labels of row 0 ignored."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq), generator=g)
    labels = ids.clone()
    labels[0, :pad_first] = -100
    return ids, labels


def twin(model):
    """An independent copy (same weights) to compare patched against unpatched."""
    return copy.deepcopy(model)


def with_lora(model, config, *, seed=1, std=0.1, **peft_kw):
    """``get_peft_model(model, config)`` (seeded unless ``seed`` is None) with every lora_B weight (and bias)
    drawn from N(0, std): PEFT starts B at zero, where the adapter's terms and the A gradients vanish."""
    from peft import get_peft_model

    if seed is not None:
        torch.manual_seed(seed)
    peft_model = get_peft_model(model, config, **peft_kw)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, std)
    return peft_model


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(ref: dict, got: dict, rtol: float = 1e-5):
    assert ref.keys() == got.keys(), (sorted(ref.keys() ^ got.keys()))
    for name in ref:
        scale = ref[name].abs().max().clamp_min(1e-12)
        torch.testing.assert_close(got[name], ref[name], rtol=rtol, atol=rtol * scale.item(), msg=lambda m: f"{name}: {m}")


def mixture_logprobs_reference(hidden, weight, num_heads, bias=None):
    """log pbar by the definition: log of the uniform mixture of the per-slice softmaxes (float64)."""
    x = hidden.double().unflatten(-1, (num_heads, -1))
    w = weight.double().unflatten(-1, (num_heads, -1))
    y = torch.einsum("...hd,vhd->...hv", x, w)
    if bias is not None:
        y = y + bias.double()
    return torch.logsumexp(torch.log_softmax(y, -1), dim=-2) - torch.log(torch.tensor(float(num_heads), dtype=torch.float64))


def token_dataset(n: int, seq: int = 16, vocab: int = VOCAB, seed: int = 0, ragged: bool = False):
    """A learnable toy corpus: each row counts up from a random start (mod vocab).  ``ragged`` masks a
    random-length prefix of the labels so that micro-batches hold different numbers of targets."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        start = int(torch.randint(0, vocab, (1,), generator=g))
        ids = (torch.arange(seq) + start) % vocab
        labels = ids.clone()
        if ragged:
            labels[: int(torch.randint(0, seq - 2, (1,), generator=g))] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def assert_step_equal(got: dict, ref: dict, what: str, rtol: float = 1e-5):
    """Loss and every gradient of one step (JSON lists) equal, and no reference gradient is zero."""
    assert abs(got["loss"] - ref["loss"]) <= rtol * abs(ref["loss"]), (what, got["loss"], ref["loss"])
    for name, values in ref["grads"].items():
        assert any(values), f"{what} {name}: zero reference gradient"
    as_tensors = lambda step: {n: torch.tensor(v, dtype=torch.float64) for n, v in step["grads"].items()}  # noqa: E731
    assert_grads_close(as_tensors(ref), as_tensors(got), rtol=rtol)
