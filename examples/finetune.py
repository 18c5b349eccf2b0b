"""Fine-tune a causal LM with hf_mhce: Trainer + apply_patch + optional LoRA + RBECallback.

    python examples/finetune.py --model path/or/hub-id --dataset NAME_OR_FILE --loss mhce --num_heads 4 \\
        --lora_r 8 --lora_target_modules all-linear --max_steps 500 --learning_rate 2e-4 --out outputs/ft
    accelerate launch examples/finetune.py --model ... (the same options; every process runs this script)
    python examples/finetune.py             # no --model: pretrain a small checkpoint first, then fine-tune it
    python examples/finetune.py --quick     # reduced size (what the test runs), same code path

--model: a local checkpoint directory or a hub id (``AutoModelForCausalLM.from_pretrained``; a
checkpoint saved by hf_mhce keeps its loss, e.g. an MHCE model its number of heads).  Without
--model, ``hf-mhce train`` (``hf_mhce.train.main``) first pretrains a small Llama on the embedded
corpus (Python's documentation, ``pydoc_data.topics``; sizes from --hidden_size etc., steps from
--pretrain_steps) into <out>/pretrained, and that checkpoint is fine-tuned.
--dataset: a datasets name (with --dataset_config, --train_split, --eval_split), a saved dataset
directory, or a .txt/.json/.jsonl/.csv/.parquet file (column --text_column); without an eval split
--eval_fraction of the texts is held out.  Without --dataset: Python source code of a few
standard-library modules (written to <out>/data/stdlib_code.jsonl; the last modules are held out),
i.e. the docs-pretrained model is adapted to code; its pretraining domain is evaluated too ("docs").
--loss ce|mhce and --num_heads: default: what the checkpoint records (a plain checkpoint: CE).
Changing the loss of an hf_mhce checkpoint needs --override_saved (its logits meant that loss).
--lora_r > 0: LoRA through PEFT (--lora_alpha, --lora_dropout, --lora_target_modules; "lm_head" in
the targets adapts the head, exactly, inside the fused loss); the adapter is saved to the output
directory and, with --merge_lora (default), a merged full model to <output_dir>/merged.
Every TrainingArguments option is accepted (--max_steps, --learning_rate, --bf16, --gradient_accumulation_steps,
--per_device_train_batch_size, --report_to, --seed, ...); they may also come from one .json / .yaml file
(``python examples/finetune.py options.yaml``).  A bad option is a usage error (exit status 2) before
anything is trained, as in ``hf-mhce train``.  The model goes to --output_dir (default
<out>/model) with its tokenizer and model card (the hf_mhce section: loss config, the final RBE table
and plots); <out> gets table.md, results.json and finetune.png: every eval set's loss and RBE
decomposition (CE = Error-Entropy + Self-Alignment - Confidence, nats) before and after fine-tuning.
The script places nothing on a device itself: Trainer/accelerate do, so ``accelerate launch`` (DDP)
works unchanged; files are written and results printed by the main process only.

Results on 2026-11-25, CPU (2 vCPUs), default configuration (``python examples/finetune.py``, 58 s on a
shared machine): a 1.48M-parameter Llama pretrained with MHCE (H=4) for 200 steps on the documentation,
then fully fine-tuned for 150 steps (lr 1e-3, cosine) on the source of 12 standard-library modules;
"code" is held-out module source, "docs" the pretraining domain (nats; ppl under the model's own mixture):

| eval set | when | loss | ppl | EE | SA | Conf | top-1 | tokens |
|---|---|---:|---:|---:|---:|---:|---:|---:|
| code | before | 7.028 | 1128.0 | 6.567 | 0.268 | -0.193 | 0.049 | 4032 |
| code | after | 6.319 | 554.9 | 5.979 | 0.164 | -0.176 | 0.059 | 4032 |
| docs | before | 6.191 | 488.5 | 5.824 | 0.156 | -0.212 | 0.102 | 4032 |
| docs | after | 6.476 | 649.3 | 6.092 | 0.198 | -0.185 | 0.066 | 4032 |

Adapting to code halves the code perplexity (-0.71 nats, of which Error-Entropy -0.59 and
Self-Alignment -0.10) and costs 0.29 nats on the documentation, mostly Error-Entropy (+0.27: top-1
falls from 0.102 to 0.066): the forgetting shows up as worse ranks, not as miscalibration.
(The 2026-11-24 run, 25 s on idle cores, named the code set "eval" and differed in the third decimal:
e.g. code before EE 6.553, docs before SA 0.148; same conclusions.)
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

from reporting import save_figure, write_report

from hf_mhce.train import DataArguments, LoraArguments, ModelArguments, TrainArguments
from hf_mhce.train import parse as parse_options
from hf_mhce.train.arguments import (adapter_to_train, check_data_options, check_lora_options, check_schedule,
                                     checkpoint_facts, fuse_label_smoothing, loss_options)
from hf_mhce.train.job import end_distributed, refused, refusing

# Pure-Python standard-library modules for the default fine-tuning data (none of them is in the
# embedded "code" evaluation set of hf_mhce.train.corpus).
CODE_MODULES = ("argparse", "calendar", "configparser", "csv", "dataclasses", "difflib", "fractions", "heapq",
                "ipaddress", "pprint", "statistics", "enum")
# --quick: what the test runs; options given on the command line still win.  Fine-tuning evaluates at
# the start, at its last step (each evaluation writes the RBE plots) and at the end.
DEFAULT_OUTPUT_DIR = "<out>/model"
QUICK_SIZES = ["--vocab_size", "300", "--hidden_size", "32", "--num_hidden_layers", "1", "--intermediate_size", "64"]
QUICK = ["--block_size", "32", "--max_train_blocks", "64", "--max_eval_blocks", "8", "--max_steps", "6",
         "--eval_steps", "6", "--logging_steps", "3", "--per_device_train_batch_size", "4",
         "--per_device_eval_batch_size", "4", "--pretrain_steps", "6", "--warmup_steps", "1"]


@dataclass
class ExampleArguments:
    out: str = field(default="outputs/finetune", metadata={"help": "where table.md, results.json, the plot go"})
    quick: bool = field(default=False, metadata={"help": "reduced size (the test), same code path"})
    pretrain_steps: int = field(default=200, metadata={"help": "steps of the pretraining run when no --model"})
    merge_lora: bool = field(default=True, metadata={"help": "with LoRA, also save a merged model to <output_dir>/merged"})


@dataclass
class FinetuneLossArguments:
    loss: str | None = field(default=None, metadata={"help": "ce or mhce; default: the checkpoint's (plain: ce)"})
    num_heads: int | None = field(default=None, metadata={"help": "MHCE heads; default: the checkpoint's"})
    override_saved: bool = field(default=False, metadata={
        "help": "allow a --loss/--num_heads different from the one an hf_mhce checkpoint records"})
    label_smoothing: float | None = field(default=None, metadata={"help": "default: the checkpoint's (plain: 0)"})
    z_loss: float | None = field(default=None, metadata={"help": "default: the checkpoint's (plain: 0)"})


@dataclass
class FinetuneTrainingArguments(TrainArguments):
    """hf-mhce train's TrainingArguments with fine-tuning defaults."""

    output_dir: str = field(default=DEFAULT_OUTPUT_DIR, metadata={"help": "where the model goes (default <out>/model)"})
    max_steps: int = 150
    learning_rate: float = 1e-3
    warmup_steps: int = 10
    eval_steps: int = 50
    logging_steps: int = 25


