"""Options of ``hf-mhce train`` as HfArgumentParser dataclasses (so ``--help`` lists every option and
a JSON or YAML file can hold them).  Every TrainingArguments option is accepted too; the defaults
below make the embedded run finish in about a minute on two idle CPU cores."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from transformers import TrainingArguments


@dataclass
class ModelArguments:
    model: str | None = field(default=None, metadata={
        "help": "checkpoint directory or hub id to fine-tune; default: a small Llama built from the sizes below"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "tokenizer path or id; default: the model's, or a BPE trained on the training text"})
    vocab_size: int = field(default=4096, metadata={
        "help": "size of the BPE trained when no tokenizer is given; at least 257 (256 bytes + EOS)"})
    # the sizes of the default model (used only without --model)
    hidden_size: int = field(default=128, metadata={"help": "hidden size of the default Llama"})
    num_hidden_layers: int = field(default=2, metadata={"help": "layers of the default Llama"})
    num_attention_heads: int = field(default=4, metadata={"help": "attention heads of the default Llama"})
    intermediate_size: int = field(default=384, metadata={"help": "MLP size of the default Llama"})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "run the custom modeling code --model's checkpoint carries (auto_map in its config.json: the model, "
                "config or tokenizer class): set it only for checkpoints you trust and whose code you have read, as "
                "it executes that code on this machine"})


@dataclass
class DataArguments:
    dataset: str | None = field(default=None, metadata={
        "help": "datasets name, saved dataset directory, text/json/csv file (also .gz/.bz2/.xz) or parquet file "
                "(uncompressed); "
                "default: the embedded corpus (Python's documentation from pydoc_data.topics) with stdlib source as a "
                "second eval set"})
    dataset_config: str | None = field(default=None, metadata={"help": "configuration name of a datasets dataset"})
    text_column: str = field(default="text", metadata={"help": "column holding the text"})
    train_split: str = field(default="train", metadata={"help": "training split"})
    eval_split: str = field(default="validation", metadata={
        "help": "evaluation split; if the dataset has no split of the default name (validation), --eval_fraction of "
                "the training text is held out; a split named otherwise must exist"})
    eval_fraction: float = field(default=0.1, metadata={"help": "share of the training text held out, in (0, 1)"})
    block_size: int = field(default=64, metadata={"help": "tokens per training / evaluation block (>= 2)"})
    max_train_blocks: int | None = field(default=None, metadata={"help": "training blocks kept; 0 = all"})
    max_eval_blocks: int | None = field(default=64, metadata={"help": "per evaluation set; 0 = all"})


@dataclass
class LossArguments:
    loss: str | None = field(default=None, metadata={
        "help": "ce or mhce; default: the loss saved in --model's checkpoint, else mhce", "choices": ["ce", "mhce"]})
    num_heads: int | None = field(default=None, metadata={
        "help": "MHCE heads (must divide the hidden size); default: the checkpoint's, else 4"})
    label_smoothing: float | None = field(default=None, metadata={
        "help": "in the fused loss (--label_smoothing_factor is routed here); default: --model's saved value, else 0"})
    z_loss: float | None = field(default=None, metadata={
        "help": "weight of the z-loss (log-partition squared) in the fused loss; default: --model's saved value, else 0"})
    override_saved: bool = field(default=False, metadata={
        "help": "allow a --loss/--num_heads different from the one saved in a checkpoint"})
    rbe_plots: bool = field(default=True, metadata={
        "help": "write RBE plots to <output_dir>/rbe (needs matplotlib: hf-mhce[plot]; by default only where it is "
                "installed); --no_rbe_plots: none"})
    sample_prompt: str = field(default="The", metadata={"help": "prompt of the greedy sample printed at the end"})
    sample_tokens: int = field(default=40, metadata={"help": "tokens of that sample; 0: no sample"})


@dataclass
class LoraArguments:
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 trains the full model"})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA scaling numerator (scale = alpha / r)"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA input"})
    lora_target_modules: str | None = field(default=None, metadata={
        "help": "comma-separated module names, or all-linear; add lm_head to adapt the head (exact with the fused "
                "loss); default: PEFT's for the architecture (q_proj,v_proj for Llama, c_attn for GPT-2)"})


@dataclass
class TrainArguments(TrainingArguments):
    """TrainingArguments with defaults for the embedded run."""

    output_dir: str = field(default="outputs/hf-mhce-train", metadata={
        "help": "where everything is written; the model or adapter an earlier run saved there is replaced"})
    max_steps: int = field(default=600, metadata={
        "help": "training steps; --num_train_epochs given without --max_steps trains by epochs instead"})
    # Every default this job changes is redefined with a help text: argparse prints "(default: ...)"
    # only for options that have one.  The types stay TrainingArguments' (steps may be ratios).
    num_train_epochs: float = field(default=3.0, metadata={
        "help": "epochs to train; applies only without --max_steps (or with --max_steps -1): otherwise "
                "--max_steps decides, as in the default run"})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "training batch size per device"})
    per_device_eval_batch_size: int = field(default=16, metadata={"help": "evaluation batch size per device"})
    learning_rate: float = field(default=3e-3, metadata={"help": "peak learning rate (AdamW)"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay"})
    warmup_steps: float = field(default=50, metadata={
        "help": "linear warmup steps (a float in [0, 1): a share of the training steps)"})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "learning-rate schedule after the warmup"})
    eval_strategy: str = field(default="steps", metadata={"help": "when to evaluate: no, steps or epoch"})
    eval_steps: float | None = field(default=150, metadata={"help": "steps between evaluations (with RBE metrics)"})
    logging_steps: float = field(default=100, metadata={"help": "steps between training-loss logs"})
    save_strategy: str = field(default="no", metadata={
        "help": "intermediate checkpoints: no, steps or epoch (the final model is always saved to --output_dir)"})
    seed: int = field(default=0, metadata={"help": "random seed (model initialisation, data order)"})
    disable_tqdm: bool = field(default=True, metadata={"help": "no progress bars (the job prints its own table)"})


ALL_ARGUMENTS = (ModelArguments, DataArguments, LossArguments, LoraArguments, TrainArguments)
FRESH_MODEL_LOSS = ("mhce", 4)  # --loss / --num_heads when no checkpoint says otherwise
TRUST_REMOTE_CODE = "--trust_remote_code"


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


def adapter_to_train(model_args, lora_args) -> bool:
    """Whether --model is a LoRA adapter saved earlier, to be trained on as it is (loaded trainable: PEFT
    loads it frozen); with --lora_r, a second adapter on top, it is refused."""
    from ..patching.config import adapter_base

    if not model_args.model or adapter_base(model_args.model) is None:
        return False
    if lora_args.lora_r > 0:
        raise ValueError(f"--model {model_args.model} is a LoRA adapter: leave out --lora_r to train it on, or merge "
                         "it into its base model first (a second adapter on top is not supported)")
    return True


def loss_options(loss_args) -> dict:
    """The fused loss's options given on the command line; one left out keeps --model's saved value."""
    return {name: getattr(loss_args, name) for name in ("label_smoothing", "z_loss") if getattr(loss_args, name) is not None}


def checkpoint_facts(path: str, trust_remote_code: bool = False) -> tuple[dict | None, object]:
    """patching.config.checkpoint_config of --model, after naming a local path that does not exist.
    An adapter saved without hf_mhce.json gets its base's record, as from_pretrained gives it."""
    from ..patching.config import CONFIG_KEY, adapter_base, checkpoint_config
    from ..rbe.data import hub_lookup_failed, looks_like_a_path, remote_code_option

    if not os.path.exists(os.path.expanduser(path)) and looks_like_a_path(path):
        raise ValueError(f"--model {path}: no such directory")
    if os.path.isfile(os.path.expanduser(path)):
        raise ValueError(f"--model {path} is a file: give a checkpoint directory (or a hub id)")
    try:
        with remote_code_option(TRUST_REMOTE_CODE):
            saved, config = checkpoint_config(path, trust_remote_code)
    except OSError as err:
        said = hub_lookup_failed(path, err)
        if said is None:
            raise
        raise ValueError(f"--model {said}") from err
    if saved is None and adapter_base(path) is not None:
        saved = getattr(config, CONFIG_KEY, None)
    return saved, config


