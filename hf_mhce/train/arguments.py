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
    eval_fraction: float = 0.1
    block_size: int = field(default=64, metadata={"help": "tokens per training / evaluation block"})
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
    sample_tokens: int = 40


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

    output_dir: str = field(default="outputs/hf-mhce-train", metadata={"help": "where everything is written"})
    max_steps: int = 600
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


def requested_loss(model_args, loss_args) -> tuple[str | None, int | None]:
    """(loss, num_heads) for apply_patch: None keeps a checkpoint's; a fresh model gets FRESH_MODEL_LOSS."""
    loss, heads = loss_args.loss, loss_args.num_heads
    if not model_args.model:
        loss = loss or FRESH_MODEL_LOSS[0]
        heads = heads or (FRESH_MODEL_LOSS[1] if loss == "mhce" else None)
    return loss, heads


def check_arguments(model_args, loss_args, lora_args) -> None:
    """Refuse inconsistent options before any data is read or tokenizer trained."""
    from ..patching import LossConfig

    if lora_args.lora_r > 0 and not model_args.model:
        raise ValueError("--lora_r adapts a pretrained model: give its checkpoint with --model (without one the base "
                         "is a random Llama that is never saved, so the adapter could not be loaded again)")
    if loss_args.rbe_plots:
        from ..rbe import plots

        if not plots.available():
            raise ValueError(f"{plots.MISSING}, or pass --no_rbe_plots")
    loss, heads = requested_loss(model_args, loss_args)
    if loss is not None:  # what can be checked before a checkpoint is read
        LossConfig(loss=loss, num_heads=1 if heads is None else heads,
                   label_smoothing=loss_args.label_smoothing, z_loss=loss_args.z_loss)
    if not model_args.model and loss == "mhce" and model_args.hidden_size % heads:
        raise ValueError(f"--num_heads {heads} does not divide --hidden_size {model_args.hidden_size}")


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
