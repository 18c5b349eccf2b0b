"""What every example writes to its output directory: results.json, table.md and a figure."""

from __future__ import annotations

import json
import os


def write_report(out: str, result: dict, table: str, text: str = "", **json_options) -> None:
    """<out>/results.json (``result``) and <out>/table.md (``table``, then ``text`` if any)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=2, **json_options)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table + ("\n\n" + text if text else "") + "\n")


def load_results(out: str) -> dict:
    """<out>/results.json of an earlier run (for --replot)."""
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


def save_figure(fig, path: str) -> str:
    """Lay out, write at the examples' resolution and release ``fig``; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
