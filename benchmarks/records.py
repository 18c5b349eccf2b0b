"""Where a benchmark's numbers go: <out>/<stem>.json and <out>/<stem>.md, the table also printed."""

from __future__ import annotations

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
