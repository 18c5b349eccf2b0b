import os

# Must happen before anything imports triton or hf_mhce's kernel modules: lets backend="triton"
# run the Triton kernels on CPU tensors through the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

_TESTS = Path(__file__).resolve().parent
_ROOT = _TESTS.parent
# `import reference` from any test module; `import hf_mhce` from a source checkout even when the
# package is not installed (CI installs it editable; then this is harmless).
for _p in (str(_TESTS), str(_ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)


# Skip only when `import triton` fails; triton is installed in CI, so the Triton tests run there.
# Defined in reference.py (an ordinary module the tests import; "conftest" is an ambiguous module
# name when several directories have one) and re-exported here.
from reference import HAVE_TRITON, requires_triton  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _seed():
    """Deterministic random inputs for every test."""
    torch.manual_seed(0)
    yield


@pytest.fixture
def seed():
    """Explicit reseeding helper: ``seed(n)`` resets torch's RNG."""

    def _s(n: int) -> None:
        torch.manual_seed(n)

    return _s


@pytest.fixture(autouse=True)
def _clean_backend_env(monkeypatch):
    """Tests pick backends explicitly; an HF_MHCE_BACKEND / HF_MHCE_CHUNK_MB from the caller's
    shell must not change what they exercise."""
    monkeypatch.delenv("HF_MHCE_BACKEND", raising=False)
    monkeypatch.delenv("HF_MHCE_CHUNK_MB", raising=False)
    yield


@pytest.fixture
def single_thread():
    """One intra-op thread, for tests that train or evaluate tiny models: their ops are too small
    for threads to help, and on a 2-core machine shared with other jobs OpenMP spin-waiting makes
    them up to ~50x slower (measured on 20-step Trainer runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_accelerator_state():
    """No accelerate state left by an earlier test's Trainer (a state without mixed precision refuses
    an Accelerator(mixed_precision="bf16"))."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield
