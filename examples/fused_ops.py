"""Fused cross-entropy and MHCE on a small random problem, checked against the materialised loss.

    python examples/fused_ops.py [--vocab 5000 --tokens 512 --hidden 128 --heads 4]

Prints the fused CE beside F.cross_entropy (both losses and the largest difference of their dX and
dW), the fused MHCE beside the mixture loss computed from explicit per-head log-softmaxes (both
losses and their difference), and the mixture's log-probabilities of three tokens (rows sum to 1).
"""

import argparse
import math

import torch
import torch.nn.functional as F

from hf_mhce import linear_cross_entropy, multi_head_cross_entropy, multi_head_logprobs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--vocab", type=int, default=5000, help="vocabulary size V (rows of the head W)")
    p.add_argument("--tokens", type=int, default=512, help="tokens N (rows of the hidden states X)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size D")
    p.add_argument("--heads", type=int, default=4, help="MHCE heads H; must divide --hidden")
    args = p.parse_args()
    for name in ("vocab", "tokens", "hidden", "heads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)} must be at least 1")
    if args.hidden % args.heads:
        p.error(f"--heads {args.heads} does not divide --hidden {args.hidden}: each head takes D / H columns")
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, requires_grad=True)
    w = (torch.randn(args.vocab, args.hidden) / math.sqrt(args.hidden)).requires_grad_()
    y = torch.randint(0, args.vocab, (args.tokens,))

    fused = linear_cross_entropy(x, w, y)
    gx, gw = torch.autograd.grad(fused, (x, w))
    eager = F.cross_entropy(x @ w.T, y)
    ex, ew = torch.autograd.grad(eager, (x, w))
    print(f"CE    fused {fused.item():.6f}  eager {eager.item():.6f}  max |dX diff| {(gx - ex).abs().max():.2e}"
          f"  max |dW diff| {(gw - ew).abs().max():.2e}")

    h = args.heads
    mhce = multi_head_cross_entropy(x, w, y, h)
    per_head = torch.stack([F.log_softmax(xs @ ws.T, -1) for xs, ws in zip(x.chunk(h, -1), w.chunk(h, -1))])
    explicit = -(torch.logsumexp(per_head, 0) - math.log(h)).gather(1, y[:, None]).mean()
    print(f"MHCE  fused {mhce.item():.6f}  explicit {explicit.item():.6f}  |diff| {(mhce - explicit).abs():.2e}  (H={h})")
    logp = multi_head_logprobs(x[:3], w, h)
    print(f"mixture log-probs: shape {tuple(logp.shape)}, probabilities sum to {logp.exp().sum(-1).tolist()}")


if __name__ == "__main__":
    main()
