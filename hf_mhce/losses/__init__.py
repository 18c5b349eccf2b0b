"""Autograd-aware losses over the fused sweeps, with argument checks and backend dispatch."""

from .api import linear_cross_entropy, multi_head_cross_entropy, multi_head_logprobs
from .collect import collect_ranks

__all__ = ["collect_ranks", "linear_cross_entropy", "multi_head_cross_entropy", "multi_head_logprobs"]
