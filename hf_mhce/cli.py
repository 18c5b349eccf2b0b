"""Command line: ``hf-mhce demo`` (the fused ops on a random problem, no downloads).

``hf-mhce train`` (the main job) arrives with issue P4; ``hf-mhce rbe`` with P3.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch


def _demo(args: argparse.Namespace) -> int:
    import torch.nn.functional as F

    from .losses import multi_head_cross_entropy, multi_head_logprobs

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    n, v, d = args.tokens, args.vocab, args.hidden
    hidden = torch.randn(n, d, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, d, device=device) / math.sqrt(d)).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), device=device)
    labels[:: max(1, n // 8)] = -100

    print(f"tokens={n} vocab={v} hidden={d} dtype={args.dtype} device={device}")
    print(f"float32 logits would take {n * v * 4 / 2**20:.1f} MiB; the fused ops never build them\n")
    print(f"{'loss':<22}{'value':>12}{'fwd+bwd s':>12}{'|dX| rel. diff':>16}")
    t0 = time.perf_counter()
    logits = (hidden @ weight.T).float()
    eager = F.cross_entropy(logits, labels)
    eager.backward()
    eager_time = time.perf_counter() - t0
    eager_grad = hidden.grad.clone()
    del logits
    print(f"{'HF eager (logits)':<22}{eager.item():>12.6f}{eager_time:>12.3f}{'-':>16}")
    for heads in args.heads:
        if d % heads:
            continue
        hidden.grad = None
        t0 = time.perf_counter()
        loss = multi_head_cross_entropy(hidden, weight, labels, heads)
        loss.backward()
        elapsed = time.perf_counter() - t0
        diff = ((hidden.grad.float() - eager_grad.float()).norm() / eager_grad.float().norm()).item()
        name = "fused CE" if heads == 1 else f"fused MHCE H={heads}"
        print(f"{name:<22}{loss.item():>12.6f}{elapsed:>12.3f}{diff if heads == 1 else float('nan'):>16.2e}")
    with torch.no_grad():
        logp = multi_head_logprobs(hidden[:4], weight, max(args.heads))
    print(f"\nmixture log-probs (H={max(args.heads)}) of 4 tokens sum to {logp.exp().sum(-1).tolist()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-mhce", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the fused CE / MHCE ops on a random problem")
    demo.add_argument("--tokens", type=int, default=2048)
    demo.add_argument("--vocab", type=int, default=32000)
    demo.add_argument("--hidden", type=int, default=256)
    demo.add_argument("--heads", type=int, nargs="+", default=[1, 4])
    demo.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    demo.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
