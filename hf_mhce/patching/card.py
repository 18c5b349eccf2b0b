"""Model-card section written next to a patched model's checkpoint.

``save_pretrained`` of a patched model (and so ``Trainer.save_model``) writes or refreshes a
section of ``README.md`` in the save directory, between hf_mhce markers (the rest of the card is
left as it is): the loss configuration, for MHCE the statement that hf_mhce is needed to reproduce
the trained distribution with the lines that load it, and sections contributed by upper
layers (the RBE callback adds its final table and plot links) through ``set_card_section``.
The template is ``templates/model_card_section.md`` (also under model_cards/ in the repository).
"""

from __future__ import annotations

import os
import re
from importlib import resources
from string import Template
from typing import Callable

SECTIONS_ATTR = "_hf_mhce_card_sections"
_BLOCK = re.compile(r"<!-- hf_mhce:begin.*?<!-- hf_mhce:end -->\n?", re.S)
_MHCE_NOTE = """
**This model predicts with a mixture of $num_heads softmaxes.** Its distribution is the uniform
mixture of $num_heads softmaxes over contiguous slices of the final hidden state, not
`softmax(W x)`. transformers alone (`AutoModelForCausalLM.from_pretrained`, or the model's class)
loads the weights but computes a different distribution; to reproduce the trained one (generation, evaluation, perplexity), install
`hf-mhce` and load with:

```python
import hf_mhce
${remote_comment}model = hf_mhce.from_pretrained("$name_or_path"$remote_kwarg)$where
```
"""
# Without it transformers refuses a folder whose model class is custom code ("contains custom code").
_REMOTE_COMMENT = "# trust_remote_code=True runs the model's own modeling code (auto_map in config.json)\n"


def set_card_section(model, title: str, render: Callable[[str], str] | None) -> None:
    """Register (or with ``render=None`` remove) a card section; ``render(save_directory)`` -> markdown."""
    sections = model.__dict__.setdefault(SECTIONS_ATTR, {})
    if render is None:
        sections.pop(title, None)
    else:
        sections[title] = render


def needs_remote_code(model) -> bool:
    """Whether loading the saved model takes trust_remote_code=True: its config maps the Auto classes to
    custom code and the model is an instance of that code, not of transformers' own class (Phi-3 or
    Falcon checkpoints keep an auto_map although transformers has the class: trusting it there would
    fetch and run other code than what was trained)."""
    return bool(getattr(model.config, "auto_map", None)) and not type(model).__module__.startswith("transformers.")


def render_section(model, config, save_directory: str, adapter: bool = False, name: str | None = None) -> str:
    """``adapter``: a PEFT adapter saved alone, whose loss config is in hf_mhce.json (no config.json).
    ``name``: what the loading line loads (the Hub repo id of a push), else the save directory."""
    template = Template(resources.files(__package__).joinpath("templates/model_card_section.md").read_text())
    saved = config.to_saved()
    rows = "\n".join(f"| {k} | `{v}` |" for k, v in saved.items() if k != "format")
    note = ""
    if config.loss == "mhce":  # load what was saved here (the model's _name_or_path is where it came from),
        # by an absolute path: a relative one read from another directory is taken for a Hub id
        remote = needs_remote_code(model)
        note = Template(_MHCE_NOTE).substitute(num_heads=config.num_heads, name_or_path=name or os.path.abspath(save_directory),
                                               remote_comment=_REMOTE_COMMENT if remote else "",
                                               remote_kwarg=", trust_remote_code=True" if remote else "",
                                               where="" if name else "  # or the Hub id this folder is pushed to")
    extra = ""
    for title, render in model.__dict__.get(SECTIONS_ATTR, {}).items():
        body = render(save_directory)
        if body:
            extra += f"\n### {title}\n\n{body.strip()}\n"
    title = (f"multi-head cross-entropy (MHCE, {config.num_heads} heads)" if config.loss == "mhce"
             else "linear cross-entropy (same loss as transformers, without materialised logits)")
    stored_in = "`hf_mhce.json` beside the adapter" if adapter else "`config.json` under `hf_mhce`"
    return template.substitute(loss_title=title, config_rows=rows, mhce_note=note, sections=extra, stored_in=stored_in)


def write_card(model, config, save_directory: str, adapter: bool = False, name: str | None = None) -> str:
    """Insert or refresh the hf_mhce section of ``<save_directory>/README.md``; returns its path."""
    path = os.path.join(save_directory, "README.md")
    section = render_section(model, config, save_directory, adapter, name)
    existing = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            existing = f.read()
    if _BLOCK.search(existing):
        text = _BLOCK.sub(lambda _: section, existing, count=1)
    else:
        text = (existing.rstrip() + "\n\n" if existing.strip() else "") + section
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
