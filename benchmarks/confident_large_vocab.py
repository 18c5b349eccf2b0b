"""Loss of confident tokens at a large vocabulary: relative error against float64, ours and eager float32.

    TRITON_INTERPRET=1 python benchmarks/confident_large_vocab.py --device cpu     # both backends, CPU
    python benchmarks/confident_large_vocab.py --device cuda --vocab 128256         # on a GPU

Each token's target logit is 0 and the others lie `gap` to `gap` + 3 below, so its loss is
log(1 + rest) with rest = sum_{j != t} exp(z_j) ~ 1e-2 .. 1e-5.  A running sum exp(z - max) that holds
the maximum's own 1 rounds every later addition to an ulp of 1 (6e-8): a block or tile's share of
rest below that was lost, before the sweeps kept the rest apart (NOTES change 13).  Eager is
F.cross_entropy on the same float32 logits.  Hidden rows are one-hot, so the logits are exactly the
weight's columns.  Prints one line per gap.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from hf_mhce import multi_head_cross_entropy


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--gaps", type=float, nargs="+", default=[14.0, 17.0, 20.0])
    p.add_argument("--chunk-mb", help="HF_MHCE_CHUNK_MB for the torch backend (its column blocks)")
    args = p.parse_args(argv)
    if args.chunk_mb:
        os.environ["HF_MHCE_CHUNK_MB"] = args.chunk_mb
    dev, n, v = torch.device(args.device), args.tokens, args.vocab
    backends = ["torch"] + (["triton"] if dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else [])
    g = torch.Generator().manual_seed(0)
    for gap in args.gaps:
        z = -gap - 3 * torch.rand(n, v, generator=g, dtype=torch.float64)
        labels = torch.randint(0, v, (n,), generator=g)
        z[torch.arange(n), labels] = 0.0
        z32 = z.float()
        ref = torch.log1p(torch.exp(z32.double()).sum(-1) - 1.0)  # the float32 logits' true loss

        def rel(loss):
            return ((loss.double().cpu() - ref).abs() / ref).max().item()
        line = f"gap {gap:g}: loss ~ {ref.mean():.1e}  eager {rel(F.cross_entropy(z32.to(dev), labels.to(dev), reduction='none')):.1e}"
        x, w = torch.eye(n, dtype=torch.float32, device=dev), z32.T.contiguous().to(dev)
        for backend in backends:
            loss = multi_head_cross_entropy(x, w, labels.to(dev), 1, reduction="none", backend=backend)
            line += f"  {backend} {rel(loss):.1e}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
