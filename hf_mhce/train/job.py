"""``hf-mhce train``: Trainer + apply_patch (+ LoRA) + RBECallback on the embedded corpus or real data.

Writes to ``output_dir``: the model (with its hf_mhce loss config and card), the tokenizer,
``metrics.json`` (final evaluation, training summary, RBE history) and the RBE plots.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
import warnings

import torch

from .. import patching
from ..rbe import RBECallback
from . import corpus
from .arguments import (TRUST_REMOTE_CODE, DataArguments, adapter_to_train, check_arguments, check_schedule, explained,
                        fuse_label_smoothing, loss_options, requested_loss)

DEFAULT_EVAL_SPLIT = DataArguments.eval_split
# what a save leaves in output_dir: a full model, or a PEFT adapter (with hf_mhce's record beside it)
_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin")
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "hf_mhce.json")


def build_tokenizer(model_args, texts, config=None, resume: str | None = None):
    """--tokenizer, else --model's (an adapter's base model's), else the one saved in the checkpoint ``resume``
    (its weights embed that one's ids: a BPE trained again would renumber them), else a BPE trained on
    ``texts``; checked against the vocabulary of --model's ``config``."""
    from ..rbe.data import has_tokenizer_files, load_tokenizer, remote_code_option

    if not (model_args.tokenizer or model_args.model):
        if resume and has_tokenizer_files(resume):
            return load_tokenizer(resume, None, False)[0]
        return corpus.train_tokenizer(texts, model_args.vocab_size)
    with remote_code_option(TRUST_REMOTE_CODE):
        tok, source = load_tokenizer(model_args.tokenizer, model_args.model, model_args.trust_remote_code)
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and len(tok) > vocab:
        raise ValueError(f"the tokenizer from {source} has {len(tok)} tokens but {model_args.model} embeds {vocab}: "
                         "it is not the model's tokenizer (pass that one with --tokenizer)")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def best_by_first_eval_loss(training_args, eval_names: list[str]) -> None:
    """--load_best_model_at_end compares TrainingArguments' default metric "loss", but with a dict of eval sets
    the Trainer logs ``eval_<set>_loss`` (a KeyError at the first save, after training): "loss" is read as the
    first eval set's."""
    if training_args.metric_for_best_model in ("loss", "eval_loss") and eval_names:
        training_args.metric_for_best_model = f"eval_{eval_names[0]}_loss"


def build_model(model_args, loss_args, lora_args, tokenizer, saved=None):
    """A pretrained checkpoint or a small random Llama, patched with the requested loss (``saved``: the
    loss config the checkpoint records, see arguments.requested_loss)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..rbe.data import remote_code_option

    loss, num_heads = requested_loss(loss_args, saved)
    options = dict(loss=loss, num_heads=num_heads, override_saved=loss_args.override_saved, **loss_options(loss_args))
    if model_args.model:  # patched as it loads: no interim record a requested loss would have to override
        if adapter_to_train(model_args, lora_args):
            options["is_trainable"] = True
        # a local checkpoint by its absolute path: an adapter records it as its base, to load from anywhere
        source = os.path.abspath(model_args.model) if os.path.isdir(model_args.model) else model_args.model
        with remote_code_option(TRUST_REMOTE_CODE):
            return explained(patching.from_pretrained, source, trust_remote_code=model_args.trust_remote_code,
                             **options)
    else:
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=model_args.hidden_size,
            intermediate_size=model_args.intermediate_size, num_hidden_layers=model_args.num_hidden_layers,
            num_attention_heads=model_args.num_attention_heads, num_key_value_heads=model_args.num_attention_heads,
            max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
        )
        return explained(patching.apply_patch, LlamaForCausalLM(config), **options)


def add_lora(model, lora_args):
    if lora_args.lora_r <= 0:
        return model
    # patched again as a PeftModel (same config), so that saving the adapter writes hf_mhce.json
    return patching.apply_patch(lora_model(model, lora_args))


def lora_model(model, lora_args):
    """``model`` with a new LoRA adapter of --lora_r etc. (a PeftModel); --lora_target_modules None: PEFT's
    default modules for the architecture."""
    from peft import LoraConfig, get_peft_model

    given = lora_args.lora_target_modules
    targets = given if given in (None, "all-linear") else [t.strip() for t in given.split(",") if t.strip()]
    config = LoraConfig(r=lora_args.lora_r, lora_alpha=lora_args.lora_alpha, lora_dropout=lora_args.lora_dropout,
                        target_modules=targets, task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as err:  # no such module, or none given: PEFT's message does not name the option
        raise ValueError(f"--lora_target_modules {given!r}: {err}") from None


def count_shifted_targets(model) -> None:
    """Have the Trainer count a causal LM's targets as its loss does: for a model without a loss_type (GPT-2's,
    remote code) it counts labels[:, 0], never a target, and divides the summed loss by T of T - 1 per row."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base, "loss_type", None) is None:
        base.loss_type = "ForCausalLM"