ARGUMENTS = (ExampleArguments, ModelArguments, DataArguments, FinetuneLossArguments, LoraArguments,
             FinetuneTrainingArguments)
PROG = "finetune.py"


def parse(argv: list[str]):
    """The dataclasses, as ``hf-mhce train`` parses (a bad option is a usage error, exit status 2; a
    single .json / .yaml file may hold the options); --quick puts QUICK (and QUICK_SIZES, without --model) before
    the command line."""
    # the sizes and --vocab_size size the pretraining without --model: unused only beside one
    args = parse_options(argv, ARGUMENTS, PROG, __doc__.split("\n")[0], notes=False)
    if args[0].quick:
        if len(argv) == 1 and not argv[0].startswith("--"):
            usage_error("--quick is a command-line option (it puts the reduced sizes before the others); "
                        "leave it out of the options file")
        sizes = [] if args[1].model else QUICK_SIZES  # the pretraining's model; a --model has its own
        args = parse_options(sizes + QUICK + argv, ARGUMENTS, PROG, __doc__.split("\n")[0], notes=False)  # later win
    if args[1].model:
        parse_options(argv, ARGUMENTS, PROG, __doc__.split("\n")[0])  # once, for the notes on what the user wrote
    if args[-1].output_dir == DEFAULT_OUTPUT_DIR:
        args[-1].output_dir = os.path.join(args[0].out, "model")
    return args


