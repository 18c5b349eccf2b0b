"""Which of transformers' causal-LM types ``apply_patch`` serves, checked against the unpatched model.

    python benchmarks/family_survey.py                 # every type in MODEL_FOR_CAUSAL_LM_MAPPING (~15 min, CPU)
    python benchmarks/family_survey.py --types llama mixtral mamba

For each model type: a tiny random model built from its config (the sizes below; each config reads
the names it knows), one forward and backward in eval mode with labels (MoE types with
output_router_logits on), unpatched and patched.  Outcomes:

- ``patched``: loss and logits without labels (rtol 1e-4, atol 1e-5: the probe's tolerance, as a
  decoder called alone may round differently from the full forward) and every gradient (rtol 1e-3,
  atol 1e-5 of the model's largest gradient: some are zero in exact arithmetic, such as attention key
  biases, and are compared as the noise they are) equal the unpatched model's;
- ``MISMATCH``: patched but a number differs: a defect of hf_mhce;
- ``refused``: apply_patch raised, with the reason it gave (by design where the generic forward
  cannot reproduce the model);
- ``not run``: transformers itself cannot build or run the tiny config (not a statement about hf_mhce).

Where a type's defaults do not fit the tiny sizes, OVERRIDES gives it the config values that do.

Types run in a worker process that is restarted after a crash (a config whose defaults need more memory
than --memory-gb, say), and each gets --timeout-s.  Record: benchmarks/results/family-survey-<date>.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import resource
import signal
import subprocess
import sys
import warnings

from records import Record, add_out_options, positive_int

SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
             shared_expert_intermediate_size=16, intermediate_size_mlp=64, state_size=8, n_embd=32, n_layer=2,
             n_head=4, n_positions=64, d_model=32, n_heads=4, n_layers=2, output_router_logits=True)

# Per-type config values on top of SIZES, for the names SIZES does not set (rotary dims, layer patterns,
# latent-attention ranks) where a type's defaults do not fit the tiny sizes and transformers itself could
# not build or run it.  They change the tiny model, never what is compared.  A composite (multimodal)
# config's sub-configs get SIZES too, and the overrides of their own model type (config_for).
MLA = dict(num_key_value_heads=4, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=16, q_lora_rank=16,
           n_routed_experts=4, n_group=2, topk_group=1, first_k_dense_replace=1)  # DeepSeek's latent attention
HYBRID = dict(layer_types=["linear_attention", "full_attention"])  # the default pattern's first 2 layers lack attention
MAMBA = dict(mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8)
ENC_DEC = dict(encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=64, decoder_ffn_dim=64)  # the causal LM is the decoder; num_hidden_layers sizes the encoder
UNSET = "unset"  # removes the SIZES entry: a name the config derives itself
OVERRIDES: dict[str, dict] = {
    **dict.fromkeys(["deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "minicpm3",
                     "longcat_flash", "youtu", "axk1", "axk2"], MLA),
    "deepseek_v4": dict(mlp_layer_types=["hash_moe", "moe"]),  # hash-routed layers record no router logits
    "dots1": dict(n_shared_experts=1, n_routed_experts=4, first_k_dense_replace=1),
    "dots3_note_text": dict(MLA, qk_rope_head_dim=4, qk_nope_head_dim=4, index_head_dim=8, index_n_heads=2, per_layer_config={},
                            layer_types=["indexed_attention", "sliding_attention"], mlp_layer_types=["dense", "sparse"]),
    "dots3_note": dict(vision_config=dict(per_layer_config={}, adapter_in_dim=32, adapter_out_dim=32),
                       audio_config=dict(per_layer_config={}, adapter_input_size=32, adapter_out_dim=32)),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]), "gptj": dict(rotary_dim=4), "codegen": dict(rotary_dim=4),
    "falcon": dict(head_dim=UNSET),
    **dict.fromkeys(["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"], HYBRID),
    "qwen4_exp_text": dict(HYBRID, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4,
                           indexer_compress_ratio=2),
    "kimi_linear": dict(MLA, **HYBRID, linear_num_heads=4, linear_head_dim=8),
    "bailing_hybrid": dict(MLA, **HYBRID, mlp_layer_types=["dense", "sparse"], linear_num_heads=4, linear_head_dim=8,
                           num_expert_group=2, num_experts_per_token=2),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1), "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "lfm3": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention"]),
    "mamba2": dict(num_heads=8, n_groups=2), "bamba": dict(MAMBA, attn_layer_indices=[1]),
    "granitemoehybrid": dict(MAMBA, **HYBRID),
    "falcon_h1": dict(MAMBA, mamba_d_ssm=64),  # at its defaults transformers 5.17's torch scan needs over 17 GB
    "zamba": dict(layers_block_type=["hybrid", "hybrid"], mamba_dt_rank=4),  # its shared block ties two hybrid layers
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid"], mamba_headdim=8, n_mamba_heads=8, mamba_d_state=8),
    "zaya": dict(num_experts_per_tok=1), "flint": dict(mlp_only_layers=[0]),
    "dbrx": dict(max_seq_len=64, attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0),
                 ffn_config=dict(hidden_size=32, ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
    "cohere_compass_text": dict(layer_types=["sliding_attention", "full_attention"], rope_parameters=dict.fromkeys(
        ["sliding_attention", "full_attention"], dict(rope_type="default", rope_theta=1e4))),
    "gemma3n_text": dict(num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention"], laurel_rank=4,
                         hidden_size_per_layer_input=8, vocab_size_per_layer_input=97, activation_sparsity_pattern=[0.0, 0.0]),
    "rwkv": dict(use_cache=False),  # the state it keeps for a cache is updated in place, breaking the backward
    "xlstm": dict(embedding_dim=128, hidden_size=128, num_blocks=2, num_heads=4),  # its head dims round up to 64
    "blt": dict(encoder_hash_byte_group_vocab=101, encoder_config=dict(hidden_size_global=32),
                decoder_config=dict(hidden_size_global=32)),
    **dict.fromkeys(["bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus",
                     "plbart", "whisper"], ENC_DEC),
    "prophetnet": dict(num_hidden_layers=UNSET, num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=4,
                       num_decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64),
    "xlnet": dict(max_position_embeddings=UNSET), "xmod": dict(default_language="en_XX"),
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[16, 16], axial_pos_shape=[8, 8], attn_layers=["local", "lsh"]),
}

# Why a type stays "not run" where transformers' own error does not say it (prefixed to that error).
WHY_NOT = {
    **dict.fromkeys(["gemma4_assistant", "gemma4_unified_assistant"], "a drafter fed by its target model's shared_kv_states"),
    "git": "its loss skips image tokens, so it needs pixel_values",
    **dict.fromkeys(["musicgen", "musicgen_melody"], "its causal LM takes the decoder's config, not the composite one"),
    "reformer": "its backward needs train mode, and the survey compares in eval mode",
}


def _values(model_type: str, extra: dict) -> dict:
    values = {**SIZES, **OVERRIDES.get(model_type, {}), **extra}
    return {k: v for k, v in values.items() if v != UNSET}


def config_for(model_type: str):
    """The tiny config: SIZES and the type's overrides, and the same for each sub-config of a composite
    (multimodal) config, with the overrides of the sub-config's own model type (a text_config's, say)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    values = _values(model_type, {})
    for name, sub in getattr(CONFIG_MAPPING[model_type], "sub_configs", {}).items():
        values[name] = _values(getattr(sub, "model_type", ""), values.get(name, {}))
    return AutoConfig.for_model(model_type, **values)


