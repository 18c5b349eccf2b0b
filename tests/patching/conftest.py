import pytest


@pytest.fixture(autouse=True)
def _single_thread_for_tiny_models(single_thread):
    """Every test here runs tiny models: see ``single_thread`` in tests/conftest.py."""
    yield
