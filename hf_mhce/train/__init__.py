"""The main job, ``hf-mhce train``: a small causal LM trained with CE or MHCE, evaluated with the
RBE decomposition, on the embedded corpus (no downloads) or on real data."""

import sys

from .arguments import ALL_ARGUMENTS, DataArguments, LoraArguments, LossArguments, ModelArguments, TrainArguments
from .job import end_distributed, refused, run

PROG = "hf-mhce train"


def parse(argv: list[str] | None = None, arguments: tuple = ALL_ARGUMENTS, prog: str = PROG,
          description: str = "Train a causal LM with hf_mhce's fused CE / MHCE and RBE evaluation.", notes: bool = True):
    """The argument dataclasses (``arguments``, TrainingArguments' last) from a command line, or from
    a single .json / .yaml file; a bad option is argparse's usage error (exit status 2).  An example
    script passes its own dataclasses and ``prog`` (examples/finetune.py).  ``notes``: name on stderr the
    options the run does not use (arguments.unused_options)."""
    parser = _parser(arguments, prog=prog, description=description)
    source = argv[0] + ": " if _options_file(argv) else ""  # where the options come from, in messages
    try:
        return _parsed(parser, argv, notes)
    except ValueError as err:
        # argparse's usage error, as for any other bad option: a ValueError of TrainingArguments' own
        # checks (or of an options file) is a wrong option, not a failure to show as a traceback
        parser.error(f"{source}{err}")


def check_options(argv: list[str]) -> None:
    """Raise ValueError, naming the option, where ``hf-mhce train argv`` would refuse its options
    before reading any data (the sweep examples check every run's options before the first starts)."""
    from argparse import ArgumentError

    from .arguments import check_arguments, check_schedule, fuse_label_smoothing

    try:  # exit_on_error=False: a value argparse cannot convert is an ArgumentError, not a usage exit
        model_args, data_args, loss_args, lora_args, training_args = _parsed(
            _parser(ALL_ARGUMENTS, prog=PROG, exit_on_error=False), argv, notes=False)
    except ArgumentError as err:
        raise ValueError(str(err)) from None
    check_schedule(training_args)
    fuse_label_smoothing(loss_args, training_args)
    check_arguments(model_args, data_args, loss_args, lora_args, training_args.resume_from_checkpoint)


def _parser(arguments: tuple, **kwargs):
    """HfArgumentParser over ``arguments``.  allow_abbrev=False: ``_parsed``'s `given` reads the options as
    written, so an abbreviation argparse would accept (--num_train_epoch) must be refused, not silently left
    out of it.  The --no_X flag HfArgumentParser adds for a bool X that defaults to true repeats X's help
    (and shows "default: False"); it is given its own."""
    from argparse import SUPPRESS

    from transformers import HfArgumentParser

    parser = HfArgumentParser(arguments, allow_abbrev=False, **kwargs)
    for action in parser._actions:
        if action.option_strings and action.option_strings[0] == f"--no_{action.dest}":
            action.help, action.default = f"set --{action.dest} to false", SUPPRESS  # X's own flag sets the default
    return parser


def _options_file(argv: list[str] | None) -> bool:
    return bool(argv) and len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml"))


def _parsed(parser, argv: list[str] | None, notes: bool = True) -> tuple:
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
    _plots_if_installed(parsed, given)
    if notes:
        _say_unused(parsed, given, parser.prog)
    return tuple(parsed)


def _say_unused(parsed, given: set, prog: str) -> None:
    from .arguments import unused_options

    model_args = next((args for args in parsed if isinstance(args, ModelArguments)), None)
    if model_args is not None:
        for note in unused_options(model_args, given, parsed[-1].resume_from_checkpoint):
            print(f"{prog}: {note}", file=sys.stderr)