def parameter_count(model, trainable: bool = False) -> int:
    """Parameters of ``model`` (only those with requires_grad if ``trainable``), ZeRO-3's partitioned ones whole."""
    return sum(getattr(p, "ds_numel", None) or p.numel() for p in model.parameters() if p.requires_grad or not trainable)


def build_datasets(data_args):
    """(train texts, {eval name: texts}) from the embedded corpus or a real dataset."""
    if data_args.dataset is None:
        train, held_out = corpus.embedded_texts()
        return train, {"docs": held_out, "code": corpus.stdlib_code_texts()}
    from ..rbe.data import DataError, column_texts, load_texts

    train_ds = load_texts(data_args.dataset, data_args.train_split, data_args.dataset_config, "--train_split")
    train = column_texts(train_ds, data_args.text_column, "--text_column")
    if not train:
        raise DataError(f"no text in column {data_args.text_column!r} of {data_args.dataset!r}: every row is empty "
                        "or blank")
    try:
        eval_ds = load_texts(data_args.dataset, data_args.eval_split, data_args.dataset_config, "--eval_split")
    except DataError:
        if data_args.eval_split != DEFAULT_EVAL_SPLIT:  # asked for by name: a misspelling must not pass silently
            raise
        eval_ds = None  # no such split (a single file, say): hold out a share of the training text
    held_out = None if eval_ds is None else column_texts(eval_ds, data_args.text_column, "--text_column")
    if held_out is None or (eval_ds.num_rows == train_ds.num_rows and held_out == train):
        train, held_out = hold_out(train, data_args.eval_fraction)
        return train, {"held_out": held_out}
    return train, {eval_set_name(data_args.eval_split): held_out}


def eval_set_name(split: str) -> str:
    """The eval set's name, which the Trainer puts in its metrics (eval_<name>_loss): the split's, in word
    characters ("validation[:10%]" -> validation_10), prefixed with "eval" where it does not start with a letter."""
    name = re.sub(r"\W+", "_", split).strip("_")
    return name if name[:1].isalpha() else "_".join(filter(None, ("eval", name)))


