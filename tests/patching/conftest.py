import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    """The models here are tiny: intra-op threads only add overhead, and on a 2-core machine shared with
    other jobs they oversubscribe the cores (measured: 20-step Trainer runs ~50x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
