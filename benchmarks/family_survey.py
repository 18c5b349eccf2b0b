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


class _Timeout(Exception):
    pass


def _first_line(err: BaseException) -> str:
    text = str(err).split(". hf_mhce.apply_patch supports")[0].strip()
    _, probed, why = text.partition(" and the generic forward does not reproduce its logits and loss: ")
    if probed:  # the probe's finding, not the sentence around it
        text = f"the probe: {why}"
    lines = text.splitlines()
    return f"{type(err).__name__}: {lines[0][:200] if lines else ''}"


def check(model_type: str) -> dict:
    """One type's outcome (runs in the worker)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_mhce

    torch.manual_seed(0)
    try:
        ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SIZES)).eval()
        ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
        expected = ref(input_ids=ids, labels=ids)
        expected.loss.backward()
    except _Timeout:
        raise
    except Exception as err:  # noqa: BLE001 - transformers' own failure at this size
        return {"status": "not run", "detail": _first_line(err)}
    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
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
        if not torch.allclose(model(input_ids=ids).logits.float(), ref(input_ids=ids).logits.float(), rtol=1e-4, atol=1e-5):
            problems.append("logits")
    router = model.__dict__["_hf_mhce_patch"].router
    kind = "" if router is None else (" (MoE, router loss)" if router.adds_loss else " (MoE, router logits only)")
    if problems:
        return {"status": "MISMATCH", "detail": "; ".join(problems[:3])}
    return {"status": "patched", "detail": f"loss {got.loss.item():.6f}{kind}"}


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
    record.write({"versions": versions, "sizes": SIZES, "results": results}, render(results, versions))


if __name__ == "__main__":
    main()
