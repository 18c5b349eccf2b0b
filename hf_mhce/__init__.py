"""hf_mhce: fused linear cross-entropy, multi-head cross-entropy (MHCE) and the RBE decomposition
of cross-entropy for Hugging Face Transformers."""

import importlib

__version__ = "0.1.0"

# Public name -> the subpackage that defines it.  Imported on first access (PEP 562) so that
# `import hf_mhce.ops` or `hf_mhce.losses` (pure tensor math) does not load transformers.
_EXPORTS = {
    "linear_cross_entropy": "losses",
    "multi_head_cross_entropy": "losses",
    "multi_head_logprobs": "losses",
    "apply_patch": "patching",
    "unpatch": "patching",
    "from_pretrained": "patching",
    "RBECallback": "rbe",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hf_mhce' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
