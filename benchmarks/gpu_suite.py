"""GPU validation of the fused CE / MHCE kernels at LLM shapes (issue P1's CUDA suite).

    python benchmarks/gpu_suite.py                       # D=4096, V=128256, N=8192, fp32 + bf16, H=1,4,8
    python benchmarks/gpu_suite.py --out benchmarks/results
    python benchmarks/gpu_suite.py --tokens 16800 --heads 1 --dtypes bfloat16   # N * V > 2^31
    python benchmarks/gpu_suite.py --workspace-mb 8192 --heads 1 4   # gradients in the forward

For every (dtype, H): the Triton backend's loss, dX, dW and dB against a float64 reference (the
chunked torch backend run in float64 on the same device, itself checked against a materialised
reference by the CPU tests), which schedule ran (``grads``: "forward" when the gradients were computed
in the forward, "backward" when the backward recomputed the logits; ``--workspace-mb`` sets
HF_MHCE_WORKSPACE_MB, which decides it), the same-dtype eager error for 16-bit inputs (logits materialised in
the input dtype, then float32 cross-entropy, as transformers does), forward+backward time and peak
extra memory.  Writes a markdown table and JSON named <device>-<date>-gpu-suite (records.py's naming
rule).  ``TRITON_INTERPRET=1 python benchmarks/gpu_suite.py --device cpu --small`` runs it at small
shapes (N=64, V=517, D=48 unless given) to check the script itself; off CUDA, --small is required.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time

import torch
import torch.nn.functional as F
from records import DTYPES, Record, add_out_options, check_device, device_label, environment, positive_int

from hf_mhce import multi_head_cross_entropy
from hf_mhce.ops.budget import workspace_bytes


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def eager_mhce(x, w, b, labels, heads, softcap=None):
    """Materialised per-head logits in the input dtype, float32 mixture loss (the eager baseline)."""
    cap = (lambda y: softcap * torch.tanh(y / softcap)) if softcap else (lambda y: y)
    lp = torch.stack([F.log_softmax(cap((xs @ ws.T + b).float()), -1)
                      for xs, ws in zip(x.chunk(heads, -1), w.chunk(heads, -1))])
    mix = torch.logsumexp(lp, 0) - math.log(heads)
    valid = labels != -100
    return -(mix[valid].gather(1, labels[valid, None])).mean()


def widen(x, w, u, lb, heads):
    """The low-rank pair folded into widened operands (what the eager baseline multiplies)."""
    v, d = w.shape
    xs = torch.cat([x.unflatten(-1, (heads, d // heads)), u], -1).flatten(-2)
    ws = torch.cat([w.unflatten(-1, (heads, d // heads)), lb.unsqueeze(1).expand(v, heads, lb.shape[1])], -1)
    return xs, ws.flatten(-2)


def run_case(n, v, d, heads, dtype, device, reps, rank=0, softcap=None):
    """One (dtype, H) row.  With rank > 0 a LoRA-style low-rank pair (U [N, H, R], B [V, R]) is added
    and the base weight is frozen: errors of dX, dU, dB_low and dB; dW is not computed.  ``softcap``: the
    logits are c tanh(y / c) (Gemma-2's final softcap is 30)."""
    g = torch.Generator(device="cpu").manual_seed(heads)
    x0 = torch.randn(n, d, generator=g).to(device)
    w0 = (torch.randn(v, d, generator=g) / math.sqrt(d)).to(device)
    b0 = (0.1 * torch.randn(v, generator=g)).to(device)
    u0 = torch.randn(n, heads, max(rank, 1), generator=g).to(device)
    lb0 = (torch.randn(v, max(rank, 1), generator=g) / math.sqrt(max(rank, 1))).to(device)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    labels[torch.rand(n, generator=g).to(device) < 0.1] = -100
    names = ("loss", "dx", "dw", "db") + (("du", "dlb") if rank else ())

    def leaves(dt):
        x, w, b, u, lb = (t.to(dt).detach().requires_grad_() for t in (x0, w0, b0, u0, lb0))
        return (x, w.requires_grad_(not rank), b) + ((u, lb) if rank else ())

    def ours(backend, x, w, b, *low):
        return multi_head_cross_entropy(x, w, labels, heads, bias=b, backend=backend, low_rank=low or None,
                                        softcap=softcap)

    def eager(x, w, b, *low):
        return eager_mhce(*(widen(x, w, *low, heads) if low else (x, w)), b, labels, heads, softcap)

    def grads(dt, fn):
        ts = leaves(dt)
        loss = fn(*ts)
        loss.backward()
        return (loss.detach(),) + tuple(t.grad for t in ts)

    ref = grads(torch.float64, lambda *ts: ours("torch", *ts))
    got, schedule = observed(lambda: grads(dtype, lambda *ts: ours("triton", *ts)))
    again = grads(dtype, lambda *ts: ours("triton", *ts))
    keep = [i for i, r in enumerate(ref) if r is not None]
    row = {"dtype": str(dtype).replace("torch.", ""), "heads": heads, **({"lora_rank": rank} if rank else {}),
           "grads": "forward" if schedule == [True] else "backward" if schedule == [False] else str(schedule),
           **{f"err_{names[i]}": rel(got[i], ref[i]) for i in keep},
           # a second run's loss and gradients, bit for bit (no atomics in either schedule; dB included)
           "bitwise_repeat": all(torch.equal(got[i], again[i]) for i in keep)}
    del again
    try:  # eager materialises H [N, V] float32 log-softmaxes: H = 8 at the default shape is over 80 GB
        if dtype != torch.float32:
            base = grads(dtype, eager)
            row.update({f"eager_err_{names[i]}": rel(base[i], ref[i]) for i in keep})
            del base
    except torch.cuda.OutOfMemoryError:
        row["eager_note"] = "out of memory"

    ts = leaves(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for name, fn in (("ours", lambda: ours("triton", *ts)), ("eager", lambda: eager(*ts))):
        if name == "eager" and "eager_note" in row:
            continue
        try:
            fn().backward()  # warm-up / compile
            for t in ts:  # the warm-up's gradients are no input: the peak below counts the step's own
                t.grad = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                for t in ts:
                    t.grad = None
                fn().backward()
            sync()
        except torch.cuda.OutOfMemoryError:
            row[f"{name}_note"] = "out of memory"
            continue
        row[f"{name}_ms"] = 1000 * (time.perf_counter() - t0) / reps
        if device.type == "cuda":
            row[f"{name}_peak_extra_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return row


def observed(run):
    """run()'s result, and per fused loss whether its gradients came from the forward (seen, not guessed)."""
    from hf_mhce.ops import triton_forward_grad  # triton: imported where the kernels run

    real, taken = triton_forward_grad.forward_with_grads, []

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        taken.append(out is not None)
        return out

    triton_forward_grad.forward_with_grads = spy
    try:
        return run(), taken
    finally:
        triton_forward_grad.forward_with_grads = real


FULL, SMALL = (8192, 128256, 4096), (64, 517, 48)  # N, V, D


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=positive_int, help=f"N (default {FULL[0]}; --small: {SMALL[0]})")
    p.add_argument("--vocab", type=positive_int, help=f"V (default {FULL[1]}; --small: {SMALL[1]})")
    p.add_argument("--hidden", type=positive_int, help=f"D (default {FULL[2]}; --small: {SMALL[2]})")
    p.add_argument("--heads", type=positive_int, nargs="+", default=[1, 4, 8])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=DTYPES)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="small default shapes: checks the script on CPU")
    p.add_argument("--reps", type=positive_int, default=5)
    p.add_argument("--lora-rank", type=int, default=0,
                   help="add a LoRA-style low-rank pair of this rank, base weight frozen (the low_rank path)")
    p.add_argument("--softcap", type=float, help="logit softcap c (c tanh(y / c)), as Gemma-2's 30")
    p.add_argument("--workspace-mb", type=float, help="HF_MHCE_WORKSPACE_MB for this run (default: as set, or 512)")
    add_out_options(p)
    args = p.parse_args(argv)
    with environment({} if args.workspace_mb is None else {"HF_MHCE_WORKSPACE_MB": str(args.workspace_mb)}):
        _run(p, args)


