"""What the `hf-mhce rbe` input tests share: tiny checkpoints (a session fixture, in conftest.py), the
evaluation text, and how to run or refuse the command."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

from hf_mhce.cli import main  # noqa: E402
from hf_mhce.train import corpus  # noqa: E402

POSITIONS = 32
TEXT = "the cat sat on the mat\nthe dog sat on the log\n\na cat and a dog met on the mat\n" * 4


def build_checkpoints(tmp_path_factory):
    """Tiny checkpoints (GPT-2 with 32 positions, Llama, a Llama classifier, a LoRA adapter), with and
    without tokenizer files, and the evaluation text."""
    root = tmp_path_factory.mktemp("rbe_inputs")
    tok = corpus.train_tokenizer(corpus.embedded_texts()[0][:8] + [TEXT], vocab_size=300)
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=POSITIONS,
                                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id))
    for name, with_tok in (("gpt2", True), ("gpt2_notok", False)):
        gpt2.save_pretrained(root / name)
        if with_tok:
            tok.save_pretrained(root / name)
    llama = {"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    LlamaForCausalLM(LlamaConfig(**llama)).save_pretrained(root / "llama_notok")
    LlamaForSequenceClassification(LlamaConfig(**llama, num_labels=3, pad_token_id=0)).save_pretrained(root / "seqcls")
    tok.save_pretrained(root / "seqcls")
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(GPT2LMHeadModel.from_pretrained(root / "gpt2"),
                          LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False))
    lora.save_pretrained(root / "adapter_notok")  # records the base's path, saves no tokenizer
    get_peft_model(GPT2LMHeadModel.from_pretrained(root / "gpt2_notok"),
                   LoraConfig(r=4, target_modules=["c_attn"])).save_pretrained(root / "adapter_bare")
    (root / "c.txt").write_text(TEXT)
    return root, tok


def run_rbe(*argv, tmp_path):
    out = tmp_path / "report.json"
    assert main(["rbe", *map(str, argv), "--no-progress", "--device", "cpu", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def refused(*argv, capsys) -> str:
    """The message of a refusal, on stderr as argparse's usage errors, with their exit status 2 (a refusal of
    the checkpoint or the data exited 1 with the bare message, where hf-mhce train's exit 2)."""
    with pytest.raises(SystemExit) as info:
        main(["rbe", *map(str, argv), "--no-progress", "--device", "cpu"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "hf-mhce rbe: error: " in err and "hf-mhce rbe: hf-mhce rbe" not in err, err
    return err


def text_stream(tok, text=TEXT):
    """What `hf-mhce rbe` evaluates of a text file: the file as one document, then EOS (no BOS: this
    tokenizer adds none)."""
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


@torch.no_grad()
def reference_ce(model, rows):
    """Token-weighted mean of transformers' own loss, one unpadded row at a time."""
    model.eval()
    total = count = 0.0
    for ids in rows:
        ids = torch.tensor([ids])
        total += model(input_ids=ids, labels=ids).loss.item() * (ids.shape[1] - 1)
        count += ids.shape[1] - 1
    return total / count, int(count)
