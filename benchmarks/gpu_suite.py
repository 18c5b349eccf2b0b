"""GPU validation of the fused CE / MHCE kernels at LLM shapes (issue P1's CUDA suite).

    python benchmarks/gpu_suite.py                       # D=4096, V=128256, N=8192, fp32 + bf16, H=1,4,8
    python benchmarks/gpu_suite.py --out benchmarks/results
    python benchmarks/gpu_suite.py --tokens 16800 --heads 1 --dtypes bfloat16   # N * V > 2^31

For every (dtype, H): the Triton backend's loss, dX, dW and dB against a float64 reference (the
chunked torch backend run in float64 on the same device, itself checked against a materialised
reference by the CPU tests), the same-dtype eager error for 16-bit inputs (logits materialised in
the input dtype, then float32 cross-entropy, as transformers does), forward+backward time and peak
extra memory.  Writes a markdown table and JSON named <device>-<date>.  With --device cpu and
TRITON_INTERPRET=1 it runs at small shapes to check the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from records import write_record

from hf_mhce import multi_head_cross_entropy


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def eager_mhce(x, w, b, labels, heads):
    """Materialised per-head logits in the input dtype, float32 mixture loss (the eager baseline)."""
    lp = torch.stack([F.log_softmax((xs @ ws.T + b).float(), -1)
                      for xs, ws in zip(x.chunk(heads, -1), w.chunk(heads, -1))])
    mix = torch.logsumexp(lp, 0) - math.log(heads)
    valid = labels != -100
    return -(mix[valid].gather(1, labels[valid, None])).mean()


def run_case(n, v, d, heads, dtype, device, reps):
    g = torch.Generator(device="cpu").manual_seed(heads)
    x0 = torch.randn(n, d, generator=g).to(device)
    w0 = (torch.randn(v, d, generator=g) / math.sqrt(d)).to(device)
    b0 = (0.1 * torch.randn(v, generator=g)).to(device)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    labels[torch.rand(n, generator=g).to(device) < 0.1] = -100

    def grads(backend, dt, fn=None):
        x, w, b = (t.to(dt).detach().requires_grad_() for t in (x0, w0, b0))
        loss = fn(x, w, b) if fn else multi_head_cross_entropy(x, w, labels, heads, bias=b, backend=backend)
        loss.backward()
        return loss.detach(), x.grad, w.grad, b.grad

    ref = grads("torch", torch.float64)
    ours = grads("triton", dtype)
    row = {"dtype": str(dtype).replace("torch.", ""), "heads": heads,
           **{f"err_{k}": rel(o, r) for k, o, r in zip(("loss", "dx", "dw", "db"), ours, ref)}}
    if dtype != torch.float32:
        eager = grads(None, dtype, fn=lambda x, w, b: eager_mhce(x, w, b, labels, heads))
        row.update({f"eager_err_{k}": rel(o, r) for k, o, r in zip(("loss", "dx", "dw", "db"), eager, ref)})

    x, w, b = (t.to(dtype).detach().requires_grad_() for t in (x0, w0, b0))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for name, fn in (("ours", lambda: multi_head_cross_entropy(x, w, labels, heads, bias=b, backend="triton")),
                     ("eager", lambda: eager_mhce(x, w, b, labels, heads))):
        fn().backward()  # warm-up / compile
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            x.grad = w.grad = b.grad = None
            fn().backward()
        sync()
        row[f"{name}_ms"] = 1000 * (time.perf_counter() - t0) / reps
        if device.type == "cuda":
            row[f"{name}_peak_extra_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = p.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name().replace(" ", "-") if device.type == "cuda" else "cpu-interpreter"
    rows = []
    for dt in args.dtypes:
        for h in args.heads:
            row = run_case(args.tokens, args.vocab, args.hidden, h, getattr(torch, dt), device, args.reps)
            rows.append(row)
            print(json.dumps(row))
    stamp = f"{name}-{datetime.date.today().isoformat()}-gpu-suite"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = [f"# GPU suite: N={args.tokens}, V={args.vocab}, D={args.hidden} on {name}", "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(f"{r.get(k, ''):.3g}" if isinstance(r.get(k), float) else str(r.get(k, ""))
                                for k in keys) + " |" for r in rows]
    write_record(args.out, stamp, rows, "\n".join(lines))


if __name__ == "__main__":
    main()
