"""hf_mhce: fused linear cross-entropy, multi-head cross-entropy (MHCE) and the RBE decomposition
of cross-entropy for Hugging Face Transformers."""

from .losses import linear_cross_entropy, multi_head_cross_entropy, multi_head_logprobs
from .patching import apply_patch, from_pretrained, unpatch
from .rbe import RBECallback

__version__ = "0.1.0"

__all__ = [
    "linear_cross_entropy", "multi_head_cross_entropy", "multi_head_logprobs",
    "apply_patch", "unpatch", "from_pretrained",
    "RBECallback",
]