def hold_out(texts: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """(train, held out): the last ``fraction`` of the texts; a single one (a text file is one document)
    is cut at the first line break after that share of its characters."""
    if len(texts) > 1:
        cut = max(1, int(len(texts) * (1 - fraction)))
        return texts[:cut], texts[cut:]
    if not texts:
        return [], []
    text = texts[0]
    cut = int(len(text) * (1 - fraction))
    line = text.find("\n", cut)
    if 0 <= line < len(text) - 1:  # else no line break before the end: cut inside the line
        cut = line + 1
    return [text[:cut]], [text[cut:]]


def clear_previous_save(directory: str, adapter: bool) -> None:
    """Remove what a previous run saved in ``directory`` that this save would not overwrite: a full
    model beside a new adapter, or an adapter (its hf_mhce.json, PEFT's card) beside a new full model,
    which from_pretrained of the directory would load instead.  Only files such saves write."""
    stale = _MODEL_FILES if adapter else _ADAPTER_FILES
    for name in stale:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            os.remove(path)
    card = os.path.join(directory, "README.md")
    if not adapter and os.path.isfile(card) and "library_name: peft" in open(card, encoding="utf-8").read():
        os.remove(card)  # PEFT's card of the old adapter (the hf_mhce section is rewritten on save)


def final_evaluation(trainer, names: list[str], rbe_history: list[dict]) -> dict:
    """The evaluation of the trained model: the one this run's schedule ran at the last step when it covered
    every eval set (the default 600 steps end on an evaluation; running it again would cost a pass and
    repeat its rows in the RBE history), else a new one (also after resuming a finished run, whose
    evaluations this process did not see).  Histories are the same on every process, so they all take
    the same branch of this collective."""
    state = trainer.state
    if not trainer.args.load_best_model_at_end:  # else the weights are not those the last evaluation saw
        found = {}
        for entry in state.log_history:
            if entry.get("step") == state.global_step:
                found.update({k: v for k, v in entry.items() if k.startswith("eval_") or k == "epoch"})
        seen = {row["prefix"] for row in rbe_history if row["step"] == state.global_step}
        if all(f"eval_{name}_loss" in found and f"eval_{name}" in seen for name in names):
            return found
    return trainer.evaluate()


def run(model_args, data_args, loss_args, lora_args, training_args) -> dict:
    """The job on parsed options (``hf_mhce.train.parse``): check them, read the data, build or load the model,
    train with RBECallback, evaluate, save the model, tokenizer and metrics.json to --output_dir; returns the
    summary ``main`` documents."""
    from transformers import Trainer, default_data_collator, set_seed

    started = time.time()
    with refusing():
        check_schedule(training_args)
        fuse_label_smoothing(loss_args, training_args)  # first: the fused value is checked with the others
        saved, config = check_arguments(model_args, data_args, loss_args, lora_args, training_args.resume_from_checkpoint)
        set_seed(training_args.seed)
        train_texts, eval_texts = build_datasets(data_args)
        tokenizer = build_tokenizer(model_args, train_texts, config, training_args.resume_from_checkpoint)
        best_by_first_eval_loss(training_args, list(eval_texts))
        block = data_args.block_size
        train_ds = corpus.lm_dataset(corpus.token_blocks(train_texts, tokenizer, block, data_args.max_train_blocks),
                                     "the training set")
        eval_ds = {name: corpus.lm_dataset(corpus.token_blocks(texts, tokenizer, block, data_args.max_eval_blocks),
                                           f"eval set {name!r}") for name, texts in eval_texts.items()}
        model = add_lora(build_model(model_args, loss_args, lora_args, tokenizer, saved), lora_args)
        count_shifted_targets(model)
        n_params = parameter_count(model)
        rbe = RBECallback(plot=loss_args.rbe_plots)
        trainer = Trainer(model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds,
                          data_collator=default_data_collator, processing_class=tokenizer, callbacks=[rbe])
    train_output = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    final = final_evaluation(trainer, list(eval_ds), rbe.history)
    if trainer.is_world_process_zero():
        clear_previous_save(training_args.output_dir, adapter=hasattr(trainer.model, "peft_config"))
    trainer.save_model(training_args.output_dir)
    tokenizer.save_pretrained(training_args.output_dir)
    sample = sample_error = None
    if loss_args.sample_tokens:
        try:
            sample = generate_sample(trainer.model, tokenizer, loss_args.sample_prompt, loss_args.sample_tokens)
        except Exception as err:  # noqa: BLE001 - the model is saved: keep the metrics, say what failed
            sample_error = f"{type(err).__name__}: {err}"
            warnings.warn(f"hf-mhce train: the model is trained and saved, but generating the sample failed "
                          f"({sample_error}); metrics.json records it. --sample_tokens 0 skips the sample.")
    summary = {
        **{k: model.config.hf_mhce[k] for k in ("loss", "num_heads")},  # as patched (a PeftModel reads its base's)
        "parameters": n_params, "train_tokens": len(train_ds) * block, "train": train_output.metrics,
        "final_eval": final, "rbe_history": rbe.history, "sample": sample,
        **({"sample_error": sample_error} if sample_error else {}),
        "wall_seconds": round(time.time() - started, 1),
    }
    if trainer.is_world_process_zero():
        with open(os.path.join(training_args.output_dir, "metrics.json"), "w") as f:
            json.dump(summary, f, indent=2, default=float)
        print(summary_table(summary, list(eval_ds)))
    rbe.close()
    return summary


_REFUSED = "hf_mhce_refused"  # set on a ValueError raised before training starts


@contextlib.contextmanager
def refusing():
    """Around everything before the first training step: a ValueError raised there refuses the options
    or the data, which the command line prints as a usage error (``refused``); one raised later (a
    failure of training itself) keeps its traceback."""
    try:
        yield
    except ValueError as err:
        setattr(err, _REFUSED, True)
        raise


def refused(err: BaseException) -> bool:
    """Whether ``err`` is a refusal of the options or the data (see ``refusing``)."""
    return getattr(err, _REFUSED, False)


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
    from ..rbe.data import bos_prefix

    # the prompt starts as the training documents do (token_stream): with BOS where the tokenizer adds one
    ids = torch.tensor([bos_prefix(tokenizer) + tokenizer(prompt, add_special_tokens=False)["input_ids"]], device=device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def summary_table(summary: dict, eval_names: list[str]) -> str:
    final = summary["final_eval"]
    heads = f" (H={summary['num_heads']})" if summary["loss"] == "mhce" else ""
    lines = [f"\nhf-mhce train: {summary['loss']}{heads}, {summary['parameters'] / 1e6:.2f}M parameters, "
             f"{summary['train_tokens']} training tokens, {summary['wall_seconds']:.0f} s",
             f"{'eval set':<10}{'CE':>9}{'ppl':>10}{'Err-Ent':>9}{'Self-Al':>9}{'Conf':>9}{'top-1':>8}"]
    for name in eval_names:
        p = f"eval_{name}"
        # the cross-entropy itself: eval_loss is the training objective (label smoothing, z-loss included)
        loss = final.get(f"{p}_rbe_cross_entropy", final.get(f"{p}_loss", float("nan")))
        lines.append(f"{name:<10}{loss:>9.4f}{math.exp(loss):>10.2f}{final.get(f'{p}_rbe_error_entropy', float('nan')):>9.4f}"
                     f"{final.get(f'{p}_rbe_self_alignment', float('nan')):>9.4f}"
                     f"{final.get(f'{p}_rbe_confidence', float('nan')):>9.4f}{final.get(f'{p}_rbe_top1', float('nan')):>8.3f}")
    lines.append("CE = Error-Entropy + Self-Alignment - Confidence (nats, RBE decomposition)")
    if summary["sample"] is not None:
        lines.append(f"sample: {summary['sample']!r}")
    return "\n".join(lines)
