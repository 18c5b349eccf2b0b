"""Patching layer: route transformers causal LMs through hf_mhce's fused losses.

    import hf_mhce
    model = hf_mhce.apply_patch(model, loss="mhce", num_heads=4)   # or loss="ce"
    hf_mhce.unpatch(model)
    model = hf_mhce.from_pretrained(path)                           # restores the saved loss config

The loss config is recorded in ``model.config.hf_mhce`` (``CONFIG_KEY``), so it travels with
save_pretrained / from_pretrained.
"""

from .api import add_card_section, apply_patch, from_pretrained, is_patched, unpatch
from .config import CONFIG_KEY, LOSSES, LossConfig, SavedLossMismatchError
from .families import FAMILIES, TESTED_FAMILIES, LogitFacts, UnsupportedModelError
from .head import UnsupportedHeadError
from .methods import PatchBypassedError
from .trl_reference import UnpatchedReferenceError

__all__ = [
    "apply_patch",
    "unpatch",
    "from_pretrained",
    "is_patched",
    "add_card_section",
    "LossConfig",
    "SavedLossMismatchError",
    "CONFIG_KEY",
    "LOSSES",
    "FAMILIES",
    "TESTED_FAMILIES",
    "LogitFacts",
    "UnsupportedModelError",
    "UnsupportedHeadError",
    "PatchBypassedError",
    "UnpatchedReferenceError",
]
