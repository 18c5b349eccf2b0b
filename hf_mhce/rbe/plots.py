"""Optional plots of the RBE statistics (matplotlib is imported only here)."""

from __future__ import annotations

import os

import torch

from .stats import RBEStats


INSTALL = "pip install 'hf-mhce[plot]'"
MISSING = f"RBE plots need matplotlib: {INSTALL}"


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    if not available():
        raise ImportError(MISSING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_rank_distribution(stats: RBEStats, path: str, title: str = "") -> str:
    """p_e against e + 1 on log-log axes (rank 0 drawn at 1)."""
    plt = _pyplot()
    counts = stats.counts.to(torch.float64)
    observed = (counts > 0).nonzero().squeeze(1)
    p = counts[observed] / counts.sum()
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.loglog((observed + 1).numpy(), p.numpy(), ".", ms=4)
    ax.set_xlabel("rank e + 1")
    ax.set_ylabel("p_e")
    ax.set_title(title or "rank distribution")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_components(history: list[dict], prefix: str, path: str) -> str:
    """Error-Entropy, Self-Alignment, Confidence and CE of one evaluation set over training steps."""
    plt = _pyplot()
    rows = [h for h in history if h["prefix"] == prefix]
    steps = [h["step"] for h in rows]
    fig, ax = plt.subplots(figsize=(5, 4))
    for key, label in (("cross_entropy", "cross-entropy"), ("error_entropy", "Error-Entropy"),
                       ("self_alignment", "Self-Alignment"), ("confidence", "Confidence")):
        ax.plot(steps, [h[key] for h in rows], marker="o", ms=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("nats")
    ax.set_title(f"RBE decomposition ({prefix})")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_path(directory: str, prefix: str, kind: str) -> str:
    """``<directory>/<prefix>_<kind>.png``; a prefix from an eval-set name may hold a path separator
    (a hub id such as "allenai/c4" as the dict key), which must not become a subdirectory."""
    safe = prefix.replace("/", "_").replace(os.sep, "_")
    return os.path.join(directory, f"{safe}_{kind}.png")


def plot_evaluation(directory: str, prefix: str, stats: RBEStats, history: list[dict]) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    return [
        plot_rank_distribution(stats, plot_path(directory, prefix, "rank_distribution"), prefix),
        plot_components(history, prefix, plot_path(directory, prefix, "components")),
    ]
