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
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from hf_mhce.patching import UnpatchedReferenceError  # noqa: E402

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
                logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True, seed=0)
    if cls is not GRPOConfig:  # GRPO has prompt and completion lengths instead
        base["max_length"] = 64
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


def _dpo_data():
    return Dataset.from_dict({"prompt": TEXTS[:4], "chosen": [" " + t for t in TEXTS[4:]],
                              "rejected": [" " + t[::-1] for t in TEXTS[4:]]})


def _reward(completions, **_):
    return [len(c) / 10 + c.count("a") * 0.3 for c in completions]


def _grpo(model, **kw):
    args = _args(GRPOConfig, **{**dict(num_generations=2, max_completion_length=6), **kw})
    return GRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=Dataset.from_dict({"prompt": TEXTS}),
                       processing_class=_tokenizer())


@pytest.mark.parametrize("kind", ["grpo", "dpo"])
@pytest.mark.parametrize("loss", ["ce", "mhce"])
def test_a_reference_model_trl_loads_itself(kind, loss):
    """GRPO (beta > 0) and DPO (ref_model=None) load the reference from the policy's checkpoint with plain
    transformers: for an MHCE policy that is another distribution, refused at the first step; once patched
    (apply_patch(trainer.ref_model)) policy == reference at step 1: KL 0, DPO loss log 2.  CE needs nothing."""
    path = tempfile.mkdtemp()
    hf_mhce.apply_patch(_model(), loss=loss, num_heads=2 if loss == "mhce" else None).save_pretrained(path)
    if kind == "grpo":
        trainer = _grpo(hf_mhce.from_pretrained(path), beta=0.1, learning_rate=0.0, max_steps=1)
    else:
        trainer = DPOTrainer(model=hf_mhce.from_pretrained(path), args=_args(DPOConfig, max_steps=1, learning_rate=0.0),
                             train_dataset=_dpo_data(), processing_class=_tokenizer())
    assert STATE_ATTR not in unwrap(trainer.ref_model).__dict__
    if loss == "mhce":
        with pytest.raises(UnpatchedReferenceError, match=r"hf_mhce.apply_patch\(trainer.ref_model\)"):
            trainer.train()
        hf_mhce.apply_patch(trainer.ref_model)
        assert unwrap(trainer.ref_model).config.hf_mhce["loss"] == "mhce"
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h][0]
    if kind == "grpo":
        assert logs["kl"] == 0.0
    else:
        assert logs["loss"] == pytest.approx(math.log(2), rel=1e-6)


