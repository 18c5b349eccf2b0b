"""``hf-mhce train``: Trainer + apply_patch (+ LoRA) + RBECallback on the embedded corpus or real data.

Writes to ``output_dir``: the model (with its hf_mhce loss config and card), the tokenizer,
``metrics.json`` (final evaluation, training summary, RBE history) and the RBE plots.
"""

from __future__ import annotations

import json
import math
import os
import time

import torch

from .. import patching
from ..rbe import RBECallback
from . import corpus
from .arguments import check_arguments, fuse_label_smoothing, requested_loss


def build_tokenizer(model_args, texts):
    from transformers import AutoTokenizer

    source = model_args.tokenizer or model_args.model
    if source:
        tok = AutoTokenizer.from_pretrained(source)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return tok
    return corpus.train_tokenizer(texts, model_args.vocab_size)


def build_model(model_args, loss_args, tokenizer):
    """A pretrained checkpoint (loss config restored) or a small random Llama, then patched."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if model_args.model:
        model = patching.from_pretrained(model_args.model)
    else:
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=model_args.hidden_size,
            intermediate_size=model_args.intermediate_size, num_hidden_layers=model_args.num_hidden_layers,
            num_attention_heads=model_args.num_attention_heads, num_key_value_heads=model_args.num_attention_heads,
            max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(config)
    loss, num_heads = requested_loss(model_args, loss_args)
    try:
        return patching.apply_patch(model, loss=loss, num_heads=num_heads, override_saved=loss_args.override_saved,
                                    label_smoothing=loss_args.label_smoothing, z_loss=loss_args.z_loss)
    except patching.SavedLossMismatchError as err:
        hint = "hf-mhce train: --override_saved, or leave out --loss / --num_heads to keep the checkpoint's"
        raise patching.SavedLossMismatchError(f"{err} ({hint})") from None


def add_lora(model, lora_args):
    if lora_args.lora_r <= 0:
        return model
    from peft import LoraConfig, get_peft_model

    targets = lora_args.lora_target_modules
    targets = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    config = LoraConfig(r=lora_args.lora_r, lora_alpha=lora_args.lora_alpha, lora_dropout=lora_args.lora_dropout,
                        target_modules=targets, task_type="CAUSAL_LM")
    # patched again as a PeftModel (same config), so that saving the adapter writes hf_mhce.json
    return patching.apply_patch(get_peft_model(model, config))


def build_datasets(data_args):
    """(train texts, {eval name: texts}) from the embedded corpus or a real dataset."""
    if data_args.dataset is None:
        train, held_out = corpus.embedded_texts()
        return train, {"docs": held_out, "code": corpus.stdlib_code_texts()}
    from ..rbe.data import load_texts

    train_ds = load_texts(data_args.dataset, data_args.train_split, data_args.dataset_config)
    if data_args.text_column not in train_ds.column_names:
        raise ValueError(f"no column {data_args.text_column!r} in {data_args.dataset!r} "
                         f"(columns: {train_ds.column_names}); use --text_column")
    train = [t for t in train_ds[data_args.text_column] if t]
    try:
        eval_ds = load_texts(data_args.dataset, data_args.eval_split, data_args.dataset_config)
        held_out = [t for t in eval_ds[data_args.text_column] if t]
        if eval_ds.num_rows == train_ds.num_rows and held_out == train:
            raise ValueError  # a single file: no separate split
    except (ValueError, KeyError):
        cut = max(1, int(len(train) * (1 - data_args.eval_fraction)))
        train, held_out = train[:cut], train[cut:]
    return train, {"eval": held_out}


def run(model_args, data_args, loss_args, lora_args, training_args) -> dict:
    from transformers import Trainer, default_data_collator, set_seed

    started = time.time()
    check_arguments(model_args, loss_args, lora_args)
    fuse_label_smoothing(loss_args, training_args)
    set_seed(training_args.seed)
    train_texts, eval_texts = build_datasets(data_args)
    tokenizer = build_tokenizer(model_args, train_texts)
    block = data_args.block_size
    train_ds = corpus.lm_dataset(corpus.token_blocks(train_texts, tokenizer, block, data_args.max_train_blocks))
    eval_ds = {name: corpus.lm_dataset(corpus.token_blocks(texts, tokenizer, block, data_args.max_eval_blocks))
               for name, texts in eval_texts.items()}
    model = add_lora(build_model(model_args, loss_args, tokenizer), lora_args)
    n_params = sum(p.numel() for p in model.parameters())
    rbe = RBECallback(plot=loss_args.rbe_plots)
    trainer = Trainer(model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds,
                      data_collator=default_data_collator, processing_class=tokenizer, callbacks=[rbe])
    train_output = trainer.train()
    final = trainer.evaluate()
    trainer.save_model(training_args.output_dir)
    tokenizer.save_pretrained(training_args.output_dir)
    sample = generate_sample(trainer.model, tokenizer, loss_args.sample_prompt, loss_args.sample_tokens)
    summary = {
        **{k: model.config.hf_mhce[k] for k in ("loss", "num_heads")},  # as patched (a PeftModel reads its base's)
        "parameters": n_params, "train_tokens": len(train_ds) * block, "train": train_output.metrics,
        "final_eval": final, "rbe_history": rbe.history, "sample": sample,
        "wall_seconds": round(time.time() - started, 1),
    }
    if trainer.is_world_process_zero():
        with open(os.path.join(training_args.output_dir, "metrics.json"), "w") as f:
            json.dump(summary, f, indent=2, default=float)
        print(summary_table(summary, list(eval_ds)))
    rbe.close()
    return summary


def end_distributed() -> None:
    """At the end of a launched script (``accelerate launch``, ``torchrun``): meet the other
    processes, then shut the process group down here rather than in the interpreter's exit-time
    destructors, where gloo's threads now and then abort the process that finishes first
    ("terminate called without an active exception", SIGABRT).  A no-op in a single process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@torch.no_grad()
def generate_sample(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Greedy continuation (for MHCE models the mixture's log-probs drive generation)."""
    model.eval()
    device = next(model.parameters()).device
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def summary_table(summary: dict, eval_names: list[str]) -> str:
    final = summary["final_eval"]
    heads = f" (H={summary['num_heads']})" if summary["loss"] == "mhce" else ""
    lines = [f"\nhf-mhce train: {summary['loss']}{heads}, {summary['parameters'] / 1e6:.2f}M parameters, "
             f"{summary['train_tokens']} training tokens, {summary['wall_seconds']:.0f} s",
             f"{'eval set':<10}{'loss':>9}{'ppl':>10}{'Err-Ent':>9}{'Self-Al':>9}{'Conf':>9}{'top-1':>8}"]
    for name in eval_names:
        p = f"eval_{name}"
        loss = final.get(f"{p}_loss", float("nan"))
        lines.append(f"{name:<10}{loss:>9.4f}{math.exp(loss):>10.2f}{final.get(f'{p}_rbe_error_entropy', float('nan')):>9.4f}"
                     f"{final.get(f'{p}_rbe_self_alignment', float('nan')):>9.4f}"
                     f"{final.get(f'{p}_rbe_confidence', float('nan')):>9.4f}{final.get(f'{p}_rbe_top1', float('nan')):>8.3f}")
    lines.append("loss = Error-Entropy + Self-Alignment - Confidence (nats, RBE decomposition)")
    lines.append(f"sample: {summary['sample']!r}")
    return "\n".join(lines)