def _plots_if_installed(parsed, given: set) -> None:
    """RBE plots by default only where matplotlib is installed (the ``plot`` extra): a plain
    ``pip install hf-mhce`` runs ``hf-mhce train`` without them, saying so; an explicit --rbe_plots
    without matplotlib is still refused (check_arguments)."""
    if given & {"rbe_plots", "no_rbe_plots"}:
        return
    from ..rbe import plots

    for args in parsed:
        if getattr(args, "rbe_plots", False) and not plots.available():
            args.rbe_plots = False
            print(f"{PROG}: no RBE plots: matplotlib is not installed ({plots.INSTALL})", file=sys.stderr)


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
    """The file's values checked and converted as the command line converts its strings: YAML reads 1e-4 as a
    string and parse_dict passes values on unconverted (AdamW then failed on lr '1e-4' after the data was read,
    "false" was a true --rbe_plots, and block_size 16.5, block_size null or a list of LoRA modules were
    tracebacks).  A number where text is expected becomes its text, as on the command line; a list of
    --lora_target_modules is joined with commas."""
    actions = {a.dest: a for a in parser._actions if a.option_strings and not a.option_strings[0].startswith("--no_")}
    admitted = _admitted(parser)
    typed = dict(options)
    for name, value in options.items():
        action = actions.get(name)
        if action is None or action.nargs in ("+", "*") or (isinstance(value, (list, dict)) and
                                                           type(value) in admitted.get(name, ())):
            continue  # unknown names are parse_dict's error; a list or dict where the field takes one is passed on
        try:
            typed[name] = _file_value(name, value, action.type, type(None) in admitted.get(name, {type(None)}))
        except ValueError as err:
            parser.error(f"{path}: {err}")
        if action.choices and typed[name] is not None and typed[name] not in action.choices:
            parser.error(f"{path}: {name}: {typed[name]!r} is not one of {', '.join(map(str, action.choices))}")
    return typed


def _file_value(name: str, value, kind, nullable: bool):
    """One options-file value as the command line would give it to an option of argparse type ``kind``;
    ValueError names what is wrong."""
    from argparse import ArgumentTypeError

    from transformers.hf_argparser import string_to_bool

    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if value is None:
        if not nullable:
            raise ValueError(f"{name} is empty (null): give a value, or leave it out for its default")
        return None
    if isinstance(value, str):
        if kind not in (int, float, string_to_bool):
            return value
        try:
            return kind(value)
        except (ArgumentTypeError, TypeError, ValueError) as err:
            raise ValueError(f"{name}: {value!r}: {err}") from None
    if kind is string_to_bool and isinstance(value, bool):
        return value
    if kind is int and number and float(value).is_integer():
        return int(value)
    if kind is float and number:
        return float(value)
    if kind not in (int, float, string_to_bool):
        if isinstance(value, list) and name == "lora_target_modules" and all(isinstance(v, str) for v in value):
            return ",".join(value)
        if number:
            return str(value)
    expected = {string_to_bool: "true or false", int: "an integer", float: "a number"}.get(kind, "a string")
    raise ValueError(f"{name}: {value!r} is not {expected}")


def _admitted(parser) -> dict[str, set]:
    """For each of the parser's dataclass fields, the plain types (and origins: list, dict) its type admits."""
    import dataclasses
    import types
    import typing

    admitted = {}
    for dtype in parser.dataclass_types:
        hints = typing.get_type_hints(dtype)
        for f in dataclasses.fields(dtype):
            hint = hints.get(f.name)
            union = typing.get_origin(hint) in (typing.Union, types.UnionType)
            admitted[f.name] = {typing.get_origin(a) or a for a in (typing.get_args(hint) if union else (hint,))}
    return admitted


def main(argv: list[str] | None = None) -> dict:
    """Run ``hf-mhce train`` with ``argv`` (default: sys.argv[1:]) and return its summary (what metrics.json
    holds: loss, num_heads, parameters, train metrics, final_eval, rbe_history, sample).  A refused option or
    dataset raises ValueError, as ``cli`` turns into a usage error."""
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