def explained(patch, *args, **options):
    """``patch(*args, **options)`` with a SavedLossMismatchError told in this command's options."""
    from ..patching import SavedLossMismatchError

    try:
        return patch(*args, **options)
    except SavedLossMismatchError as err:
        hint = "hf-mhce train: --override_saved, or leave out --loss / --num_heads to keep the checkpoint's"
        raise SavedLossMismatchError(f"{err} ({hint})") from None


def min_vocab_size() -> int:
    """The smallest BPE corpus.train_tokenizer makes: its initial alphabet and special tokens, no merges
    (a smaller --vocab_size was silently raised to it)."""
    from tokenizers import pre_tokenizers

    from .corpus import SPECIAL_TOKENS

    return len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)


def check_arguments(model_args, data_args, loss_args, lora_args, resume: str | None = None
                    ) -> tuple[dict | None, object | None]:
    """Refuse inconsistent options before any data is read or tokenizer trained; returns
    ``checkpoint_facts`` of --model ((None, None) without one).  ``resume``: --resume_from_checkpoint."""
    from ..patching.config import resolve_config

    check_lora_options(lora_args)
    if lora_args.lora_r > 0 and not model_args.model:
        raise ValueError("--lora_r adapts a pretrained model: give its checkpoint with --model (without one the base "
                         "is a random Llama that is never saved, so the adapter could not be loaded again)")
    adapter_to_train(model_args, lora_args)
    if loss_args.rbe_plots:
        from ..rbe import plots

        if not plots.available():
            raise ValueError(f"{plots.MISSING}, or pass --no_rbe_plots")
    if model_args.vocab_size < min_vocab_size():
        raise ValueError(f"--vocab_size {model_args.vocab_size} is less than {min_vocab_size()}, the smallest byte-level "
                         "BPE (256 byte tokens and EOS)")
    if not model_args.model:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            if getattr(model_args, name) < 1:
                raise ValueError(f"--{name} {getattr(model_args, name)} must be at least 1")
        if model_args.hidden_size % model_args.num_attention_heads:
            raise ValueError(f"--num_attention_heads {model_args.num_attention_heads} does not divide "
                             f"--hidden_size {model_args.hidden_size}")
        if model_args.hidden_size // model_args.num_attention_heads % 2:  # else transformers' config validation, mid-job
            raise ValueError(f"--hidden_size {model_args.hidden_size} / --num_attention_heads "
                             f"{model_args.num_attention_heads} = {model_args.hidden_size // model_args.num_attention_heads}: "
                             "the Llama's rotary embedding needs an even attention head size")
    check_data_options(data_args)
    if loss_args.sample_tokens < 0 or (loss_args.sample_tokens and not loss_args.sample_prompt):
        raise ValueError("--sample_tokens must be >= 0 and --sample_prompt not empty (--sample_tokens 0: no sample)")
    saved, config = checkpoint_facts(model_args.model, model_args.trust_remote_code) if model_args.model else (None, None)
    # the config the model will be patched with, resolved against the checkpoint's record as
    # build_model's apply_patch will: a refused change of the saved loss is named before the data is read
    loss, heads = requested_loss(loss_args, saved)
    cfg = explained(resolve_config, saved, None, loss, heads, loss_options(loss_args), loss_args.override_saved)
    if config is not None:  # a longer block fails in the model's position embedding, mid-training
        from ..rbe.data import block_size_refusal, config_max_positions

        too_long = block_size_refusal("--block_size", data_args.block_size, model_args.model,
                                      *config_max_positions(config))
        if too_long:
            raise ValueError(too_long)
    hidden = getattr(config, "hidden_size", None) if config is not None else model_args.hidden_size
    if cfg.loss == "mhce" and hidden and hidden % cfg.num_heads:
        where = f"the hidden size {hidden} of {model_args.model}" if config is not None else f"--hidden_size {hidden}"
        raise ValueError(f"--num_heads {cfg.num_heads} does not divide {where}")
    resumed = checkpoint_facts(resume, model_args.trust_remote_code)[0] if resume else None
    if resumed is not None and not loss_args.override_saved and (cfg.loss, cfg.num_heads) != (
            resumed["loss"], resumed["num_heads"]):  # its weights would go on training as another model, silently
        raise ValueError(f"--resume_from_checkpoint {resume} was trained with --loss {resumed['loss']} --num_heads "
                         f"{resumed['num_heads']}, this run patches --loss {cfg.loss} --num_heads {cfg.num_heads}: "
                         "give the checkpoint's (or --override_saved)")
    return saved, config


