"""The loss configuration a patched model carries, and the rules for changing it.

``LossConfig`` is recorded in ``model.config.hf_mhce`` (``CONFIG_KEY``) as a plain dict, so that
``save_pretrained`` writes it into config.json and any ``from_pretrained`` reads it back.  The
fields ``loss`` and ``num_heads`` define what the model's logits *mean* (softmax over W x, or the
log-probabilities of a mixture of ``num_heads`` softmaxes), so a recorded value of either can only
be changed deliberately (``override_saved=True``); every other field is a training option that a
later ``apply_patch`` call may update freely.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import warnings
from dataclasses import dataclass

from ..losses.checks import as_count, as_index, as_number
from ..losses.dispatch import BACKENDS

CONFIG_KEY = "hf_mhce"
# Beside a PEFT adapter saved alone (no config.json of its own): the loss config it was trained with,
# and a digest of the adapter weights it was written with (WEIGHTS_DIGEST_KEY).
ADAPTER_CONFIG_FILE = "hf_mhce.json"
ADAPTER_WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin")
WEIGHTS_DIGEST_KEY = "adapter_weights_sha256"
LOSSES = ("ce", "mhce")
CONFIG_FORMAT = 1

# Fields that change the model's distribution: recorded values need override_saved to change.
IDENTITY_FIELDS = ("loss", "num_heads")
# Fields that depend on the machine or the caller, not the model: never written to config.json.
RUNTIME_FIELDS = ("backend", "return_logits")


class SavedLossMismatchError(ValueError):
    """apply_patch asked for a loss / num_heads other than the one the model's config records."""


@dataclass(frozen=True)
class LossConfig:
    """Loss of a patched causal LM.

    loss: "ce" (cross-entropy on W x) or "mhce" (multi-head cross-entropy: the hidden state is split
        into ``num_heads`` contiguous slices, each with its own softmax; the model's distribution is
        their uniform mixture, and its logits are that mixture's log-probabilities).
    num_heads: number of MHCE heads; must divide the hidden size; 1 for "ce".
    ignore_index: label value that is not a prediction target (HF default -100).
    label_smoothing, z_loss: training regularisers passed to the fused loss.
    return_logits: whether a forward given labels also computes logits. None (default): only when a
        transformers Trainer's prediction step will pass them on (``compute_metrics`` is set, or
        ``predict()``); otherwise they are None. True / False: always / never.
    backend: kernel choice of the op layer ("auto", "triton", "torch"; None = environment default).
    """

    loss: str = "ce"
    num_heads: int = 1
    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    return_logits: bool | None = None
    backend: str | None = None

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}: hf_mhce supports loss in {LOSSES}")
        heads = as_count(self.num_heads, "num_heads")  # numpy / 0-d torch integers too
        object.__setattr__(self, "num_heads", heads)
        if self.loss == "ce" and heads != 1:
            raise ValueError(f"num_heads={heads} only applies to loss='mhce'; loss='ce' has a single head")
        # numbers of any type, stored as Python ints / floats (config.json stays typed)
        object.__setattr__(self, "ignore_index", as_index(self.ignore_index, "ignore_index"))
        for name in ("label_smoothing", "z_loss"):
            object.__setattr__(self, name, as_number(getattr(self, name), name))
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        if not (self.z_loss >= 0.0 and math.isfinite(self.z_loss)):
            raise ValueError(f"z_loss must be a finite number >= 0, got {self.z_loss}")
        if self.return_logits is not None and not isinstance(self.return_logits, bool):
            raise TypeError(f"return_logits must be a bool or None, got {self.return_logits!r}")
        if self.backend is not None and (not isinstance(self.backend, str) or self.backend.lower() not in BACKENDS):
            raise ValueError(f"backend must be one of {BACKENDS} or None (HF_MHCE_BACKEND, else 'auto'), "
                             f"got {self.backend!r}")

    def to_saved(self) -> dict:
        """The dict stored under ``model.config.hf_mhce`` (JSON-serialisable)."""
        saved = {k: v for k, v in dataclasses.asdict(self).items() if k not in RUNTIME_FIELDS}
        return {"format": CONFIG_FORMAT, **saved}

    @classmethod
    def from_saved(cls, saved, source: str = f"model.config.{CONFIG_KEY}") -> LossConfig:
        """The config a record holds (``source`` names the record in errors).  Every field is read as written
        or refused: a misspelt or missing field would otherwise train a different loss without a word."""
        if not isinstance(saved, dict) or saved.get("loss") is None:
            raise ValueError(f"{source} is not an hf_mhce loss config: {saved!r}")
        fmt = saved.get("format", CONFIG_FORMAT)
        if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt > CONFIG_FORMAT:
            # a later format may mean more than the fields read below: never drop it silently
            raise ValueError(f"{source} has format {fmt!r}, which this hf_mhce does not read (it "
                             f"reads format <= {CONFIG_FORMAT}): the model was saved by a newer hf_mhce; upgrade it")
        known = [f.name for f in dataclasses.fields(cls) if f.name not in RUNTIME_FIELDS]
        unknown = sorted(set(saved) - set(known) - set(RUNTIME_FIELDS) - {"format"}, key=str)  # runtime: older records
        if unknown:
            close = {k: difflib.get_close_matches(str(k), known, 1) for k in unknown}
            hints = "".join(f" ({k!r}: did you mean {m[0]!r}?)" for k, m in close.items() if m)
            raise ValueError(f"{source} has unknown field(s) {unknown}{hints}; an hf_mhce loss config records "
                             f"{['format', *known]}")
        if saved["loss"] == "mhce" and "num_heads" not in saved:
            raise ValueError(f"{source} records loss='mhce' without num_heads (the number of heads the model was "
                             f"trained with)")
        try:
            return cls(**{k: saved[k] for k in known if k in saved})
        except (TypeError, ValueError) as err:
            raise type(err)(f"{source}: {err}") from err


