"""GPU check of RBE ranks when rows of W duplicate the target's row (exact ties in real arithmetic).

    python benchmarks/gpu_ties.py                  # N=4096, V=32768, D=4096, bf16 + fp32, H=1 and 4
    python benchmarks/gpu_ties.py --softcap 30 --heads 4   # Gemma-2's softcap (the rank kernel's c * tanh)
    TRITON_INTERPRET=1 python benchmarks/gpu_ties.py --device cpu --small   # checks the script (N=48, V=300, D=64)

A rank counts the entries j != t strictly above the target.  A row of W equal to the target's row
must tie with it, as it does in one full logits matmul; that holds only if the kernel's target
logit rounds exactly like the sweep's tiles (before, a separate dot product put about half of the
duplicates above the target).  Each target's row is copied to the next index, and the Triton ranks
are compared with ranks from float64 logits of the same (rounded) inputs.  Rows where some other
entry lies within rounding of the target (a near-tie that float32 accumulation may order either
way) are left out and counted; every other row must agree exactly.

Rows "slab" (one head): the candidate forward ``slab_forward_stats`` (NOTES change 9), which reads
the target off a cuBLAS float32 logit slab; its duplicates tie only if one GEMM rounds equal columns
alike wherever they sit, which cuBLAS does not document (a split-K or stream-K kernel may split K
differently per output tile).  Reported, not a failure of this check: the candidate's decision rule
needs wrong_ranks = 0 here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math

import torch
from records import Record, add_device_options, check_device, device_label, positive_int

from hf_mhce.ops import triton_forward, triton_forward_grad

NEAR = 1e-5  # relative gap below which a non-duplicate entry is a near-tie (float32 sums of D terms)
EQUAL = 1e-12  # relative gap below which float64 values count as the same (duplicates)


def reference(x, w, labels, heads, softcap=None, chunk=512):
    """(ranks, ambiguous) from float64 logits (softcapped: c * tanh(z / c)): ranks with ties in the target's
    favour, and which rows have a non-equal entry within NEAR of the target (under the mixture for several heads)."""
    n, d = x.shape
    dh = d // heads
    wd = w.double().view(-1, heads, dh)

    def capped(z):
        return z if softcap is None else softcap * torch.tanh(z / softcap)
    lse = torch.stack([torch.logsumexp(capped(x[:, h * dh:(h + 1) * dh].double() @ wd[:, h].T), -1)
                       for h in range(heads)], 1)
    ranks, ambiguous = [], []
    for n0 in range(0, n, chunk):
        xs = x[n0:n0 + chunk].double().view(-1, heads, dh)
        y = capped(torch.einsum("nhd,vhd->nhv", xs, wd)) - lse[n0:n0 + chunk, :, None]
        logp = torch.logsumexp(y, 1)  # mixture log-prob up to log H: [rows, V]
        t = logp.gather(1, labels[n0:n0 + chunk, None])
        gap = (logp - t) / t.abs().clamp_min(1.0)
        gap.scatter_(1, labels[n0:n0 + chunk, None], float("inf"))  # the target itself is never counted
        ranks.append(((gap > EQUAL) & gap.isfinite()).sum(1))
        ambiguous.append(((gap.abs() > EQUAL) & (gap.abs() < NEAR)).any(1))
    return torch.cat(ranks), torch.cat(ambiguous)


def run_case(n, v, d, heads, dtype, device, forward="tile", softcap=None):
    g = torch.Generator().manual_seed(heads)
    x = torch.randn(n, d, generator=g).to(device)
    w = (torch.randn(v, d, generator=g) / math.sqrt(d)).to(device)
    labels = torch.randint(0, v - 1, (n,), generator=g).to(device)
    labels[: n // 4] = (x[: n // 4] @ w.T).argmax(-1).clamp_max(v - 2)  # well-ranked targets: ranks near 0
    w[labels + 1] = w[labels]  # each target's row also at the next index
    x, w = x.to(dtype), w.to(dtype)
    row = {"forward": forward, "dtype": str(dtype).replace("torch.", ""), "heads": heads, "rows": n, "softcap": softcap}
    stats_of = triton_forward.forward_stats if forward == "tile" else triton_forward_grad.slab_forward_stats
    stats = stats_of(x, w, None, labels, heads, softcap, False, need_ranks=True)
    if stats is None:  # the slabs do not apply (float32 under TF32, or no chunk fits the workspace)
        return {**row, "note": "slab_forward_stats does not apply here"}
    ranks = stats.ranks
    expected, ambiguous = reference(x, w, labels, heads, softcap)
    compared = ~ambiguous
    wrong = (ranks != expected) & compared
    return {**row, "near_tie_rows_left_out": int(ambiguous.sum()),
            "rows_compared": int(compared.sum()), "wrong_ranks": int(wrong.sum()),
            "duplicates_ranked_above": int((ranks - expected)[compared].clamp_min(0).sum()),
            "median_rank": float(expected.double().median())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_device_options(p, reps=None)  # a correctness check: nothing is timed
    p.add_argument("--heads", type=positive_int, nargs="+", default=[1, 4])
    p.add_argument("--softcap", type=float, default=None, help="logit softcap c (c * tanh(z / c)); default: none")
    args = p.parse_args(argv)
    if args.softcap is not None and not (math.isfinite(args.softcap) and args.softcap > 0):
        p.error(f"--softcap must be a positive number, got {args.softcap}")
    device = check_device(p, args)
    n, v, d = (48, 300, 64) if args.small else (4096, 32768, 4096)
    if any(d % h for h in args.heads):
        p.error(f"every --heads must divide the hidden size {d}: got {args.heads}")
    name = device_label(device)
    record = Record(p, args, f"{name}-{datetime.date.today().isoformat()}-ties")
    rows = []
    for dt in dict.fromkeys(("float32", args.dtype)):  # --dtype float32: once
        for h in args.heads:
            for forward in ("tile", "slab") if h == 1 else ("tile",):
                rows.append(run_case(n, v, d, h, getattr(torch, dt), device, forward, args.softcap))
                print(json.dumps(rows[-1]))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cap = f", softcap {args.softcap:g}" if args.softcap else ""
    lines = [f"# Rank ties with duplicated target rows: N={n}, V={v}, D={d}{cap} on {name}", "",
             "Target: wrong_ranks = 0 (rows with a non-duplicate near-tie are left out and counted).", "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "-")) for k in keys) + " |" for r in rows]
    record.write(rows, "\n".join(lines))
    if any(r["wrong_ranks"] for r in rows if r["forward"] == "tile"):
        raise SystemExit("ranks disagree with the float64 reference on rows without near-ties")


if __name__ == "__main__":
    main()