class _Timeout(Exception):
    pass


def _first_line(err: BaseException) -> str:
    text = str(err).split(". hf_mhce.apply_patch supports")[0].strip()
    _, probed, why = text.partition(" and the generic forward does not reproduce its logits and loss: ")
    if probed:  # the probe's finding, not the sentence around it
        text = f"the probe: {why}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):  # a config validator's heading: its cause is the next line
        lines = [f"{lines[0]} {lines[1]}"]
    return f"{type(err).__name__}: {lines[0][:200] if lines else ''}"


def check(model_type: str) -> dict:
    """One type's outcome (runs in the worker)."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_mhce

    torch.manual_seed(0)
    try:
        ref = AutoModelForCausalLM.from_config(config_for(model_type)).eval()
        model = copy.deepcopy(ref)  # before any forward: after one, some keep non-leaf tensors deepcopy refuses
        ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
        expected = ref(input_ids=ids, labels=ids)
        expected.loss.backward()
    except _Timeout:
        raise
    except Exception as err:  # noqa: BLE001 - transformers' own failure at this size
        why = f"{WHY_NOT[model_type]}: " if model_type in WHY_NOT else ""
        return {"status": "not run", "detail": why + _first_line(err)}
    try:
        hf_mhce.apply_patch(model)
    except _Timeout:
        raise
    except Exception as err:  # noqa: BLE001 - the refusal and its reason are the result
        return {"status": "refused", "detail": _first_line(err)}
    got = model(input_ids=ids, labels=ids)
    got.loss.backward()
    problems = []
    if not torch.allclose(got.loss, expected.loss, rtol=1e-4, atol=1e-5):
        problems.append(f"loss {got.loss.item():.7g} vs {expected.loss.item():.7g}")
    scale = max((float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None), default=0.0)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        if p.grad is None or q.grad is None:
            if (p.grad is None) != (q.grad is None):
                problems.append(f"grad of {name} missing on one side")
            continue
        if not torch.allclose(q.grad, p.grad, rtol=1e-3, atol=1e-5 * scale):
            problems.append(f"grad of {name}: {float((q.grad - p.grad).abs().max()):.2g} off")
    with torch.no_grad():
        logits = ref(input_ids=ids).logits.float()
        if not torch.allclose(model(input_ids=ids).logits.float(), logits, rtol=1e-4, atol=1e-5):
            problems.append("logits")
        # once more with the head scaled to |logit| ~ 50: a fresh model's small logits hide a soft-cap
        for m in (ref, model):
            m.get_output_embeddings().weight.mul_(50.0 / max(float(logits.abs().max()), 1e-6))
        big_ref, big = ref(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
        if not torch.allclose(big.loss, big_ref.loss, rtol=1e-4, atol=1e-4):
            problems.append(f"loss at large logits {big.loss.item():.7g} vs {big_ref.loss.item():.7g}")
        if not torch.allclose(model(input_ids=ids).logits.float(), ref(input_ids=ids).logits.float(), rtol=1e-4, atol=1e-4):
            problems.append("logits at large logits")
    router = model.__dict__["_hf_mhce_patch"].router
    kind = "" if router is None else (" (MoE, router loss)" if router.adds_loss else " (MoE, router logits only)")
    if problems:
        return {"status": "MISMATCH", "detail": "; ".join(problems[:3])}
    return {"status": "patched", "detail": f"loss {got.loss.item():.6f}, at large logits {big.loss.item():.4f}{kind}"}


def worker(types: list[str], timeout_s: int) -> None:
    """Print one JSON line per type; the parent restarts us after the type we die on."""
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()

    def alarm(*_):
        raise _Timeout()

    signal.signal(signal.SIGALRM, alarm)
    for model_type in types:
        print(json.dumps({"type": model_type, "status": "started"}), flush=True)
        signal.alarm(timeout_s)
        try:
            result = check(model_type)
        except _Timeout:
            result = {"status": "not run", "detail": f"over {timeout_s} s at this size"}
        finally:
            signal.alarm(0)
        print(json.dumps({"type": model_type, **result}), flush=True)


def survey(types: list[str], timeout_s: int, memory_gb: int) -> dict[str, dict]:
    results: dict[str, dict] = {}
    todo = list(types)

    def limit():  # a config whose defaults are huge fails its allocation here instead of meeting the OOM killer
        resource.setrlimit(resource.RLIMIT_AS, (memory_gb << 30, memory_gb << 30))

    while todo:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--timeout-s", str(timeout_s), "--types", *todo]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, preexec_fn=limit)
        current = None
        for line in proc.stdout:
            row = json.loads(line)
            if row["status"] == "started":
                current = row["type"]
            else:
                results[row["type"]] = {k: v for k, v in row.items() if k != "type"}
                current = None
                print(f"{row['type']:<28}{row['status']:<10}{row['detail']}", flush=True)
        proc.wait()
        done = set(results)
        if current is not None and current not in done:
            results[current] = {"status": "not run", "detail": f"the worker died (exit {proc.returncode}; "
                                                                f"memory limit {memory_gb} GB)"}
            print(f"{current:<28}{'not run':<10}{results[current]['detail']}", flush=True)
        todo = [t for t in todo if t not in results]
    return results


def render(results: dict[str, dict], versions: dict) -> str:
    order = ("MISMATCH", "patched", "refused", "not run")
    counts = {s: sum(r["status"] == s for r in results.values()) for s in order}
    lines = [f"# Family survey, {versions['date']} (CPU)", "",
             f"transformers {versions['transformers']}, torch {versions['torch']}: {len(results)} causal-LM "
             "types, each a tiny random model, patched vs unpatched (benchmarks/family_survey.py).", "",
             " | ".join(f"{s}: {counts[s]}" for s in order), "", "| model type | outcome | detail |", "| --- | --- | --- |"]
    for status in order:
        for name in sorted(t for t, r in results.items() if r["status"] == status):
            lines.append(f"| {name} | {status} | {results[name]['detail'].replace('|', '/')} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--types", nargs="+", default=None, help="model types (default: all causal-LM types)")
    p.add_argument("--timeout-s", type=positive_int, default=60)
    p.add_argument("--memory-gb", type=positive_int, default=8)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    add_out_options(p)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.types, args.timeout_s)
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    known = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    unknown = sorted(set(args.types or ()) - set(known))
    if unknown:
        p.error(f"--types {unknown}: not causal-LM model types of transformers {transformers.__version__}")
    date = datetime.date.today().isoformat()
    record = Record(p, args, f"family-survey-{date}")
    results = survey(args.types or known, args.timeout_s, args.memory_gb)
    versions = {"date": date, "transformers": transformers.__version__, "torch": torch.__version__}
    record.write({"versions": versions, "sizes": SIZES, "overrides": OVERRIDES, "results": results}, render(results, versions))


if __name__ == "__main__":
    main()