def adapter_weights_digest(directory: str) -> str | None:
    """sha256 of the adapter weights file in ``directory`` (None without one)."""
    for name in ADAPTER_WEIGHTS_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            return digest.hexdigest()
    return None


def write_adapter_config(directory: str, cfg: LossConfig) -> None:
    """hf_mhce.json beside the adapter PEFT just saved, with the digest of its weights: a later save of the
    same folder without hf_mhce (after ``unpatch``) rewrites the weights but leaves this file, which must
    not then give those weights a loss they were not saved with."""
    saved = cfg.to_saved()
    digest = adapter_weights_digest(directory)
    with open(os.path.join(directory, ADAPTER_CONFIG_FILE), "w") as f:
        json.dump(saved if digest is None else {**saved, WEIGHTS_DIGEST_KEY: digest}, f, indent=2)


def read_adapter_config(directory: str) -> dict | None:
    """The loss config saved beside a PEFT adapter; None when there is none, or (with a warning) when it was
    written for other weights than the folder now holds."""
    path = os.path.join(directory, ADAPTER_CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        saved = json.load(f)
    digest = saved.pop(WEIGHTS_DIGEST_KEY, None) if isinstance(saved, dict) else None
    LossConfig.from_saved(saved, source=path)  # a malformed file fails here, naming itself
    if digest is not None and digest != adapter_weights_digest(directory):
        warnings.warn(f"{path} was written for other adapter weights than {directory} now holds (the adapter was "
                      f"saved again without hf_mhce, e.g. after unpatch): its loss config {saved} is not applied; "
                      "give loss=... / num_heads=... to apply one", stacklevel=3)
        return None
    return saved


def adapter_base(path: str) -> str | None:
    """The base model recorded by a local PEFT adapter directory (None for anything else)."""
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f).get("base_model_name_or_path")


def checkpoint_config(path: str, trust_remote_code: bool = False) -> tuple[dict | None, object]:
    """(the loss config a checkpoint records, or None; its transformers config), without the weights.
    A PEFT adapter directory records the loss beside it (hf_mhce.json) and takes its base's config.
    ``trust_remote_code``: run a config class the checkpoint carries as custom code (auto_map); False
    refuses it at once (transformers' None would prompt on a terminal)."""
    from transformers import AutoConfig

    base = adapter_base(path)
    if base is not None:
        return read_adapter_config(path), AutoConfig.from_pretrained(base, trust_remote_code=trust_remote_code)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return getattr(config, CONFIG_KEY, None), config


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(LossConfig) if f.name not in IDENTITY_FIELDS)


def resolve_config(
    saved: dict | None,
    current: LossConfig | None,
    loss: str | None,
    num_heads: int | None,
    options: dict,
    override_saved: bool,
) -> LossConfig:
    """The config an ``apply_patch`` call asks for.

    Starts from the instance's current config (a re-patch updates it), else the one recorded in
    ``model.config``, else the defaults; ``loss``/``num_heads``/``options`` given explicitly replace
    those fields.  Changing a recorded ``loss`` or ``num_heads`` raises unless ``override_saved``.
    """
    if not isinstance(override_saved, bool):
        raise TypeError(f"override_saved must be a bool, got {override_saved!r}")
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        valid = ["loss", "num_heads", "override_saved", *OPTION_NAMES]
        close = {k: difflib.get_close_matches(k, valid, 1) for k in unknown}
        hints = "".join(f" ({k!r}: did you mean {m[0]!r}?)" for k, m in close.items() if m)
        raise TypeError(f"unknown apply_patch argument(s) {unknown}{hints}; valid arguments: {valid}")
    if loss is not None and loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}: hf_mhce supports loss in {LOSSES}")
    recorded = LossConfig.from_saved(saved) if saved is not None else None
    base = current or recorded or LossConfig()
    if current is not None and recorded is not None:
        # runtime fields are never recorded; everything else follows the (possibly edited) model.config.
        base = dataclasses.replace(recorded, **{f: getattr(current, f) for f in RUNTIME_FIELDS})

    new_loss = base.loss if loss is None else loss
    if num_heads is None:
        if new_loss == "ce":
            num_heads = 1
        elif base.loss == "mhce":
            num_heads = base.num_heads
        else:
            raise ValueError("loss='mhce' needs num_heads (the number of heads; it must divide the hidden size)")
    cfg = dataclasses.replace(base, loss=new_loss, num_heads=num_heads, **options)

    if recorded is not None and not override_saved:
        was = (recorded.loss, recorded.num_heads)
        now = (cfg.loss, cfg.num_heads)
        if was != now:
            raise SavedLossMismatchError(
                f"this model's config records {CONFIG_KEY}: loss={was[0]!r}, num_heads={was[1]} (saved with the "
                f"checkpoint or set by an earlier apply_patch: what its outputs mean), but loss={now[0]!r}, "
                f"num_heads={now[1]} was requested. Pass override_saved=True to apply_patch to change it deliberately."
            )
    return cfg
