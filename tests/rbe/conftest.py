import pytest
from cli_helpers import build_checkpoints


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """Tiny checkpoints (GPT-2 with 32 positions, Llama, a Llama classifier, a LoRA adapter), with and
    without tokenizer files, and the evaluation text: built once for the `hf-mhce rbe` input tests."""
    return build_checkpoints(tmp_path_factory)
