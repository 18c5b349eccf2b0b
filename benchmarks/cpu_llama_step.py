"""CPU part of the peer benchmark (issue P6): one training step of a mini Llama with the Llama-3
vocabulary, patched vs HF eager, each in its own process: peak RSS and time.

    python benchmarks/cpu_llama_step.py                  # V=128256, N=4096 tokens (4 x 1024), hidden 256
    python benchmarks/cpu_llama_step.py --tokens 2048 --variants eager ce

Every variant runs in a fresh subprocess: build the model (seeded), one warm-up step, then --steps
timed steps (forward, backward, AdamW step) on a rotated set of random batches.  "no_head" is the
floor: the same step with the decoder only (the head's weight still trained, with zero gradient), so
that the memory of the model, optimizer and decoder activations is told apart from the loss's.  Reported: the peak
RSS of the whole process (VmHWM: what the machine must have), the peak during the timed steps above
the RSS before them (the step's own extra memory), and the median step time.  Targets: peak RSS <=
0.25x HF eager, time <= 1.2x.  Writes benchmarks/results/cpu_llama_step-<date>.json and .md (a
partial run such as the second example above: ...-<date>-tokens_2048-variants_eager-ce; records.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

from records import Record, add_out_options, positive_int

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {"eager": {}, "ce": {"loss": "ce"}, "mhce4": {"loss": "mhce", "num_heads": 4}, "no_head": {}}


def child(args) -> dict:
    import torch
    from proc_memory import reset_peak, status_bytes
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_mhce

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         intermediate_size=args.hidden * 8 // 3 // 32 * 32, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=args.seq, tie_word_embeddings=args.tie)
    model = LlamaForCausalLM(config)
    if args.lora_head:  # frozen base, LoRA on attention and on the head (r=16)
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj", "lm_head"]))
    if VARIANTS[args.variant]:
        hf_mhce.apply_patch(model, **VARIANTS[args.variant])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def loss_of(ids):
        if args.variant == "no_head":  # the floor: the same step without any vocabulary projection
            hidden = model.get_decoder()(input_ids=ids).last_hidden_state
            head = [p for p in model.get_output_embeddings().parameters() if p.requires_grad]
            return hidden.square().mean() + 0.0 * sum(p.sum() for p in head)  # same grads to hold
        return model(input_ids=ids, labels=ids).loss

    rows = args.tokens // args.seq
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (rows, args.seq), generator=g) for _ in range(args.steps + 1)]

    def step(ids):
        loss = loss_of(ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # as Trainer does: a new grad is assigned, not added
        return loss.item()

    step(batches[0])  # warm-up: gradients, optimizer state, thread pools
    before = reset_peak()
    times, losses = [], []
    for ids in batches[1:]:
        t0 = time.perf_counter()
        losses.append(step(ids))
        times.append(time.perf_counter() - t0)
    step_peak = status_bytes("VmHWM")
    import resource

    process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # includes the warm-up step
    return {"variant": args.variant, "process_peak_mb": process_peak / 2**20, "step_extra_mb": (step_peak - before) / 2**20,
            "rss_before_steps_mb": before / 2**20, "step_seconds": statistics.median(times), "times": times,
            "loss": losses[-1], "parameters": sum(p.numel() for p in model.parameters())}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("vocab", 128256), ("hidden", 256), ("layers", 2), ("tokens", 4096), ("seq", 1024),
                          ("steps", 3), ("threads", 2)):
        p.add_argument(f"--{name}", type=positive_int, default=default)
    p.add_argument("--tie", action="store_true",
                   help="head tied to the input embedding, as Llama-3.2-1B/3B (one [V, D] matrix, not two)")
    p.add_argument("--lora-head", action="store_true",
                   help="PEFT LoRA (r=16) on q_proj, v_proj and lm_head, base weights frozen")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--variant", help=argparse.SUPPRESS)  # set in the child process
    add_out_options(p)
    args = p.parse_args(argv)
    # checked here, not in the child: there a bad size fails deep inside Llama (a reshape of 0 rows)
    if args.tokens % args.seq:
        p.error(f"--tokens ({args.tokens}) must be a multiple of --seq ({args.seq}): the batch is tokens/seq rows")
    if args.hidden % 8:
        p.error(f"--hidden ({args.hidden}) must be a multiple of 8: 4 attention heads of even size (RoPE)")
    if args.variant:
        print(json.dumps(child(args)))
        return {}
    today = datetime.date.today().isoformat()
    suffix = ("-tied" if args.tie else "") + ("-lora-head" if args.lora_head else "")
    record = Record(p, args, f"cpu_llama_step{suffix}-{today}", named={"tie", "lora_head"})
    rows = []
    for variant in args.variants:
        cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant,
               *[x for k in ("vocab", "hidden", "layers", "tokens", "seq", "steps", "threads")
                 for x in (f"--{k}", str(getattr(args, k)))], *(["--tie"] if args.tie else []),
               *(["--lora-head"] if args.lora_head else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE)
        if proc.returncode:
            raise RuntimeError(f"{variant} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{variant:6s} peak {r['process_peak_mb']:7.0f} MB  step extra {r['step_extra_mb']:7.0f} MB  "
              f"step {r['step_seconds']:.2f} s  loss {r['loss']:.4f}", flush=True)
    result = {"date": today, "device": f"CPU, {os.cpu_count()} cores", "threads": args.threads, "tied": args.tie,
              "lora_head": args.lora_head,
              **{k: getattr(args, k) for k in ("vocab", "hidden", "layers", "tokens", "seq", "steps")},
              "targets": {"peak_rss_vs_eager": 0.25, "time_vs_eager": 1.2}, "rows": rows}
    eager = next((r for r in rows if r["variant"] == "eager"), None)
    lines = [f"# One training step of a mini Llama, V={args.vocab}, N={args.tokens} tokens, CPU ({today})", "",
             f"{os.cpu_count()} CPUs, {args.threads} torch threads; hidden {args.hidden}, {args.layers} layers, "
             f"{'head tied to the embedding' if args.tie else 'untied head'}"
             f"{', frozen base with LoRA r=16 on q_proj, v_proj and lm_head' if args.lora_head else ''} "
             f"({rows[0]['parameters'] / 1e6:.1f}M parameters), {args.tokens // args.seq} x {args.seq} tokens, fp32, "
             f"AdamW; each variant in a fresh process; time = median of {args.steps} steps after a warm-up step. "
             "Targets: peak RSS <= 0.25x eager, time <= 1.2x eager.", "",
             "RSS at rest = before the timed steps (model, AdamW state, runtime): the part no loss can save.", "",
             "| variant | process peak RSS MB | vs eager | RSS at rest MB | step extra MB | vs eager | step s | vs eager | loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        def ratio(key):
            return f"{r[key] / eager[key]:.2f}x" if eager else "-"
        lines.append(f"| {r['variant']} | {r['process_peak_mb']:.0f} | {ratio('process_peak_mb')} | "
                     f"{r['rss_before_steps_mb']:.0f} | {r['step_extra_mb']:.0f} | "
                     f"{ratio('step_extra_mb')} | {r['step_seconds']:.2f} | {ratio('step_seconds')} | {r['loss']:.4f} |")
    record.write(result, "\n".join(lines))
    return result


if __name__ == "__main__":
    main()
