"""The main job, ``hf-mhce train``: a small causal LM trained with CE or MHCE, evaluated with the
RBE decomposition, on the embedded corpus (no downloads) or on real data."""

import sys

from .arguments import ALL_ARGUMENTS, DataArguments, LoraArguments, LossArguments, ModelArguments, TrainArguments
from .job import run


def parse(argv: list[str] | None = None):
    """The five argument dataclasses from a command line, or from a single .json / .yaml file."""
    from transformers import HfArgumentParser

    # allow_abbrev=False: `given` below reads the options as written, so an abbreviation argparse would
    # accept (--num_train_epoch) must be refused, not silently left out of it
    parser = HfArgumentParser(ALL_ARGUMENTS, prog="hf-mhce train", allow_abbrev=False,
                              description="Train a causal LM with hf_mhce's fused CE / MHCE and RBE evaluation.")
    if argv and len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        parsed = (parser.parse_json_file if argv[0].endswith(".json") else parser.parse_yaml_file)(argv[0])
        given = set(_file_keys(argv[0]))
    else:
        *parsed, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
        if unknown:  # argparse's usage error, as for any other bad option (not a ValueError traceback)
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        given = {a[2:].split("=", 1)[0].replace("-", "_") for a in (argv if argv is not None else sys.argv[1:])
                 if a.startswith("--")}
    if "num_train_epochs" in given and "max_steps" not in given:  # else the job's default max_steps wins
        parsed[-1].max_steps = -1
    return tuple(parsed)


def _file_keys(path: str) -> list[str]:
    import json

    with open(path) as f:
        if path.endswith(".json"):
            return list(json.load(f))
        import yaml

        return list(yaml.safe_load(f) or {})


def main(argv: list[str] | None = None) -> dict:
    return run(*parse(argv))


__all__ = ["DataArguments", "LoraArguments", "LossArguments", "ModelArguments", "TrainArguments", "main", "parse", "run"]
