"""The package's layers import only the ones below them: ops (tensor math) -> losses -> patching
-> rbe -> train / cli.  Checked in fresh interpreters, where nothing else has been imported yet."""

import subprocess
import sys

import pytest

import hf_mhce

# layer -> modules that must not be loaded by importing it
FORBIDDEN = {
    "hf_mhce.ops": ["transformers", "hf_mhce.losses", "hf_mhce.patching", "hf_mhce.rbe"],
    "hf_mhce.losses": ["transformers", "hf_mhce.patching", "hf_mhce.rbe"],
    "hf_mhce.patching": ["hf_mhce.rbe", "hf_mhce.train", "hf_mhce.cli"],
    "hf_mhce.rbe": ["hf_mhce.train", "hf_mhce.cli"],
}
OPS_MODULES = ["budget", "mixture", "torch_logprobs", "torch_sweep"]


def _loaded_after(statement):
    code = f"import sys\n{statement}\nprint(' '.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_lower_layers(layer):
    statement = f"import {layer}"
    if layer == "hf_mhce.ops":
        statement += "\n" + "\n".join(f"import hf_mhce.ops.{name}" for name in OPS_MODULES)
    loaded = _loaded_after(statement)
    assert layer in loaded
    wrong = [m for m in FORBIDDEN[layer] if m in loaded]
    assert not wrong, f"importing {layer} loaded {wrong}"


def test_top_level_names_resolve_lazily():
    loaded = _loaded_after("import hf_mhce")
    assert "transformers" not in loaded and "hf_mhce.patching" not in loaded
    for name in hf_mhce.__all__:
        assert getattr(hf_mhce, name).__name__ == name
    assert set(hf_mhce.__all__) <= set(dir(hf_mhce))
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        hf_mhce.not_a_name
    namespace = {}
    exec("from hf_mhce import *", namespace)
    assert {"apply_patch", "RBECallback", "linear_cross_entropy"} <= set(namespace)