SIZE_OPTIONS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def unused_options(model_args, given: set, resume: str | None) -> list[str]:
    """What the options ``given`` (as written) set but the run does not use: the default Llama's sizes beside
    --model, and --vocab_size where a tokenizer is loaded (--tokenizer's, --model's or the resumed checkpoint's)
    instead of trained.  Said, not refused: options shared by a sweep's runs may size the ones without --model."""
    from ..rbe.data import has_tokenizer_files

    notes = []
    sizes = [f"--{name}" for name in SIZE_OPTIONS if name in given]
    if sizes and model_args.model:
        notes.append(f"{', '.join(sizes)} not used: {'they size' if len(sizes) > 1 else 'it sizes'} the default Llama, "
                     f"and --model {model_args.model} has its own sizes")
    if "vocab_size" in given:
        tokenizer = (f"--tokenizer {model_args.tokenizer}" if model_args.tokenizer
                     else f"the tokenizer of --model {model_args.model}" if model_args.model
                     else f"the tokenizer saved in {resume}" if resume and has_tokenizer_files(resume) else None)
        if tokenizer:
            notes.append(f"--vocab_size not used: it sizes the BPE trained when no tokenizer is given, and this run "
                         f"loads {tokenizer}")
    return notes


def check_lora_options(lora_args) -> None:
    if lora_args.lora_r < 0:
        raise ValueError(f"--lora_r {lora_args.lora_r} must be >= 0 (0 trains the full model)")
    if not 0 <= lora_args.lora_dropout < 1:  # else PEFT's error, reported as one of --lora_target_modules
        raise ValueError(f"--lora_dropout {lora_args.lora_dropout} must be in [0, 1)")


