"""Collection of per-token ranks and NLL from the loss calls of an evaluation.

Inside ``with collect_ranks(sink):`` every fused loss computed without gradient (an evaluation
forward) also asks the sweep for the target ranks -- in the same pass for one head -- and calls
``sink(ranks, nll)`` with the counted tokens' ranks (int64) and NLL -log pbar_t (float32/64, no
label smoothing or z-loss).  The patched model forward needs no new argument for this: the RBE
callback enters the context around each of the evaluated model's forwards (hooks), ``rbe.evaluate`` around its loop.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch

RankSink = Callable[[torch.Tensor, torch.Tensor], None]
_state = threading.local()


@contextlib.contextmanager
def collect_ranks(sink: RankSink):
    previous = getattr(_state, "sink", None)
    _state.sink = sink
    try:
        yield sink
    finally:
        _state.sink = previous


def active_sink() -> RankSink | None:
    """The sink to feed, if collection is on and this call computes no gradient."""
    sink = getattr(_state, "sink", None)
    return sink if sink is not None and not torch.is_grad_enabled() else None
