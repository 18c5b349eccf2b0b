"""Brute-force references for the RBE tests: the full logits (or mixture log-probs) of an unpatched
copy of the model, and from them per-token NLL and rank by the definition (float64 NLL; the rank
as a float32 comparison count, as the fused sweep takes it)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

_PATCHING = str(Path(__file__).resolve().parent.parent / "patching")
if _PATCHING not in sys.path:
    sys.path.insert(0, _PATCHING)

from patching_models import make_model, mixture_logprobs_reference, token_dataset  # noqa: E402,F401

from hf_mhce.patching import CONFIG_KEY, is_patched  # noqa: E402

METRICS = ("error_entropy", "self_alignment", "confidence", "cross_entropy", "top1", "top5", "mean_rank",
           "num_tokens")


def unpatched_copy(model):
    """An eval-mode, unpatched copy (same weights, independent storage): the original HF forward.

    Built as a fresh instance of the model's class with a copy of its state dict rather than as
    ``unpatch(copy.deepcopy(model))``: a deep copy of a patched model does not unpatch cleanly
    (the patch state's "no instance forward" sentinel is copied, so unpatch installs the copy of
    the sentinel as the forward)."""
    config = copy.deepcopy(model.config)
    if hasattr(config, CONFIG_KEY):
        delattr(config, CONFIG_KEY)
    ref = type(model)(config)
    ref.load_state_dict(copy.deepcopy(model.state_dict()))
    assert not is_patched(ref) and "forward" not in ref.__dict__
    return ref.eval()


@torch.no_grad()
def reference_token_stats(model, rows, *, loss: str = "ce", num_heads: int = 1):
    """(nll float64 [N], rank int64 [N], argmax_hit bool [N]) over the counted tokens of ``rows``.

    loss "ce": log_softmax of the unpatched model's logits.  loss "mhce": the mixture log-probs by
    their definition from the unpatched decoder's last hidden state and the head weight (the
    tiny models here have no logit scaling or bias).  Rows are evaluated one at a time, so the
    reference does not depend on the batching.
    """
    ref = unpatched_copy(model)
    nll, ranks, hits = [], [], []
    for row in rows:
        ids = torch.as_tensor(row["input_ids"]).reshape(1, -1)
        labels = torch.as_tensor(row.get("labels", row["input_ids"])).reshape(1, -1)
        if loss == "ce":
            logp = torch.log_softmax(ref(input_ids=ids).logits.double(), -1)
        else:
            hidden = ref.get_decoder()(input_ids=ids).last_hidden_state
            logp = mixture_logprobs_reference(hidden, ref.get_output_embeddings().weight, num_heads)
        target = F.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)
        logp = logp.reshape(-1, logp.shape[-1])
        keep = target != -100
        logp, target = logp[keep], target[keep]
        tgt = logp.gather(1, target[:, None])
        nll.append(-tgt[:, 0])
        lp32 = logp.float()
        ranks.append((lp32 > lp32.gather(1, target[:, None])).sum(1))
        hits.append(logp.argmax(1) == target)
    return torch.cat(nll), torch.cat(ranks), torch.cat(hits)


def rank_histogram(ranks: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ranks, minlength=vocab)


def mixed_dataset(n: int, seq: int = 16, vocab: int = 97, seed: int = 0, ragged: bool = False):
    """Rows alternating between the learnable counting rows of ``token_dataset`` and uniformly
    random tokens, so that a briefly trained model ranks targets anywhere from first to last."""
    rows = token_dataset(n, seq=seq, vocab=vocab, seed=seed, ragged=ragged)
    g = torch.Generator().manual_seed(seed + 1000)
    for row in rows[1::2]:
        ids = torch.randint(0, vocab, (seq,), generator=g)
        row["labels"] = torch.where(row["labels"] == -100, row["labels"], ids)
        row["input_ids"] = ids
    return rows
