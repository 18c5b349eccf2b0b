"""Command line.

    hf-mhce train [options | config.json | config.yaml]   the main job (``hf-mhce train --help``)
    hf-mhce rbe MODEL --dataset DATA  the RBE decomposition of a causal LM's cross-entropy
    hf-mhce demo                      the fused ops on a random problem (no downloads)
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
    bad = [h for h in args.heads if h < 1 or d % h]
    if bad:
        raise SystemExit(f"--heads {bad}: every head count must be positive and divide --hidden {d}")
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
        hidden.grad = None
        t0 = time.perf_counter()
        loss = multi_head_cross_entropy(hidden, weight, labels, heads)
        loss.backward()
        elapsed = time.perf_counter() - t0
        name = "fused CE" if heads == 1 else f"fused MHCE H={heads}"
        if heads == 1:  # MHCE is another loss: no eager gradient to compare with
            diff = ((hidden.grad.float() - eager_grad.float()).norm() / eager_grad.float().norm()).item()
            cell = f"{diff:.2e}"
        else:
            cell = "-"
        print(f"{name:<22}{loss.item():>12.6f}{elapsed:>12.3f}{cell:>16}")
    with torch.no_grad():
        logp = multi_head_logprobs(hidden[:4], weight, max(args.heads))
    print(f"\nmixture log-probs (H={max(args.heads)}) of 4 tokens sum to {logp.exp().sum(-1).tolist()}")
    return 0


def _rbe(args: argparse.Namespace) -> int:
    import json

    from transformers import AutoTokenizer

    from .patching import from_pretrained
    from .rbe.data import load_texts, token_blocks
    from .rbe.evaluate import evaluate
    from .rbe.plots import plot_rank_distribution

    model = from_pretrained(args.model)
    model.to(args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    data = load_texts(args.dataset, args.split, args.dataset_config)
    rows = token_blocks(data, tokenizer, args.text_column, args.block_size)
    if args.max_blocks is not None:
        rows = rows[: args.max_blocks]
    if not rows:
        raise SystemExit(f"no evaluation text in {args.dataset!r}")
    report = evaluate(model, rows, batch_size=args.batch_size, device=args.device, progress=not args.no_progress)
    print(f"RBE decomposition of {args.model} on {args.dataset} ({len(rows)} blocks)")
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dataset": args.dataset, **report.as_dict()}, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {plot_rank_distribution(report.stats, args.plot, args.model)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-mhce", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="the main job: train with CE/MHCE + RBE evaluation (see hf-mhce train --help)")
    demo = sub.add_parser("demo", help="run the fused CE / MHCE ops on a random problem")
    demo.add_argument("--tokens", type=int, default=2048)
    demo.add_argument("--vocab", type=int, default=32000)
    demo.add_argument("--hidden", type=int, default=256)
    demo.add_argument("--heads", type=int, nargs="+", default=[1, 4])
    demo.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    demo.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)

    rbe = sub.add_parser("rbe", help="RBE decomposition of a causal LM's cross-entropy on a dataset")
    rbe.add_argument("model", help="checkpoint directory or hub id (loaded with hf_mhce.from_pretrained)")
    rbe.add_argument("--dataset", required=True, help="datasets name, saved dataset directory or text/json/csv file")
    rbe.add_argument("--dataset-config", default=None)
    rbe.add_argument("--split", default="test")
    rbe.add_argument("--text-column", default="text")
    rbe.add_argument("--tokenizer", default=None, help="defaults to the model's")
    rbe.add_argument("--block-size", type=int, default=256, help="tokens per evaluated block")
    rbe.add_argument("--batch-size", type=int, default=8)
    rbe.add_argument("--max-blocks", type=int, default=None)
    rbe.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    rbe.add_argument("--json", default=None, help="write the report as JSON to this file")
    rbe.add_argument("--plot", default=None, help="write the rank distribution (log-log PNG) to this file")
    rbe.add_argument("--no-progress", action="store_true")
    rbe.set_defaults(func=_rbe)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "train":  # HfArgumentParser owns every option of the main job
        from .train import main as train_main
        from .train.job import end_distributed

        train_main(argv[1:])
        end_distributed()
        return 0
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
