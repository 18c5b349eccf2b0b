"""Rank statistics of an evaluation and the exact RBE decomposition of its cross-entropy.

For every evaluated token, its rank-based error e (RBE) is the number of vocabulary entries whose
predicted probability is strictly greater than the target's.  Two vectors over e = 0..V-1 hold
everything the decomposition needs: token counts n_e (int64) and NLL sums S_e (float64).  They add
across batches and processes, so the decomposition is exact under distributed evaluation.

With N = sum n_e, p_e = n_e / N, Q_e = exp(-S_e / n_e) and C = sum_e Q_e over observed ranks,

    CE = Error-Entropy + Self-Alignment - Confidence
    Error-Entropy = -sum p_e log p_e,  Self-Alignment = KL(p || Q / C),  Confidence = log C.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from .placement import collective_device


class RBEStats:
    """Per-rank token counts and NLL sums over a vocabulary of ``vocab_size`` entries."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu"):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.counts = torch.zeros(vocab_size, dtype=torch.int64, device=device)
        self.nll_sums = torch.zeros(vocab_size, dtype=torch.float64, device=device)

    @property
    def vocab_size(self) -> int:
        return self.counts.numel()

    @property
    def num_tokens(self) -> int:
        return int(self.counts.sum())

    def add(self, ranks: torch.Tensor, nll: torch.Tensor) -> "RBEStats":
        """Add tokens with integer ``ranks`` in [0, V) and their NLL (same shape)."""
        ranks = ranks.reshape(-1).to(device=self.counts.device, dtype=torch.int64)
        nll = nll.reshape(-1).to(device=self.counts.device, dtype=torch.float64)
        if ranks.shape != nll.shape:
            raise ValueError(f"ranks {tuple(ranks.shape)} and nll {tuple(nll.shape)} must have the same size")
        if ranks.numel() and (int(ranks.min()) < 0 or int(ranks.max()) >= self.vocab_size):
            raise ValueError(f"ranks must lie in [0, {self.vocab_size}), got [{int(ranks.min())}, {int(ranks.max())}]")
        self.counts.index_add_(0, ranks, torch.ones_like(ranks))
        self.nll_sums.index_add_(0, ranks, nll)
        return self

    def merge(self, other: "RBEStats") -> "RBEStats":
        if other.vocab_size != self.vocab_size:
            raise ValueError(f"cannot merge statistics over {other.vocab_size} and {self.vocab_size} entries")
        self.counts += other.counts.to(self.counts.device)
        self.nll_sums += other.nll_sums.to(self.nll_sums.device)
        return self

    def all_reduce(self, group=None) -> "RBEStats":
        """Sum over the processes of ``group`` (torch.distributed, exact: int64 and float64 sums)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            device = collective_device(group)  # NCCL reduces CUDA tensors only: there and back
            for tensor in (self.counts, self.nll_sums):
                moved = tensor.to(device)
                dist.all_reduce(moved, group=group)
                if moved is not tensor:
                    tensor.copy_(moved)
        return self

    def reset(self) -> None:
        self.counts.zero_()
        self.nll_sums.zero_()

    def state_dict(self) -> dict:
        return {"counts": self.counts.clone(), "nll_sums": self.nll_sums.clone()}

    def load_state_dict(self, state: dict) -> None:
        counts, sums = state["counts"], state["nll_sums"]
        if counts.shape != self.counts.shape or sums.shape != self.nll_sums.shape:
            raise ValueError(f"state over {counts.numel()} ranks does not fit statistics over {self.vocab_size}")
        self.counts.copy_(counts)
        self.nll_sums.copy_(sums)

    def decompose(self) -> "RBEDecomposition":
        return decompose(self.counts, self.nll_sums)


@dataclass(frozen=True)
class RBEDecomposition:
    """CE = error_entropy + self_alignment - confidence (nats), with rank summaries."""

    error_entropy: float
    self_alignment: float
    confidence: float
    cross_entropy: float
    num_tokens: int
    top1: float
    top5: float
    mean_rank: float

    def as_dict(self, prefix: str = "") -> dict:
        return {f"{prefix}{k}": v for k, v in asdict(self).items()}


def decompose(counts: torch.Tensor, nll_sums: torch.Tensor) -> RBEDecomposition:
    """The RBE decomposition from per-rank counts and NLL sums (sums over observed ranks only).

    Infinite NLLs (targets masked by a -inf bias) give an infinite cross-entropy.  Where every observed rank's
    mean NLL is infinite, Confidence is -inf and Self-Alignment is NaN: q = Q / sum(Q) is 0/0 there."""
    counts = torch.as_tensor(counts).reshape(-1).to(torch.float64).cpu()
    nll_sums = torch.as_tensor(nll_sums).reshape(-1).to(torch.float64).cpu()
    if counts.shape != nll_sums.shape:
        raise ValueError(f"counts {tuple(counts.shape)} and nll_sums {tuple(nll_sums.shape)} must match")
    if bool((counts < 0).any()):
        raise ValueError("counts must be non-negative")
    total = counts.sum()
    if total <= 0:
        raise ValueError("no tokens: the decomposition of an empty evaluation is undefined")
    observed = counts > 0
    ranks = observed.nonzero().squeeze(1).to(torch.float64)
    n, s = counts[observed], nll_sums[observed]
    p = n / total
    log_q_unnorm = -s / n  # log Q_e
    log_c = torch.logsumexp(log_q_unnorm, 0)  # log-space: Q_e underflows for NLL > ~745
    log_p = torch.log(p)
    ee = -(p * log_p).sum() + 0.0  # + 0.0: one observed rank gives -0.0, printed "-0.000000"
    sa = (p * (log_p - (log_q_unnorm - log_c))).sum()
    return RBEDecomposition(
        error_entropy=float(ee),
        self_alignment=float(sa),
        confidence=float(log_c),
        cross_entropy=float(nll_sums.sum() / total),
        num_tokens=int(total),
        top1=float(counts[0] / total),
        top5=float(counts[:5].sum() / total),
        mean_rank=float((ranks * n).sum() / total),
    )


def check_identity(d: RBEDecomposition, rel: float = 1e-9) -> bool:
    """True when error_entropy + self_alignment - confidence equals cross_entropy to ``rel``."""
    lhs = d.error_entropy + d.self_alignment - d.confidence
    return math.isclose(lhs, d.cross_entropy, rel_tol=rel, abs_tol=rel)
