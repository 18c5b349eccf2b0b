"""RBE decomposition of cross-entropy: rank statistics, the exact decomposition."""

from .stats import RBEDecomposition, RBEStats, decompose

__all__ = ["RBEDecomposition", "RBEStats", "decompose"]