def check_data_options(data_args) -> None:
    if data_args.block_size < 2:
        raise ValueError(f"--block_size {data_args.block_size}: a block needs at least 2 tokens (an input and its target)")
    if not 0 < data_args.eval_fraction < 1:
        raise ValueError(f"--eval_fraction {data_args.eval_fraction} must be in (0, 1): the share held out for evaluation")
    check_block_limits(data_args)


def check_block_limits(data_args) -> None:
    """--max_train_blocks / --max_eval_blocks: 0 means all (argparse cannot give an int option None)."""
    for name in ("max_train_blocks", "max_eval_blocks"):
        if getattr(data_args, name) is not None and getattr(data_args, name) < 0:
            raise ValueError(f"--{name} {getattr(data_args, name)} must be at least 0 (0: all blocks)")
        setattr(data_args, name, getattr(data_args, name) or None)


def check_schedule(training_args) -> None:
    """A run that would train nothing (max_steps 0, or no steps and no epochs) saves an untrained model
    whose card says it was trained: refused instead, as is a --resume_from_checkpoint that is not there."""
    steps, epochs = training_args.max_steps, training_args.num_train_epochs
    if steps == 0 or (steps < 0 and not epochs > 0):
        raise ValueError(f"--max_steps {steps} with --num_train_epochs {epochs} trains nothing: give a positive "
                         "--max_steps, or --num_train_epochs without --max_steps")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(training_args, name) < 1:  # else a traceback from the DataLoader or a division by 0
            raise ValueError(f"--{name} {getattr(training_args, name)} must be at least 1")
    if not training_args.learning_rate >= 0:
        raise ValueError(f"--learning_rate {training_args.learning_rate} must be a non-negative number")
    resume = training_args.resume_from_checkpoint
    if resume:  # else the Trainer says so after the data is read and the model built
        _check_resume(resume)
    _check_output_dir(training_args.output_dir)
    _check_report_to(training_args.report_to or [])


