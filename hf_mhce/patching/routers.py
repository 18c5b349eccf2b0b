"""Mixture-of-experts causal LMs: the router's load-balancing loss, found as data.

transformers' MoE causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, PhiMoE, GPT-OSS, GraniteMoE, ...) all end
their forward the same way:

    aux_loss = load_balancing_loss_func(outputs.router_logits, self.num_experts,
                                        self.num_experts_per_tok, attention_mask)
    loss += self.router_aux_loss_coef * aux_loss          # only when labels are given

with ``output_router_logits`` (argument, else ``config.output_router_logits``) deciding whether the
decoder records router logits at all.  The function is a module-level copy in each family's modeling
file, the counts and the coefficient are attributes of the model instance.  ``RouterFacts`` records
where they are, so the generic forward adds the same term to the fused loss.  Families whose module
has no such function (GLM-4 MoE, Hunyuan MoE, ...) return router logits but add no loss term.  A
family that computes it otherwise fails the verification probe (probe.verify compares aux_loss and
loss) and is refused.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from torch import nn

ROUTER_FIELDS = ("aux_loss", "router_logits")  # what an MoE output type adds to a causal LM's
BALANCE_FUNCTION = "load_balancing_loss_func"
COUNT_ATTRS = ("num_experts", "num_experts_per_tok")
COEF_ATTRS = ("router_aux_loss_coef", "aux_loss_coef")  # the second is JetMoE's spelling


@dataclass(frozen=True)
class RouterFacts:
    """Where an MoE model keeps its load-balancing loss (names only: the state stays picklable)."""

    module: str | None  # the modeling module defining load_balancing_loss_func; None: no aux loss
    coef_attr: str | None = None  # the model attribute weighting aux_loss in the loss

    @property
    def adds_loss(self) -> bool:
        return self.module is not None


def router_facts(model: nn.Module, stock_forward) -> RouterFacts | str:
    """The model's RouterFacts, or why it has none (a reason for UnsupportedModelError).

    ``stock_forward``: the transformers forward the model's class runs or extends (its module holds
    the family's copy of the balancing function)."""
    module = getattr(stock_forward, "__module__", None)
    if module is None or not callable(getattr(importlib.import_module(module), BALANCE_FUNCTION, None)):
        return RouterFacts(module=None)  # router logits only (the verification probe checks no loss term is missed)
    coef = next((a for a in COEF_ATTRS if isinstance(getattr(model, a, None), (int, float))), None)
    missing = [a for a in COUNT_ATTRS if not isinstance(getattr(model, a, None), int)]
    missing += [] if coef else [" or ".join(COEF_ATTRS)]
    if missing:
        return (f"its output has {list(ROUTER_FIELDS)} but the model has no attribute {', '.join(missing)}, which "
                f"the router's load-balancing loss reads from the model instance (this family keeps them elsewhere, "
                f"e.g. in config.text_config), so hf_mhce cannot add that loss term")
    return RouterFacts(module=module, coef_attr=coef)


def wants_router_logits(model: nn.Module, kwargs: dict) -> bool:
    """The original forward's rule: the argument, else ``config.output_router_logits`` (a vision-language
    MoE, such as Ernie-4.5-VL, reads its text config's: ``config.text_config.output_router_logits``)."""
    value = kwargs.get("output_router_logits")
    config = model.config
    if value is None:
        value = getattr(config, "output_router_logits", None)
    if value is None and hasattr(config, "get_text_config"):
        value = getattr(config.get_text_config(), "output_router_logits", None)
    return bool(value)


def router_loss(model: nn.Module, facts: RouterFacts, router_logits, attention_mask):
    """(aux_loss, its weight in the loss), exactly as the family's forward computes them."""
    if router_logits is None or (isinstance(router_logits, (tuple, list)) and len(router_logits) == 0):
        raise ValueError(f"{type(model).__name__}'s decoder returned no router_logits although output_router_logits "
                         "is set: the load-balancing loss cannot be computed")
    balance = getattr(importlib.import_module(facts.module), BALANCE_FUNCTION)
    aux = balance(router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)
    return aux, getattr(model, facts.coef_attr)