def test_grpo_lm_head_in_float32_matches_trl():
    """GRPO's cast_lm_head_to_fp32 puts a float32 F.linear on the head instance; TRL's fused head then runs in
    float32 outside the bf16 autocast.  The patched CE model computes exactly that (logs and weights equal)."""
    trainers = []
    for patch in (False, True):
        model = hf_mhce.apply_patch(_model()) if patch else _model()
        trainers.append(_grpo(model, bf16=True, cast_lm_head_to_fp32=True))
        trainers[-1].train()
    assert reaches_patched_forward(trainers[1].model) and trainers[1].model.lm_head.weight.dtype == torch.float32
    keys = ("loss", "entropy", "reward", "grad_norm")
    for got, want in zip(_logs(trainers[1], keys), _logs(trainers[0], keys), strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7)
    for (name, p), q in zip(trainers[1].model.named_parameters(), trainers[0].model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    # Outside TRL's protocol and outside autocast (trainers not started), a bf16 body feeds the head's float32 F.linear
    models = [_grpo(m, cast_lm_head_to_fp32=True).model for m in (_model(), hf_mhce.apply_patch(_model()))]
    ids = torch.tensor([[1, 5, 9, 14, 20, 7]])
    with torch.no_grad():
        want, got = (m.model.to(torch.bfloat16) and m(input_ids=ids, labels=ids).loss for m in models)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(want.item(), rel=1e-6)


def test_a_second_trainer_on_the_same_model():
    """Each TRL trainer wraps the forward it finds, an earlier trainer's fused head included: the patch
    follows the chain, takes the last trainer's options and trains as a single trainer would."""
    losses = []
    for trainers in (1, 2):
        model = hf_mhce.apply_patch(_model(), loss="mhce", num_heads=2)
        for _ in range(trainers):
            trainer = _sft(model, max_steps=1)
        trainer.train()
        assert reaches_patched_forward(trainer.model)
        losses.append(_logs(trainer)[0]["loss"])
    assert losses[1] == losses[0]


def test_an_fp32_trainer_after_a_bf16_one_runs_in_fp32():
    """A bf16 trainer leaves accelerate's autocast on the forward; a later fp32 trainer's TRL head calls the
    backbone itself, outside it.  The patched model kept the bf16 autocast for those calls (loss and
    grad_norm 3e-4 off); now its logs equal the unpatched model's to float32 rounding."""
    logs = []
    for patch in (False, True):
        model = hf_mhce.apply_patch(_model()) if patch else _model()
        _sft(model, bf16=True, max_steps=1, learning_rate=0.0).train()
        second = _sft(model, max_steps=2, optim="sgd", learning_rate=0.5)
        second.train()
        logs.append(_logs(second, ("loss", "entropy", "grad_norm")))
    for got, want in zip(*reversed(logs), strict=True):
        assert got == pytest.approx(want, rel=2e-6)


def test_precomputed_reference_log_probs_of_an_unpatched_reference_stay_refused():
    """With precompute_ref_log_probs=True the reference scored the data with a plain softmax when the trainer
    was built: patching trainer.ref_model afterwards, as the first refusal advised, trained on those stale
    log-probs (policy == reference gave a DPO loss of 0.681, not log 2).  The refusal now stays and says
    to build the trainer again; with a patched reference it trains (loss log 2)."""
    def dpo(reference):
        policy = hf_mhce.apply_patch(_model(), loss="mhce", num_heads=2)
        return DPOTrainer(model=policy, ref_model=reference, train_dataset=_dpo_data(), processing_class=_tokenizer(),
                          args=_args(DPOConfig, max_steps=1, learning_rate=0.0, precompute_ref_log_probs=True))

    trainer = dpo(_model())
    for _ in range(2):
        with pytest.raises(UnpatchedReferenceError, match="precompute_ref_log_probs=True .* Build the trainer again"):
            trainer.train()
        hf_mhce.apply_patch(trainer.ref_model, loss="mhce", num_heads=2)
    trainer = dpo(hf_mhce.apply_patch(_model(), loss="mhce", num_heads=2))
    trainer.train()
    assert [h for h in trainer.state.log_history if "loss" in h][0]["loss"] == pytest.approx(math.log(2), rel=1e-6)


def _policy_rbe(model, loader, labels_of):
    """(tokens, mean NLL, mean rank) of the policy on the eval batches: float64 log-softmax of its logits."""
    nll, ranks = [], []
    with torch.no_grad():
        for batch in loader:
            lp = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
            lp, labels = lp[:, :-1].log_softmax(-1), labels_of(batch)[:, 1:]
            valid = labels != -100
            target = lp.gather(-1, labels.clamp(min=0)[..., None])
            nll.append(-target[..., 0][valid])
            ranks.append((lp > target).sum(-1)[valid])
    nll, ranks = torch.cat(nll), torch.cat(ranks)
    return nll.numel(), nll.mean().item(), ranks.double().mean().item()


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_rbe_of_a_peft_policy_leaves_out_the_reference_forwards(kind):
    """With peft_config and no ref_model, TRL's reference is the policy with its adapter disabled, called after
    the policy in each evaluation batch: RBECallback reported that reference (DPO: cross-entropy 3.631, mean rank
    19.45 for the policy's 3.600, 16.75).  Only the forwards with the policy's adapters are counted."""
    from peft import LoraConfig
    from trl import KTOConfig, KTOTrainer

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM",
                      init_lora_weights=False)  # an adapter that changes the model from the start
    if kind == "dpo":
        data, cls, config = _dpo_data(), DPOTrainer, DPOConfig
    else:
        data = Dataset.from_dict({"prompt": TEXTS * 2, "completion": [" " + t for t in TEXTS[::-1] + TEXTS],
                                  "label": [True] * 8 + [False] * 8}).shuffle(seed=1).select(range(8))
        cls, config = KTOTrainer, KTOConfig
    trainer = cls(model=hf_mhce.apply_patch(_model()), args=_args(config, per_device_eval_batch_size=4),
                  train_dataset=data, eval_dataset=data, processing_class=_tokenizer(), peft_config=lora,
                  callbacks=[hf_mhce.RBECallback()])
    metrics = trainer.evaluate()
    labels_of = lambda b: b["input_ids"].masked_fill(b["completion_mask"] == 0, -100)  # noqa: E731
    tokens, ce, rank = _policy_rbe(trainer.model, trainer.get_eval_dataloader(), labels_of)
    with trainer.model.disable_adapter():
        assert _policy_rbe(trainer.model, trainer.get_eval_dataloader(), labels_of)[1] != pytest.approx(ce, rel=1e-3)
    assert metrics["eval_rbe_num_tokens"] == tokens
    assert metrics["eval_rbe_cross_entropy"] == pytest.approx(ce, rel=1e-6)
    assert metrics["eval_rbe_mean_rank"] == pytest.approx(rank, rel=1e-9)


