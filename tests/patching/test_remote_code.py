"""A checkpoint whose model is custom code (config.json's auto_map -> modeling file in the folder):
hf_mhce.from_pretrained(..., trust_remote_code=True) loads and patches it, and the model card written
on save loads it again as written (its line lacked trust_remote_code=True, which transformers requires).

``remote_code_checkpoint`` is also used by the CLI tests (tests/rbe, tests/train)."""

import json
import re

import pytest
import torch

import hf_mhce

# apply_patch warns that a remote-code forward is replaced by the fused one: intended
REPLACED_FORWARD = "ignore:.*defined outside transformers:UserWarning"
pytestmark = pytest.mark.filterwarnings(REPLACED_FORWARD)

_CONFIGURATION = '''
from transformers import PretrainedConfig


class ToyRemoteConfig(PretrainedConfig):
    model_type = "hf_mhce_toy_remote"

    def __init__(self, vocab_size=64, hidden_size=16, max_position_embeddings=64, **kwargs):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.max_position_embeddings = max_position_embeddings
        kwargs.setdefault("tie_word_embeddings", False)
        kwargs.setdefault("use_cache", False)  # no cache: generate feeds the whole sequence each step
        super().__init__(**kwargs)
'''

_MODELING = '''
import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_toy_remote import ToyRemoteConfig


class ToyRemoteDecoder(PreTrainedModel):
    config_class = ToyRemoteConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.mix = nn.Linear(config.hidden_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        h = self.embed(input_ids)
        n = torch.arange(1, h.shape[1] + 1, device=h.device).view(1, -1, 1)
        h = self.norm(h + torch.tanh(self.mix(h.cumsum(1) / n)))  # causal: a running mean
        return BaseModelOutputWithPast(last_hidden_state=h)


class ToyRemoteForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = ToyRemoteConfig
    _tied_weights_keys = {}

    def __init__(self, config):
        super().__init__(config)
        self.model = ToyRemoteDecoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_decoder(self):
        return self.model

    def get_input_embeddings(self):
        return self.model.embed

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        h = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(h)
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)
'''


def remote_code_checkpoint(path, tokenizer=None) -> str:
    """A random ToyRemoteForCausalLM saved in ``path`` with its code (configuration_toy_remote.py,
    modeling_toy_remote.py) and the auto_map pointing at it; ``tokenizer`` saved beside it (and its
    size the vocabulary)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True)
    (path / "configuration_toy_remote.py").write_text(_CONFIGURATION)
    (path / "modeling_toy_remote.py").write_text(_MODELING)
    (path / "config.json").write_text(json.dumps({
        "model_type": "hf_mhce_toy_remote", "vocab_size": len(tokenizer) if tokenizer is not None else 64,
        "architectures": ["ToyRemoteForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_toy_remote.ToyRemoteConfig",
                     "AutoModelForCausalLM": "modeling_toy_remote.ToyRemoteForCausalLM"}}))
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, trust_remote_code=True).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return str(path)


def _card_code(directory) -> str:
    """The python block of the hf_mhce section of ``directory``'s README.md."""
    card = (directory / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", card, re.S).group(1)


def test_the_card_of_a_remote_code_model_loads_it_as_written(tmp_path):
    ckpt = remote_code_checkpoint(tmp_path / "toy")
    model = hf_mhce.from_pretrained(ckpt, trust_remote_code=True, loss="mhce", num_heads=4).eval()
    assert type(model).__module__.startswith("transformers_modules")  # the folder's class, patched
    saved = tmp_path / "mhce"
    model.save_pretrained(saved)
    code = _card_code(saved)
    scope = {}
    exec(code, scope)  # was: ValueError "... contains custom code which must be executed ..."
    assert "# trust_remote_code=True runs the model's own modeling code" in code  # says what it opts in to
    loaded = scope["model"].eval()
    assert loaded.config.hf_mhce == model.config.hf_mhce and loaded.config.hf_mhce["num_heads"] == 4
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_transformers_class_gets_no_trust_remote_code(tmp_path):
    """A checkpoint of a class transformers has may keep an auto_map (Phi-3, Falcon on the Hub): trusting
    it would run other code than the class that was trained, so the card's line stays plain."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    model.config.auto_map = {"AutoModelForCausalLM": "someone/llama-remote--modeling_llama.LlamaForCausalLM"}
    hf_mhce.apply_patch(model, loss="mhce", num_heads=2).save_pretrained(tmp_path / "llama")
    assert f'hf_mhce.from_pretrained("{tmp_path / "llama"}")' in _card_code(tmp_path / "llama")