def _run(p, args):
    workspace_bytes()  # a bad value stops here, naming the variable
    if args.lora_rank < 0:
        p.error(f"--lora-rank must be 0 (none) or positive, got {args.lora_rank}")
    if args.softcap is not None and not (math.isfinite(args.softcap) and args.softcap > 0):
        p.error(f"--softcap must be a finite positive number, got {args.softcap}")
    device = check_device(p, args)
    n, v, d = (given or default for given, default in zip((args.tokens, args.vocab, args.hidden),
                                                            SMALL if args.small else FULL))
    if any(d % h for h in args.heads):
        p.error(f"every --heads must divide the hidden size {d}: got {args.heads}")
    name = device_label(device)
    record = Record(p, args, f"{name}-{datetime.date.today().isoformat()}-gpu-suite"
                    + (f"-lora{args.lora_rank}" if args.lora_rank else "")
                    + (f"-softcap{args.softcap:g}" if args.softcap else ""), named={"lora_rank", "softcap"})
    rows = []
    options = f", LoRA-style low-rank pair r={args.lora_rank} with the base weight frozen" if args.lora_rank else ""
    options += f", softcap {args.softcap:g}" if args.softcap else ""
    options += f", HF_MHCE_WORKSPACE_MB={workspace_bytes() / 2**20:g}"
    for dt in args.dtypes:
        for h in args.heads:
            row = run_case(n, v, d, h, getattr(torch, dt), device, args.reps, args.lora_rank, args.softcap)
            rows.append(row)
            print(json.dumps(row))
            keys = list(dict.fromkeys(k for r in rows for k in r))
            lines = [f"# GPU suite: N={n}, V={v}, D={d}{options} on {name}", "",
                     "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(f"{r.get(k, ''):.3g}" if isinstance(r.get(k), float) else str(r.get(k, ""))
                                        for k in keys) + " |" for r in rows]
            record.write(rows, "\n".join(lines))  # after every case: a run cut short keeps what it checked


if __name__ == "__main__":
    main()
