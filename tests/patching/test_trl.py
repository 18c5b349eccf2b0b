"""TRL's trainers (>= 1.15) on a patched model.  They put their own fused LM head around the forward
(``add_fused_lm_head``, plain softmax(W x)); the patch's guard puts the patched forward back at the first
call and answers TRL's ``fused_lm_head=True`` itself, so CE trains exactly as with TRL's head and MHCE
trains on its mixture.  Tiny Llama, a character tokenizer, no downloads."""

import copy
import math
import tempfile

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import hf_mhce
from hf_mhce.patching.forward import STATE_ATTR
from hf_mhce.patching.methods import reaches_patched_forward, unwrap

import trl  # noqa: E402  (in the [test] extra: a missing install fails, never skips)
from packaging.version import Version  # noqa: E402
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

CHARS = list("abcdefghijklmnopqrstuvwxyz .,!?")
TEXTS = ["the cat sat on the mat.", "a dog ran far away!", "hello world, how are you?", "quick brown fox jumps.",
         "over the lazy dog again.", "python is a snake.", "trl trains models.", "numbers add up, or not?"]


def test_trl_has_the_fused_head():
    assert Version(trl.__version__) >= Version("1.15"), trl.__version__  # add_fused_lm_head: what these tests are about


def _tokenizer():
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def _model(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=37, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=2))


def _args(cls, **kw):
    base = dict(output_dir=tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
                logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False, max_length=64,
                disable_tqdm=True, seed=0)
    return cls(**{**base, **kw})


def _sft(model, **kw):
    data = Dataset.from_dict({"text": [TEXTS[i % 8] * (1 + i % 3) for i in range(12)]})
    return SFTTrainer(model=model, args=_args(SFTConfig, **kw), train_dataset=data, eval_dataset=data.select(range(4)),
                      processing_class=_tokenizer())


def _logs(trainer, keys=("loss", "entropy", "mean_token_accuracy")):
    return [{k: h[k] for k in keys} for h in trainer.state.log_history if "loss" in h]


def test_sft_ce_trains_as_with_trl_own_head():
    ref = _sft(_model())
    ref.train()
    ours = _sft(hf_mhce.apply_patch(_model()))
    ours.train()
    assert reaches_patched_forward(ours.model)  # TRL's wrapper was replaced at the first call
    for got, want in zip(_logs(ours), _logs(ref), strict=True):
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k
    for (name, p), q in zip(ours.model.named_parameters(), ref.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert ours.evaluate()["eval_loss"] == pytest.approx(ref.evaluate()["eval_loss"], rel=1e-5)


def test_sft_mhce_trains_on_the_mixture():
    model = hf_mhce.apply_patch(_model(), loss="mhce", num_heads=2)
    trainer = _sft(model, learning_rate=0.0, max_steps=1)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    with torch.no_grad():
        trl_loss = trainer.compute_loss(trainer.model, dict(batch))  # TRL's loss from our per-token log-probs
        own = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), labels=batch["labels"])
        mixture = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits  # log pbar
    torch.testing.assert_close(trl_loss, own.loss)
    lp, mask = mixture[:, :-1], batch["labels"][:, 1:] != -100
    entropy = (-(lp.exp() * lp).sum(-1))[mask].mean().item()
    assert trainer._metrics["train"]["entropy"][-1] == pytest.approx(entropy, rel=1e-5)
    trainer.train()
    assert math.isfinite(trainer.evaluate()["eval_loss"])
    assert unwrap(trainer.model).config.hf_mhce["loss"] == "mhce"


@pytest.mark.parametrize("peft", [False, True], ids=["full", "trl_peft_config"])
def test_sft_with_bf16_autocast(peft):
    """accelerate's bf16 autocast wraps the forward when training starts (around TRL's wrapper, or around the
    PeftModel TRL built from peft_config): the patched forward goes back inside it; with PEFT only the
    adapters train.  The bf16 loss is the fp32 one up to bf16 rounding."""
    from peft import LoraConfig

    losses = []
    for bf16 in (False, True):
        model = hf_mhce.apply_patch(_model(), loss="mhce", num_heads=2)
        data = Dataset.from_dict({"text": TEXTS})
        lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM") if peft else None
        trainer = SFTTrainer(model=model, args=_args(SFTConfig, bf16=bf16, max_steps=1), train_dataset=data,
                             processing_class=_tokenizer(), peft_config=lora)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        target = unwrap(trainer.model)
        assert reaches_patched_forward(target)
        if bf16 and not peft:  # with PEFT the autocast wraps the PeftModel's forward, outside ours
            assert target.__dict__[STATE_ATTR].autocast is not None
        changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
        assert changed and (not peft or all("lora_" in n for n in changed))
        losses.append(_logs(trainer)[0]["loss"])
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)


def test_dpo_mhce_log_probs_are_the_mixture():
    policy = hf_mhce.apply_patch(_model(), loss="mhce", num_heads=2)
    reference = copy.deepcopy(policy)
    data = Dataset.from_dict({"prompt": TEXTS[:4], "chosen": [" " + t for t in TEXTS[4:]],
                              "rejected": [" " + t[::-1] for t in TEXTS[4:]]})
    trainer = DPOTrainer(model=policy, ref_model=reference, args=_args(DPOConfig, max_steps=1, learning_rate=0.0),
                         train_dataset=data, processing_class=_tokenizer())
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h][0]
    assert logs["loss"] == pytest.approx(math.log(2), rel=1e-6)  # policy == reference
    with torch.no_grad():  # summed mixture log-probs of the completions, from the patched model's logits
        lp = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        per_token = lp.gather(-1, batch["input_ids"][:, 1:, None])[..., 0] * batch["completion_mask"][:, 1:]
        chosen = per_token.sum(1).chunk(2)[0].mean().item()
    assert logs["logps/chosen"] == pytest.approx(chosen, rel=1e-5)
