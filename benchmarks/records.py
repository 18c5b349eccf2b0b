"""Where a benchmark's numbers go (<out>/<stem>.json and <out>/<stem>.md, the table also printed),
and the options and device label shared by the GPU benchmarks."""

from __future__ import annotations

import argparse
import json
import os


def write_record(out: str, stem: str, data, markdown: str) -> str:
    """Write ``data`` as JSON and ``markdown`` next to it; print the markdown; return the path stem."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, stem)
    with open(path + ".json", "w") as f:
        json.dump(data, f, indent=2)
    with open(path + ".md", "w") as f:
        f.write(markdown.rstrip("\n") + "\n")
    print(markdown)
    return path


def add_device_options(p: argparse.ArgumentParser, reps: int) -> None:
    """--device, --dtype, --reps, --small (CPU check of the script itself) and --out."""
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=reps)
    p.add_argument("--small", action="store_true", help="tiny shapes: validates the script on CPU")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))


def device_label(device) -> str:
    """The GPU's name for file names (``NVIDIA-H100-80GB-HBM3``), or "cpu"."""
    import torch

    return torch.cuda.get_device_name(device).replace(" ", "-") if device.type == "cuda" else "cpu"
