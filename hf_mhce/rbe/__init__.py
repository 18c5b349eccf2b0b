"""RBE decomposition of cross-entropy: rank statistics, the exact decomposition, the Trainer
callback and a standalone evaluation."""

from .callback import RBECallback
from .evaluate import RBEReport, evaluate
from .replicas import ReplicasDivergedError
from .stats import RBEDecomposition, RBEStats, decompose

__all__ = ["RBECallback", "RBEDecomposition", "RBEReport", "RBEStats", "ReplicasDivergedError", "decompose", "evaluate"]