def test_ranks_counted_under_a_sampling_temperature_are_the_model_s():
    """GRPO / RLOO ask for log-probs at their sampling temperature; the RBE statistics counted in that pass
    (RBECallback, rbe.evaluate) took the tempered NLL (GRPO eval at 0.7: cross-entropy 3.543 for the model's
    3.561).  TRL still gets its tempered log-probs; the ranks and NLL counted are the model's."""
    from trl.trainer.utils import add_fused_lm_head

    from hf_mhce.losses import collect_ranks

    model = hf_mhce.apply_patch(_model())
    add_fused_lm_head(model, temperature=0.7)
    ids = torch.tensor([[1, 5, 9, 14, 20, 7, 3, 12, 30, 4]])
    labels = ids.masked_fill(torch.arange(10) < 3, -100)
    counted = []
    with torch.no_grad(), collect_ranks(lambda r, n: counted.append((r, n))):
        log_probs = model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs[0]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].double()
    targets, valid = labels[0, 1:].clamp(min=0), labels[0, 1:] != -100
    tempered = (logits / 0.7).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(log_probs.double()[valid], tempered[valid], rtol=1e-5, atol=1e-5)  # TRL's, as before
    lp = logits.log_softmax(-1)
    target = lp.gather(-1, targets[:, None])
    (ranks, nll), = counted
    torch.testing.assert_close(nll.double(), -target[valid, 0], rtol=1e-5, atol=1e-5)
    assert ranks.tolist() == (lp > target).sum(-1)[valid].tolist()


def test_rbe_of_an_sft_evaluation_with_compute_metrics():
    """With compute_metrics, TRL's SFT computes each eval batch's logits in a second forward without labels, which
    started a new, empty batch: no RBE metric at all, and a warning blaming the labels.  That forward of the same
    input_ids leaves the batch counted."""
    data = Dataset.from_dict({"text": [TEXTS[i % 8] * (1 + i % 3) for i in range(12)]})
    rbe = []
    for compute_metrics in (None, lambda prediction: {"seen": 1.0}):
        trainer = SFTTrainer(model=hf_mhce.apply_patch(_model()), args=_args(SFTConfig), train_dataset=data,
                             eval_dataset=data.select(range(6)),
                             processing_class=_tokenizer(), compute_metrics=compute_metrics,
                             callbacks=[hf_mhce.RBECallback()])
        metrics = trainer.evaluate()
        rbe.append({k: v for k, v in metrics.items() if "_rbe_" in k})
    assert "eval_seen" in metrics and rbe[0]["eval_rbe_num_tokens"] > 0
    assert rbe[1] == rbe[0]
