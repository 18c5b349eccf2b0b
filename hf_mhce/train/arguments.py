"""Options of ``hf-mhce train`` as HfArgumentParser dataclasses (so ``--help`` lists every option and
a JSON or YAML file can hold them).  Every TrainingArguments option is accepted too; the defaults
below make the embedded run finish in a few minutes on two CPU cores."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments


@dataclass
class ModelArguments:
    model: str | None = field(default=None, metadata={
        "help": "checkpoint directory or hub id to fine-tune; default: a small Llama built from the sizes below"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "tokenizer path or id; default: the model's, or a BPE trained on the training text"})
    vocab_size: int = field(default=4096, metadata={"help": "size of the BPE trained when no tokenizer is given"})
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 384


@dataclass
class DataArguments:
    dataset: str | None = field(default=None, metadata={
        "help": "datasets name, saved dataset directory or text/json/csv/parquet file; default: the embedded "
                "corpus (Python's documentation from pydoc_data.topics) with stdlib source as a second eval set"})
    dataset_config: str | None = None
    text_column: str = "text"
    train_split: str = "train"
    eval_split: str = field(default="validation", metadata={
        "help": "evaluation split; if the dataset has none, --eval_fraction of the training text is held out"})
    eval_fraction: float = field(default=0.1, metadata={"help": "share of the training text held out, in (0, 1)"})
    block_size: int = field(default=64, metadata={"help": "tokens per training / evaluation block (>= 2)"})
    max_train_blocks: int | None = None
    max_eval_blocks: int | None = field(default=64, metadata={"help": "per evaluation set; None = all"})


@dataclass
class LossArguments:
    loss: str | None = field(default=None, metadata={
        "help": "ce or mhce; default: the loss saved in --model's checkpoint, else mhce", "choices": ["ce", "mhce"]})
    num_heads: int | None = field(default=None, metadata={
        "help": "MHCE heads (must divide the hidden size); default: the checkpoint's, else 4"})
    label_smoothing: float = field(default=0.0, metadata={
        "help": "in the fused loss (--label_smoothing_factor is routed here)"})
    z_loss: float = 0.0
    override_saved: bool = field(default=False, metadata={
        "help": "allow a --loss/--num_heads different from the one saved in a checkpoint"})
    rbe_plots: bool = field(default=True, metadata={"help": "write RBE plots to <output_dir>/rbe (matplotlib)"})
    sample_prompt: str = field(default="The", metadata={"help": "prompt of the greedy sample printed at the end"})
    sample_tokens: int = field(default=40, metadata={"help": "tokens of that sample; 0: no sample"})


@dataclass
class LoraArguments:
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 trains the full model"})
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: str = field(default="q_proj,v_proj", metadata={
        "help": "comma-separated module names, or all-linear; add lm_head to adapt the head (exact with the fused loss)"})


@dataclass
class TrainArguments(TrainingArguments):
    """TrainingArguments with defaults for the embedded run."""

    output_dir: str = field(default="outputs/hf-mhce-train", metadata={
        "help": "where everything is written; the model or adapter an earlier run saved there is replaced"})
    max_steps: int = field(default=600, metadata={
        "help": "training steps; --num_train_epochs given without --max_steps trains by epochs instead"})
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 16
    learning_rate: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    lr_scheduler_type: str = "cosine"
    eval_strategy: str = "steps"
    eval_steps: int = 150
    logging_steps: int = 100
    save_strategy: str = "no"
    seed: int = 0
    disable_tqdm: bool = True


ALL_ARGUMENTS = (ModelArguments, DataArguments, LossArguments, LoraArguments, TrainArguments)
FRESH_MODEL_LOSS = ("mhce", 4)  # --loss / --num_heads when no checkpoint says otherwise


def requested_loss(loss_args, saved: dict | None) -> tuple[str | None, int | None]:
    """(loss, num_heads) for apply_patch.  ``saved``: the loss config recorded by --model's checkpoint
    (None: none recorded, or no --model).  None keeps the recorded value; without a record the model
    gets FRESH_MODEL_LOSS, and MHCE without --num_heads over a non-MHCE record 4 heads."""
    loss, heads = loss_args.loss, loss_args.num_heads
    if saved is None:
        loss = loss or FRESH_MODEL_LOSS[0]
    if loss == "mhce" and heads is None and (saved or {}).get("loss") != "mhce":
        heads = FRESH_MODEL_LOSS[1]
    return loss, heads


def checkpoint_facts(path: str) -> tuple[dict | None, object]:
    """patching.config.checkpoint_config of --model, after naming a local path that does not exist."""
    import os

    from ..patching.config import checkpoint_config
    from ..rbe.data import looks_like_a_path

    if not os.path.exists(os.path.expanduser(path)) and looks_like_a_path(path):
        raise ValueError(f"--model {path}: no such directory")
    return checkpoint_config(path)


def check_arguments(model_args, data_args, loss_args, lora_args) -> tuple[dict | None, object | None]:
    """Refuse inconsistent options before any data is read or tokenizer trained; returns
    ``checkpoint_facts`` of --model ((None, None) without one)."""
    from ..patching import LossConfig

    if lora_args.lora_r > 0 and not model_args.model:
        raise ValueError("--lora_r adapts a pretrained model: give its checkpoint with --model (without one the base "
                         "is a random Llama that is never saved, so the adapter could not be loaded again)")
    if loss_args.rbe_plots:
        from ..rbe import plots

        if not plots.available():
            raise ValueError(f"{plots.MISSING}, or pass --no_rbe_plots")
    if data_args.block_size < 2:
        raise ValueError(f"--block_size {data_args.block_size}: a block needs at least 2 tokens (an input and its target)")
    if not 0 < data_args.eval_fraction < 1:
        raise ValueError(f"--eval_fraction {data_args.eval_fraction} must be in (0, 1): the share held out for evaluation")
    for name in ("max_train_blocks", "max_eval_blocks"):
        if getattr(data_args, name) is not None and getattr(data_args, name) < 1:
            raise ValueError(f"--{name} {getattr(data_args, name)} must be at least 1 (leave it out for all blocks)")
    if loss_args.sample_tokens < 0 or (loss_args.sample_tokens and not loss_args.sample_prompt):
        raise ValueError("--sample_tokens must be >= 0 and --sample_prompt not empty (--sample_tokens 0: no sample)")
    saved, config = checkpoint_facts(model_args.model) if model_args.model else (None, None)
    loss, heads = requested_loss(loss_args, saved)
    if loss is not None:  # checked before the checkpoint's weights are read
        LossConfig(loss=loss, num_heads=1 if heads is None else heads,
                   label_smoothing=loss_args.label_smoothing, z_loss=loss_args.z_loss)
    hidden = getattr(config, "hidden_size", None) if config is not None else model_args.hidden_size
    if loss == "mhce" and heads is not None and hidden and hidden % heads:
        where = f"the hidden size {hidden} of {model_args.model}" if config is not None else f"--hidden_size {hidden}"
        raise ValueError(f"--num_heads {heads} does not divide {where}")
    return saved, config


def check_schedule(training_args) -> None:
    """A run that would train nothing (max_steps 0, or no steps and no epochs) saves an untrained model
    whose card says it was trained: refused instead."""
    steps, epochs = training_args.max_steps, training_args.num_train_epochs
    if steps == 0 or (steps < 0 and not epochs > 0):
        raise ValueError(f"--max_steps {steps} with --num_train_epochs {epochs} trains nothing: give a positive "
                         "--max_steps, or --num_train_epochs without --max_steps")


def fuse_label_smoothing(loss_args, training_args) -> None:
    """Move TrainingArguments' ``label_smoothing_factor`` into the fused loss's ``label_smoothing``.

    Left to the Trainer, it takes the labels away from the model and smooths full [tokens x vocab]
    logits itself: the same smoothing for CE, none of the memory saving.  Both set to different
    values is an error.
    """
    factor = training_args.label_smoothing_factor
    if not factor:
        return
    if loss_args.label_smoothing and loss_args.label_smoothing != factor:
        raise ValueError(f"--label_smoothing_factor {factor} and --label_smoothing {loss_args.label_smoothing} "
                         "disagree; they are the same option here (the fused loss smooths), give one")
    loss_args.label_smoothing = factor
    training_args.label_smoothing_factor = 0.0
