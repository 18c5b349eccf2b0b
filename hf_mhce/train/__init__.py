"""The main job, ``hf-mhce train``: a small causal LM trained with CE or MHCE, evaluated with the
RBE decomposition, on the embedded corpus (no downloads) or on real data."""

import sys

from .arguments import ALL_ARGUMENTS, DataArguments, LoraArguments, LossArguments, ModelArguments, TrainArguments
from .job import end_distributed, refused, run

PROG = "hf-mhce train"


def parse(argv: list[str] | None = None, arguments: tuple = ALL_ARGUMENTS, prog: str = PROG,
          description: str = "Train a causal LM with hf_mhce's fused CE / MHCE and RBE evaluation."):
    """The argument dataclasses (``arguments``, TrainingArguments' last) from a command line, or from
    a single .json / .yaml file; a bad option is argparse's usage error (exit status 2).  An example
    script passes its own dataclasses and ``prog`` (examples/finetune.py)."""
    from transformers import HfArgumentParser

    # allow_abbrev=False: `given` below reads the options as written, so an abbreviation argparse would
    # accept (--num_train_epoch) must be refused, not silently left out of it
    parser = HfArgumentParser(arguments, prog=prog, allow_abbrev=False, description=description)
    source = argv[0] + ": " if _options_file(argv) else ""  # where the options come from, in messages
    try:
        return _parsed(parser, argv)
    except ValueError as err:
        # argparse's usage error, as for any other bad option: a ValueError of TrainingArguments' own
        # checks (or of an options file) is a wrong option, not a failure to show as a traceback
        parser.error(f"{source}{err}")


def check_options(argv: list[str]) -> None:
    """Raise ValueError, naming the option, where ``hf-mhce train argv`` would refuse its options
    before reading any data (the sweep examples check every run's options before the first starts)."""
    from argparse import ArgumentError

    from transformers import HfArgumentParser

    from .arguments import check_arguments, check_schedule

    try:  # exit_on_error=False: a value argparse cannot convert is an ArgumentError, not a usage exit
        model_args, data_args, loss_args, lora_args, training_args = _parsed(
            HfArgumentParser(ALL_ARGUMENTS, prog=PROG, allow_abbrev=False, exit_on_error=False), argv)
    except ArgumentError as err:
        raise ValueError(str(err)) from None
    check_schedule(training_args)
    check_arguments(model_args, data_args, loss_args, lora_args, training_args.resume_from_checkpoint)


def _options_file(argv: list[str] | None) -> bool:
    return bool(argv) and len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml"))


def _parsed(parser, argv: list[str] | None) -> tuple:
    """``parse`` without the usage error: a ValueError names what is wrong."""
    if _options_file(argv):
        options = _typed(_file_options(argv[0], parser), parser, argv[0])
        parsed, given = parser.parse_dict(options), set(options)
    else:
        *parsed, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
        if unknown:
            raise ValueError(f"unrecognized arguments: {' '.join(unknown)}")
        given = {a[2:].split("=", 1)[0].replace("-", "_") for a in (argv if argv is not None else sys.argv[1:])
                 if a.startswith("--")}
    if "num_train_epochs" in given and "max_steps" not in given:  # else the job's default max_steps wins
        parsed[-1].max_steps = -1
    return tuple(parsed)


def _file_options(path: str, parser) -> dict:
    """The mapping of option names to values a .json / .yaml file holds; anything else is a usage error."""
    import json

    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            options = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
    except (OSError, ValueError, yaml.YAMLError) as err:
        parser.error(f"cannot read the options file {path}: {err}")
    if not isinstance(options, dict):
        held = "nothing" if options is None else f"a {type(options).__name__}"
        parser.error(f"the options file {path} holds {held}: it must map option names to values "
                     "(YAML lines like `max_steps: 100`, or a JSON object)")
    return options


def _typed(options: dict, parser, path: str) -> dict:
    """The file's strings for number and bool options converted as the command line converts them: YAML
    reads 1e-4 as a string, and parse_dict passes values on unconverted (AdamW then failed on lr '1e-4'
    after the data was read, and "false" was a true --rbe_plots)."""
    from argparse import ArgumentTypeError

    from transformers.hf_argparser import string_to_bool

    types = {a.dest: a.type for a in parser._actions if a.type in (int, float, string_to_bool)}
    typed = dict(options)
    for name, value in options.items():
        if name in types and isinstance(value, str):
            try:
                typed[name] = types[name](value)
            except (ArgumentTypeError, TypeError, ValueError) as err:
                parser.error(f"{path}: {name}: {value!r}: {err}")
    return typed


def main(argv: list[str] | None = None) -> dict:
    return run(*parse(argv))


def cli(argv: list[str] | None = None) -> int:
    """``hf-mhce train`` on the command line: a refusal of the options or the data (job.refused: raised
    before training starts) is printed as argparse prints a usage error, with exit status 2, not as a
    traceback; an error during training keeps its traceback."""
    try:
        main(argv)
    except ValueError as err:
        if not refused(err):
            raise
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    end_distributed()
    return 0


__all__ = ["DataArguments", "LoraArguments", "LossArguments", "ModelArguments", "TrainArguments", "check_options", "cli",
           "main", "parse", "run"]