def _check_report_to(names: list[str]) -> None:
    """Integrations that do not exist or are not installed (else the Trainer's RuntimeError, after the data is
    read and the tokenizer trained); ``names`` as TrainingArguments resolved them ("all" -> the installed ones)."""
    from transformers.integrations import get_available_reporting_integrations
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    unknown = [name for name in names if name not in INTEGRATION_TO_CALLBACK]
    if unknown:
        raise ValueError(f"--report_to {' '.join(unknown)}: no such integration (one of "
                         f"{', '.join(INTEGRATION_TO_CALLBACK)}, all, none)")
    installed = get_available_reporting_integrations()
    # flyte and azure_ml are supported but not listed as available (azure_ml not beside mlflow): left to the Trainer
    missing = [name for name in names if name not in installed and name not in ("flyte", "azure_ml")]
    if missing:
        raise ValueError(f"--report_to {' '.join(missing)}: not installed here (installed: "
                         f"{', '.join(installed) or 'none'}; --report_to none: no integration)")


def _check_resume(resume: str) -> None:
    kind = "checkpoint-N folder of an earlier run with --save_strategy steps or epoch"
    if not os.path.isdir(resume):
        raise ValueError(f"--resume_from_checkpoint {resume}: no such checkpoint directory (a {kind})")
    if not os.path.isfile(os.path.join(resume, "trainer_state.json")):  # a run's output_dir, say
        steps = sorted((int(n.split("-")[1]), n) for n in os.listdir(resume)
                       if n.startswith("checkpoint-") and n.split("-")[1].isdigit())
        hint = f": the latest one in it is {os.path.join(resume, steps[-1][1])}" if steps else ""
        raise ValueError(f"--resume_from_checkpoint {resume} is no checkpoint (no trainer_state.json): give a {kind}{hint}")


def _check_output_dir(output_dir: str | None) -> None:
    """A path the job can write into, named now (else an OSError from the Trainer after the data is read)."""
    if not output_dir:
        raise ValueError("--output_dir is empty: give the directory to write the model and metrics to")
    path = os.path.abspath(output_dir)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise ValueError(f"--output_dir {output_dir}: {path} is a file, not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--output_dir {output_dir}: {path} is not writable")


def fuse_label_smoothing(loss_args, training_args) -> None:
    """Move TrainingArguments' ``label_smoothing_factor`` into the fused loss's ``label_smoothing``.

    Left to the Trainer, it takes the labels away from the model and smooths full [tokens x vocab]
    logits itself: the same smoothing for CE, none of the memory saving.  Both set to different
    values is an error.
    """
    factor = training_args.label_smoothing_factor
    if not factor:
        return
    if not 0 <= factor <= 1:
        raise ValueError(f"--label_smoothing_factor {factor} must be in [0, 1]")
    if loss_args.label_smoothing is not None and loss_args.label_smoothing != factor:  # an explicit 0 too
        raise ValueError(f"--label_smoothing_factor {factor} and --label_smoothing {loss_args.label_smoothing} "
                         "disagree; they are the same option here (the fused loss smooths), give one")
    loss_args.label_smoothing = factor
    training_args.label_smoothing_factor = 0.0
