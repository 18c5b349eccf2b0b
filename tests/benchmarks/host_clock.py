"""CUDA timing on the host clock, for the timer tests on a machine without a GPU."""

import time

import torch


def stub_cuda_timing(monkeypatch, samples: list | None = None):
    """torch.cuda.Event on perf_counter (each elapsed_time also appended to ``samples`` where given), a no-op
    synchronize and a tiny L2 flush buffer for benchmarks/timing.py; returns the Event class."""
    import timing

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, end):
            ms = 1000 * (end.t - self.t)
            if samples is not None:
                samples.append(ms)
            return ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(timing, "_flush_buffer", lambda device: torch.empty(1))
    return Event
