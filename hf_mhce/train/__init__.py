"""The main job, ``hf-mhce train``: a small causal LM trained with CE or MHCE, evaluated with the
RBE decomposition, on the embedded corpus (no downloads) or on real data."""

from .arguments import ALL_ARGUMENTS, DataArguments, LoraArguments, LossArguments, ModelArguments, TrainArguments
from .job import run


def parse(argv: list[str] | None = None):
    """The five argument dataclasses from a command line, or from a single .json / .yaml file."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(ALL_ARGUMENTS, prog="hf-mhce train",
                              description="Train a causal LM with hf_mhce's fused CE / MHCE and RBE evaluation.")
    if argv and len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(argv[0])
    if argv and len(argv) == 1 and argv[0].endswith((".yaml", ".yml")):
        return parser.parse_yaml_file(argv[0])
    return parser.parse_args_into_dataclasses(args=argv)


def main(argv: list[str] | None = None) -> dict:
    return run(*parse(argv))


__all__ = ["DataArguments", "LoraArguments", "LossArguments", "ModelArguments", "TrainArguments", "main", "parse", "run"]
