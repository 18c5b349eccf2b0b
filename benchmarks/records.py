"""Where a benchmark's numbers go, and the options and checks the benchmark scripts share.

A record is <out>/<stem>.json and <out>/<stem>.md (the table also printed).  Naming rule (NOTES.md):
the stem carries the script's name, the date and every option that differs from its default, and
a run never replaces a record that exists when it starts unless --force is given.  So a partial
run (fewer variants, other sizes) lands beside the full record instead of over it, and a second
full run on the same day stops at once, before any work, instead of after it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re

from hf_mhce.cli import positive_int  # the CLI's own check and message, re-exported to the scripts

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DTYPES = ("bfloat16", "float16", "float32")
_UNNAMED = {"out", "force", "device", "variant"}  # never part of a record's name (device: in the stem)


def default_out() -> str:
    """$OUT (the device tool's fresh folder) when set and not empty, else this checkout's
    benchmarks/results, whatever the current directory."""
    return os.environ.get("OUT") or RESULTS


def add_out_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=default_out(), help="folder of the record (default: $OUT, else benchmarks/results)")
    p.add_argument("--force", action="store_true", help="replace a record of the same name")


def add_device_options(p: argparse.ArgumentParser, reps: int | None) -> None:
    """--device, --dtype, --reps (unless reps is None: a script that times nothing), --small (CPU check
    of the script itself), --out and --force."""
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    if reps is not None:
        p.add_argument("--reps", type=positive_int, default=reps)
    p.add_argument("--small", action="store_true", help="tiny shapes: validates the script on CPU (TRITON_INTERPRET=1)")
    add_out_options(p)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def check_device(p: argparse.ArgumentParser, args, triton: bool = True):
    """The torch.device of --device, or an argparse error saying what to do instead of a failure deep
    inside torch or Triton: cuda needs a GPU; any other device runs Triton kernels only under the
    interpreter (TRITON_INTERPRET=1, set before Python starts) and only at --small shapes (the full
    shapes would take minutes to hours there)."""
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        p.error(f"--device {args.device!r}: {err}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            p.error(f"--device {args.device}, but torch sees no CUDA GPU here. Run it on a GPU "
                    "(bash benchmarks/device_run.sh), or check the script on CPU with TRITON_INTERPRET=1 "
                    "in the environment and --device cpu --small")
        return device
    if triton and os.environ.get("TRITON_INTERPRET") != "1":
        p.error(f"--device {device.type}: the Triton kernels run off CUDA only under the interpreter; "
                "set TRITON_INTERPRET=1 in the environment before Python starts")
    if not args.small:
        p.error(f"--device {device.type}: the full shapes are for a GPU; add --small to check the script here")
    return device


def _value(v) -> str:
    items = v if isinstance(v, (list, tuple)) else [v]
    return "-".join(format(x, "g") if isinstance(x, float) else str(x) for x in items)


def options_suffix(p: argparse.ArgumentParser, args, named=(), extra=()) -> str:
    """"-key_value-..." for every option that differs from its default (``named``: already in the
    stem), then ``extra`` (arguments passed through); characters the device tool cannot return as a
    file name become "-", and a long suffix is cut and completed by a hash of the whole."""
    parts = []
    for key, value in vars(args).items():
        if key in _UNNAMED or key in named or value == p.get_default(key):
            continue
        key = key.replace("_", "-")
        parts.append(key if value is True else f"{key}_{_value(value)}")
    parts += [str(x).lstrip("-") for x in extra]
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(parts)).strip("-")
    if len(text) > 80:
        text = text[:60].rstrip("-") + "-" + hashlib.sha1(text.encode()).hexdigest()[:8]
    return "-" + text if text else ""


class Record:
    """The record one run writes: named, and checked not to exist, when the run starts."""

    def __init__(self, p: argparse.ArgumentParser, args, stem: str, named=(), extra=()):
        if not args.out:
            p.error("--out is empty")
        self.path = os.path.join(args.out, stem + options_suffix(p, args, named, extra))
        existing = [self.path + ext for ext in (".json", ".md") if os.path.exists(self.path + ext)]
        if existing and not args.force:
            p.error(f"{existing[0]} exists, and a run never replaces a record: pass --force to replace it, "
                    "or --out to write elsewhere")

    def write(self, data, markdown: str, echo: bool = True) -> str:
        """Write ``data`` as JSON and ``markdown`` beside it (again, if this run wrote it before:
        peers.py rewrites after every shape, tile_sweep.py after every stage); print the markdown
        unless ``echo`` is False; return the path stem."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path + ".json", "w") as f:
            json.dump(data, f, indent=2)
        with open(self.path + ".md", "w") as f:
            f.write(markdown.rstrip("\n") + "\n")
        if echo:
            print(markdown)
        return self.path


def device_label(device) -> str:
    """The GPU's name for file names (``NVIDIA-H100-80GB-HBM3``), or "cpu"."""
    import torch

    return torch.cuda.get_device_name(device).replace(" ", "-") if device.type == "cuda" else "cpu"


@contextlib.contextmanager
def environment(settings: dict):
    """``os.environ`` updated with ``settings`` inside the block (a value None unsets the variable), each
    variable restored after it (unset where it was): a setting that one run or row needs does not reach
    the next in the same process."""
    before = {key: os.environ.get(key) for key in settings}
    _put(settings)
    try:
        yield
    finally:
        _put(before)


def _put(values: dict) -> None:
    """Set each variable of ``values`` in ``os.environ``, unsetting those whose value is None."""
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