def check(example, model_args, data_args, loss_args, lora_args, training_args) -> None:
    """Refuse bad options before anything is trained, as hf-mhce train does (its schedule, LoRA and data
    checks; the model's are its own or the pretraining run's), and a pretraining of no steps."""
    check_schedule(training_args)
    check_lora_options(lora_args)
    check_data_options(data_args)
    if model_args.model is None and example.pretrain_steps < 1:
        raise ValueError(f"--pretrain_steps {example.pretrain_steps} must be at least 1 (without --model the "
                         "checkpoint to fine-tune is pretrained first)")
    if model_args.model is not None:
        checkpoint_facts(model_args.model, model_args.trust_remote_code)  # names a missing directory or a file


def usage_error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def pretrain(example, model_args, data_args, loss_args, training_args) -> tuple[str, dict]:
    """No --model: a small checkpoint from the main job (hf-mhce train) on the embedded corpus."""
    import hf_mhce.train

    path = os.path.join(example.out, "pretrained")
    loss = loss_args.loss or ("mhce" if loss_args.num_heads is None or loss_args.num_heads > 1 else "ce")
    heads = ["--num_heads", str(loss_args.num_heads or 4)] if loss == "mhce" else []
    argv = ["--output_dir", path, "--loss", loss, *heads,
            "--vocab_size", str(model_args.vocab_size), "--hidden_size", str(model_args.hidden_size),
            "--num_hidden_layers", str(model_args.num_hidden_layers),
            "--num_attention_heads", str(model_args.num_attention_heads),
            "--intermediate_size", str(model_args.intermediate_size), "--block_size", str(data_args.block_size),
            "--max_steps", str(example.pretrain_steps), "--eval_steps", str(max(1, example.pretrain_steps // 2)),
            "--logging_steps", str(training_args.logging_steps), "--seed", str(training_args.seed),
            "--per_device_train_batch_size", str(training_args.per_device_train_batch_size),
            "--per_device_eval_batch_size", str(training_args.per_device_eval_batch_size),
            "--report_to", "none", "--sample_tokens", "16"]
    if training_args.use_cpu:  # as the fine-tuning (under accelerate launch: one gloo DDP run, not one per process)
        argv.append("--use_cpu")
    for name in ("max_train_blocks", "max_eval_blocks"):
        if getattr(data_args, name) is not None:
            argv += [f"--{name}", str(getattr(data_args, name))]
    return path, hf_mhce.train.main(argv)


def write_code_dataset(out: str) -> str:
    import importlib
    import inspect

    path = os.path.join(out, "data", "stdlib_code.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for name in CODE_MODULES:
            f.write(json.dumps({"module": name, "text": inspect.getsource(importlib.import_module(name))}) + "\n")
    return path


def main(argv: list[str] | None = None) -> dict:
    import torch  # noqa: F401  (before transformers' Trainer, as usual)
    from transformers import AutoModelForCausalLM, Trainer, default_data_collator, set_seed

    import hf_mhce
    from hf_mhce.train import corpus
    from hf_mhce.train.job import (best_by_first_eval_loss, build_datasets, build_tokenizer, count_shifted_targets,
                                  lora_model, parameter_count)

    argv = list(sys.argv[1:] if argv is None else argv)
    example, model_args, data_args, loss_args, lora_args, training_args = parse(argv)
    with refusing():  # a ValueError before training starts refuses the options or the data (cli: a usage error)
        fuse_label_smoothing(loss_args, training_args)
        check(example, model_args, data_args, loss_args, lora_args, training_args)
    started = time.time()
    pretrained = None
    if model_args.model is None:  # hf-mhce train marks its own refusals
        model_args.model, pretrained = pretrain(example, model_args, data_args, loss_args, training_args)
    set_seed(training_args.seed)

    with refusing():
        # data: the model's tokenizer; fixed-size blocks (hf_mhce.train's builders)
        with training_args.main_process_first(desc="fine-tuning data"):
            default_data = data_args.dataset is None
            if default_data:
                data_args.dataset = write_code_dataset(example.out)
            train_texts, eval_texts = build_datasets(data_args)
            if default_data:  # held-out module source (build_datasets names a held-out share "held_out")
                eval_texts = {"code": next(iter(eval_texts.values()))}
        if pretrained is not None and default_data:
            eval_texts["docs"] = corpus.embedded_texts()[1]  # the pretraining domain: what fine-tuning costs there
        # checked against the model's vocabulary (an adapter's: its base's)
        tokenizer = build_tokenizer(model_args, train_texts, checkpoint_facts(model_args.model, model_args.trust_remote_code)[1])
        block = data_args.block_size
        train_ds = corpus.lm_dataset(corpus.token_blocks(train_texts, tokenizer, block, data_args.max_train_blocks))
        eval_ds = {name: corpus.lm_dataset(corpus.token_blocks(texts, tokenizer, block, data_args.max_eval_blocks))
                   for name, texts in eval_texts.items()}
        best_by_first_eval_loss(training_args, list(eval_ds))

        # the model: load, (LoRA), patch with the fused loss (kept from the checkpoint unless --loss/--num_heads).
        # apply_patch after get_peft_model, so that the PeftModel's save (the adapter) writes the card section too.
        if adapter_to_train(model_args, lora_args):  # an adapter saved earlier: trained on, with its hf_mhce.json
            model = hf_mhce.from_pretrained(model_args.model, is_trainable=True,  # PEFT would load it frozen
                                            trust_remote_code=model_args.trust_remote_code)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_args.model, trust_remote_code=model_args.trust_remote_code)
        if lora_args.lora_r > 0:
            model = lora_model(model, lora_args)
        loss = loss_args.loss or ("mhce" if loss_args.num_heads else None)
        model = hf_mhce.apply_patch(model, loss=loss, num_heads=loss_args.num_heads if loss != "ce" else None,
                                    override_saved=loss_args.override_saved, **loss_options(loss_args))
        count_shifted_targets(model)  # GPT-2 has no loss_type: the Trainer would count labels[:, 0] as targets
        loss_config = dict(model.config.hf_mhce)  # what the fine-tuned model will mean (saved with it)
        trainable, total = parameter_count(model, trainable=True), parameter_count(model)

        # Trainer + RBECallback: every evaluation gets the RBE decomposition of its loss
        rbe = hf_mhce.RBECallback(plot=True)
        # "before" comes from eval_on_start (step 0, inside train()), not from trainer.evaluate() before
        # train(): in transformers 5.23 / accelerate 1.15 that marks the model as prepared, train() then
        # skips the DDP wrapping and the processes train without synchronising gradients (measured).
        training_args.eval_on_start = True
        trainer = Trainer(model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds,
                          data_collator=default_data_collator, processing_class=tokenizer, callbacks=[rbe])
    train_output = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    before = step_zero_metrics(trainer.state.log_history)
    after = trainer.evaluate()
    trainer.save_model(training_args.output_dir)  # the adapter with LoRA; the card's hf_mhce section either way
    merged_dir = None
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(training_args.output_dir)
        if lora_args.lora_r > 0 and example.merge_lora:
            merged_dir = os.path.join(training_args.output_dir, "merged")
            trainer.model.merge_and_unload().save_pretrained(merged_dir)
            tokenizer.save_pretrained(merged_dir)

    rows = []
    for name in eval_ds:
        for when, metrics in (("before", before), ("after", after)):
            p = f"eval_{name}"
            rows.append({"eval_set": name, "when": when, "loss": metrics[f"{p}_loss"],
                         # the model's own NLL: eval_loss adds label smoothing / z-loss where configured
                         "ppl": math.exp(metrics[f"{p}_rbe_cross_entropy"]),
                         **{c: metrics[f"{p}_rbe_{c}"] for c in ("cross_entropy", "error_entropy", "self_alignment",
                                                                  "confidence", "top1", "num_tokens")}})
    result = {
        "config": {"model": model_args.model, "pretrained_here": pretrained is not None, "dataset": data_args.dataset,
                   "loss": loss_config, "lora_r": lora_args.lora_r, "trainable_parameters": trainable,
                   "parameters": total, "train_tokens": len(train_ds) * block, "max_steps": training_args.max_steps,
                   "learning_rate": training_args.learning_rate, "seed": training_args.seed,
                   "world_size": training_args.world_size, "output_dir": training_args.output_dir,
                   "merged_dir": merged_dir, "argv": argv},
        "rows": rows, "train": train_output.metrics, "rbe_history": rbe.history,
        "log_history": trainer.state.log_history,
        "pretraining": None if pretrained is None else {k: pretrained[k] for k in ("loss", "num_heads", "parameters",
                                                                                   "final_eval", "wall_seconds")},
        "wall_seconds": round(time.time() - started, 1),
    }
    if trainer.is_world_process_zero():
        table = markdown_table(rows)
        write_report(example.out, result, table, default=float)
        plot(rows, rbe.history, os.path.join(example.out, "finetune.png"))
        heads = f" H={loss_config['num_heads']}" if loss_config["loss"] == "mhce" else ""
        print(f"\nfine-tuned {model_args.model} ({loss_config['loss']}{heads}; {trainable / 1e6:.3f}M of "
              f"{total / 1e6:.2f}M parameters trained) on {data_args.dataset}, {training_args.max_steps} steps; "
              f"perplexity under the model's own distribution; CE = EE + SA - Conf (nats)\n")
        print(table)
        print(f"\nwrote {training_args.output_dir} (model, card){' and ' + merged_dir if merged_dir else ''}; "
              f"{example.out}/table.md, results.json, finetune.png ({result['wall_seconds']:.0f} s)")
    rbe.close()
    return result


def step_zero_metrics(log_history: list[dict]) -> dict:
    """The evaluation metrics logged at step 0 (eval_on_start), every eval set merged."""
    merged = {}
    for entry in log_history:
        if entry.get("step") == 0:
            merged.update({k: v for k, v in entry.items() if k.startswith("eval_")})
    return merged


def markdown_table(rows: list[dict]) -> str:
    lines = ["| eval set | when | loss | ppl | EE | SA | Conf | top-1 | tokens |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['eval_set']} | {r['when']} | {r['loss']:.3f} | {r['ppl']:.1f} | {r['error_entropy']:.3f} | "
                     f"{r['self_alignment']:.3f} | {r['confidence']:.3f} | {r['top1']:.3f} | {r['num_tokens']} |")
    return "\n".join(lines)


def plot(rows: list[dict], history: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["eval_set"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for i, name in enumerate(names):
        pts = sorted({(h["step"], h["cross_entropy"], h["error_entropy"]) for h in history
                      if h["prefix"] == f"eval_{name}"})
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=f"C{i}", label=f"{name}: CE")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "--s", color=f"C{i}", label=f"{name}: Error-Entropy")
    ax.set(title="evaluation during fine-tuning (step 0 = before)", xlabel="step", ylabel="nats")
    ax.legend(fontsize=8)
    ax = axes[1]
    comps = ("cross_entropy", "error_entropy", "self_alignment", "confidence")
    width = 0.8 / (2 * len(names))
    for j, (name, when) in enumerate((n, w) for n in names for w in ("before", "after")):
        r = next(r for r in rows if r["eval_set"] == name and r["when"] == when)
        ax.bar([k + (j - len(names) + 0.5) * width for k in range(len(comps))], [r[c] for c in comps], width,
               label=f"{name} {when}", color=f"C{j // 2}", alpha=0.45 if when == "before" else 0.95)
    ax.set_xticks(range(len(comps)), ["CE", "Error-Entropy", "Self-Alignment", "Confidence"])
    ax.axhline(0, color="grey", lw=0.5)
    ax.set(title="RBE decomposition before / after", ylabel="nats")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def cli(argv: list[str] | None = None) -> int:
    """As ``hf-mhce train``: a refusal of the options or the data (raised before training starts) is a
    usage error, exit status 2, not a traceback; a failure of training keeps its traceback."""
    try:
        main(argv)
    except ValueError as err:
        if not refused(err):
            raise
        usage_error(str(err))
    end_distributed()  # under accelerate launch: the process group ends here, not in exit-time destructors
    return 0


if __name__ == "__main__":
    sys.exit(cli())
