"""MHCE vs CE: the same small Llama trained with cross-entropy and with multi-head cross-entropy.

    python examples/mhce_vs_ce.py                      # default: H = 1 (CE), 2, 4, 8; seeds 0 and 1
    python examples/mhce_vs_ce.py --quick              # reduced size (what the test runs), seconds
    python examples/mhce_vs_ce.py --heads 1 4 --seeds 0 1 2 --steps 400 --learning_rate 1e-3
        (options this script does not know are passed to every ``hf-mhce train`` run)

Every run is the main job, ``hf_mhce.train.main`` (``hf-mhce train``), on the embedded corpus
(Python's documentation from ``pydoc_data.topics``): the same model size, tokenizer (a byte-level
BPE trained once on the training topics), data order, initial weights (the seed fixes them; the
LM head has the same shape for every H), optimizer and number of steps.  Only the loss differs:
``--loss ce`` for H = 1, ``--loss mhce --num_heads H`` otherwise.  Each model is evaluated under its
OWN distribution: for MHCE the uniform mixture of the H head softmaxes (eval loss = -log pbar[target],
perplexity = exp(eval loss)), on two evaluation sets, "docs" (held-out documentation topics) and
"code" (standard-library source, out of domain), with the RBE decomposition of that cross-entropy
(CE = Error-Entropy + Self-Alignment - Confidence, nats; see the README's "RBE decomposition").

Runs go to ``--workers`` parallel processes (``hf-mhce train`` subprocesses with ``--threads`` torch
threads each: see parallel_runs.py; ``--workers 1`` runs them in this process).  These models are
too small for intra-op threads: 2 workers x 1 thread beat 1 x 2 threads on 2 cores, and on a busy
machine two OpenMP threads were up to ~20x slower (measured).
Written to ``--out``: table.md, results.json (every run, per-H means, the verdict), mhce_vs_ce.png,
the tokenizer, and runs/h<H>_s<seed>/ (the main job's output: model, card, metrics.json, RBE plots).

Results on 2026-11-24, CPU (2 vCPUs; 2 workers x 1 thread), default configuration: 3.34M-parameter
Llama (hidden 192, 4 layers, 4 attention heads, MLP 512, BPE vocabulary 4096, untied head), 200 steps
x 16 blocks x 64 tokens (205k tokens, 2 epochs of the 103k training tokens), AdamW lr 3e-3, weight
decay 0.01, cosine schedule, warm-up 20, seeds 0 and 1 (mean and ± std over the seeds; ppl = exp of
the mean loss); evaluation on all of "docs" (9450 tokens) and "code" (24318 tokens).  Wall time
5 min 0 s (1-min load average 2.4: the two workers and a test process beside them); "s / run" is
each run's wall time with the other worker running beside it.  (The 2026-11-22 run, 8 min 27 s on a
slower day, agreed to about 0.01 nats per mean; there H = 2 / 4 / 8 took 1.2x / 1.3x / 1.9x CE's time.)

| H | loss | docs ppl | docs CE | docs EE | docs SA | docs Conf | docs top-1 | code ppl | code CE | code EE | code SA | code Conf | code top-1 | train loss | s / run |
|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|
| 1 | ce | 349.9 | 5.858 ± 0.058 | 5.762 | 0.163 | 0.068 | 0.110 | 1170.3 | 7.065 ± 0.046 | 6.835 | 0.253 | 0.024 | 0.045 | 6.041 | 69 |
| 2 | mhce | 393.3 | 5.974 ± 0.073 | 5.856 | 0.122 | 0.003 | 0.113 | 1158.8 | 7.055 ± 0.019 | 6.895 | 0.213 | 0.052 | 0.037 | 6.179 | 66 |
| 4 | mhce | 479.8 | 6.173 ± 0.010 | 6.016 | 0.111 | -0.047 | 0.102 | 1212.0 | 7.100 ± 0.051 | 6.978 | 0.154 | 0.032 | 0.040 | 6.377 | 66 |
| 8 | mhce | 572.7 | 6.350 ± 0.034 | 6.146 | 0.112 | -0.093 | 0.094 | 1268.3 | 7.145 ± 0.010 | 6.950 | 0.180 | -0.016 | 0.037 | 6.582 | 80 |

The verdict the script prints (computed from the numbers above):
On held-out docs, CE reaches perplexity 349.9; MHCE H=2 393.3 (+12.4 %), H=4 479.8 (+37.1 %), H=8 572.7
(+63.7 %). MHCE loses at H = 4, 8; H = 2 is within twice the seed-to-seed standard error of CE. The
largest difference (H=8, +0.493 nats) splits as CE = EE + SA - Conf into Error-Entropy +0.384,
Self-Alignment -0.051, Confidence -0.160; the main term is higher Error-Entropy (top-1 accuracy 0.110 with
CE, 0.094 with H=8). With growing H (vs CE): Error-Entropy rises (+0.094, +0.254, +0.384) and Confidence
falls (-0.064, -0.114, -0.160). On out-of-domain code, CE reaches perplexity 1170.3; MHCE H=2 1158.8 (-1.0
%), H=4 1212.0 (+3.6 %), H=8 1268.3 (+8.4 %). MHCE loses at H = 8; H = 2, 4 are within twice the
seed-to-seed standard error of CE. The largest difference (H=8, +0.080 nats) splits as CE = EE + SA - Conf
into Error-Entropy +0.115, Self-Alignment -0.074, Confidence -0.039; the main term is higher Error-Entropy
(top-1 accuracy 0.045 with CE, 0.037 with H=8). Wall time per run relative to CE (CPU, same steps): H=2
1.0x, H=4 1.0x, H=8 1.2x. Caveat: 2 seeds per H, one model size, one learning rate tuned for nothing in
particular, a 100k-token corpus.

In short: at this size and budget MHCE does not beat CE; on the in-domain held-out docs perplexity
grows with H (H=2 within seed noise), mostly through a larger Error-Entropy (the targets' ranks
spread out) together with lower Confidence; Self-Alignment is slightly lower for MHCE, but not
enough to compensate.  Out of domain (code) H=2 and H=4 are within seed noise of CE; H=8 loses.
"""

from __future__ import annotations

import math
import os
import statistics
import time

from parallel_runs import (EVAL_SETS, QUICK_SCHEDULE, SCHEDULE, check_sweep_args, eval_metrics, options_argv,
                           prepare_runs, run_jobs, sweep_parser)
from reporting import load_results, save_figure, write_report

# The model of every run; the schedule is parallel_runs.SCHEDULE (QUICK_SCHEDULE with --quick).
DEFAULT = {"hidden_size": 192, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 512,
           **SCHEDULE, "max_steps": 200}
REDUCED = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 64,
           **QUICK_SCHEDULE}


def parse_args(argv=None):
    p = sweep_parser(__doc__.split("\n")[0], "outputs/mhce_vs_ce")
    p.add_argument("--heads", type=int, nargs="+", default=[1, 2, 4, 8], help="H values; 1 = CE")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 1 (quick: 0)")
    p.add_argument("--steps", type=int, default=None, help="training steps of every run")
    args, extra = p.parse_known_args(argv)
    check_sweep_args(p, args)
    if args.seeds is None:
        args.seeds = [0] if args.quick else [0, 1]
    if min(args.seeds) < 0 or len(set(args.seeds)) < len(args.seeds):
        p.error(f"--seeds {args.seeds}: give distinct seeds, each at least 0")
    if 1 not in args.heads or len(set(args.heads)) < 2:
        p.error("--heads must include 1 (the CE baseline) and at least one H > 1")
    if len(set(args.heads)) < len(args.heads):
        p.error(f"--heads {args.heads}: give each H once")
    try:
        hidden = _hidden_size(extra, (REDUCED if args.quick else DEFAULT)["hidden_size"])
    except ValueError:
        p.error("--hidden_size (passed to every run) must be an integer")
    bad = [h for h in args.heads if h < 1 or hidden % h]
    if bad:  # before any run starts, not as a failed training job
        p.error(f"--heads {bad}: every H must be a positive divisor of the hidden size {hidden}")
    return args, extra


def _hidden_size(extra: list[str], default: int) -> int:
    """The runs' hidden size: --hidden_size among the options passed through to the job, else the default."""
    for i, arg in enumerate(extra):
        if arg.startswith("--hidden_size="):
            return int(arg.split("=", 1)[1])
        if arg == "--hidden_size" and i + 1 < len(extra):
            return int(extra[i + 1])
    return default


# -- analysis ------------------------------------------------------------------------------------

def run_row(heads: int, seed: int, summary: dict) -> dict:
    row = {"heads": heads, "seed": seed, "loss": summary["loss"], "parameters": summary["parameters"],
           "train_loss": summary["train"]["train_loss"], "wall_seconds": summary["wall_seconds"],
           **eval_metrics(summary)}
    for s in EVAL_SETS:
        row[f"{s}_ppl"] = math.exp(row[f"{s}_loss"])
    row["curve"] = [(h["step"], h["prefix"][5:], h["cross_entropy"], h["error_entropy"]) for h in summary["rbe_history"]]
    return row


def aggregate(rows: list[dict], heads: list[int]) -> list[dict]:
    """Per H: mean (and sample std when there are several seeds) of every numeric metric."""
    out = []
    for h in heads:
        group = [r for r in rows if r["heads"] == h]
        agg = {"heads": h, "seeds": [r["seed"] for r in group], "parameters": group[0]["parameters"]}
        for key in group[0]:
            if key in ("heads", "seed", "loss", "parameters", "curve"):
                continue
            vals = [r[key] for r in group]
            agg[key] = statistics.fmean(vals)
            agg[f"{key}_std"] = statistics.stdev(vals) if len(vals) > 1 else None
        for s in EVAL_SETS:
            agg[f"{s}_ppl"] = math.exp(agg[f"{s}_loss"])  # geometric mean over seeds
        out.append(agg)
    return out


def markdown_table(summary: list[dict]) -> str:
    def pm(row, key, fmt):
        std = row.get(f"{key}_std")
        return format(row[key], fmt) + (f" ± {std:{fmt}}" if std is not None else "")

    head = "| H | loss |" + "".join(f" {s} ppl | {s} CE | {s} EE | {s} SA | {s} Conf | {s} top-1 |" for s in EVAL_SETS)
    head += " train loss | s / run |"
    lines = [head, "|" + "---:|" * (head.count("|") - 1)]
    for r in summary:
        cells = [str(r["heads"]), "ce" if r["heads"] == 1 else "mhce"]
        for s in EVAL_SETS:
            cells += [f"{r[f'{s}_ppl']:.1f}", pm(r, f"{s}_loss", ".3f")] + [
                f"{r[f'{s}_{c}']:.3f}" for c in ("error_entropy", "self_alignment", "confidence", "top1")]
        cells += [f"{r['train_loss']:.3f}", f"{r['wall_seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(summary: list[dict], n_seeds: int) -> str:
    """One paragraph computed from the numbers: how each H compares with CE, and why (components)."""
    base = next(r for r in summary if r["heads"] == 1)
    others = [r for r in summary if r["heads"] != 1]
    parts = []
    names = {"error_entropy": "Error-Entropy", "self_alignment": "Self-Alignment", "confidence": "Confidence"}
    for s in EVAL_SETS:
        label = {"docs": "held-out docs", "code": "out-of-domain code"}[s]
        items, better, worse, tie = [], [], [], []
        for r in others:
            d = r[f"{s}_loss"] - base[f"{s}_loss"]
            if n_seeds > 1:
                se = math.sqrt((r[f"{s}_loss_std"] ** 2 + base[f"{s}_loss_std"] ** 2) / n_seeds)
                noise = 2 * se
            else:
                noise = 0.0
            (tie if abs(d) <= noise else better if d < 0 else worse).append(r["heads"])
            items.append(f"H={r['heads']} {r[f'{s}_ppl']:.1f} ({(math.exp(d) - 1) * 100:+.1f} %)")
        text = f"On {label}, CE reaches perplexity {base[f'{s}_ppl']:.1f}; MHCE " + ", ".join(items) + ". "
        if better:
            text += f"MHCE beats CE at H = {', '.join(map(str, better))}"
        if worse:
            text += ("; it " if better else "MHCE ") + f"loses at H = {', '.join(map(str, worse))}"
        if tie:
            text += ("; " if better or worse else "") + (
                f"H = {', '.join(map(str, tie))} {'is' if len(tie) == 1 else 'are'} within twice the seed-to-seed standard error of CE")
        text += "."
        # which component carries the difference at the H furthest from CE
        far = max(others, key=lambda r: abs(r[f"{s}_loss"] - base[f"{s}_loss"]))
        d_ce = far[f"{s}_loss"] - base[f"{s}_loss"]
        delta = {c: far[f"{s}_{c}"] - base[f"{s}_{c}"] for c in names}
        share = {"error_entropy": delta["error_entropy"], "self_alignment": delta["self_alignment"],
                 "confidence": -delta["confidence"]}  # each term's contribution to the CE difference
        main = max(share, key=lambda k: abs(share[k]))
        text += (f" The largest difference (H={far['heads']}, {d_ce:+.3f} nats) splits as CE = EE + SA - Conf into"
                 f" Error-Entropy {delta['error_entropy']:+.3f}, Self-Alignment {delta['self_alignment']:+.3f},"
                 f" Confidence {delta['confidence']:+.3f}; the main term is "
                 f"{'higher' if delta[main] > 0 else 'lower'} {names[main]}"
                 f" (top-1 accuracy {base[f'{s}_top1']:.3f} with CE, {far[f'{s}_top1']:.3f} with H={far['heads']}).")
        trends = []
        for c in names:
            d = [r[f"{s}_{c}"] - base[f"{s}_{c}"] for r in others]
            if all(x > 0 for x in d) and d == sorted(d):
                trends.append(f"{names[c]} rises ({', '.join(f'{x:+.3f}' for x in d)})")
            elif all(x < 0 for x in d) and d == sorted(d, reverse=True):
                trends.append(f"{names[c]} falls ({', '.join(f'{x:+.3f}' for x in d)})")
        if trends:
            text += f" With growing H (vs CE): {' and '.join(trends)}."
        parts.append(text)
    cost = ", ".join(f"H={r['heads']} {r['wall_seconds'] / base['wall_seconds']:.1f}x" for r in others)
    noise_note = (f"{n_seeds} seeds per H" if n_seeds > 1 else "one seed per H, so no noise estimate")
    parts.append(f"Wall time per run relative to CE (CPU, same steps): {cost}. Caveat: {noise_note}, one model "
                 f"size, one learning rate tuned for nothing in particular, a 100k-token corpus.")
    return " ".join(parts)


def plot(summary: list[dict], rows: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = [r["heads"] for r in summary]
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    ax = axes[0, 0]
    for s, marker in zip(EVAL_SETS, "os"):
        err = [(r[f"{s}_loss_std"] or 0) * r[f"{s}_ppl"] for r in summary]  # d ppl = ppl * d loss
        ax.errorbar(heads, [r[f"{s}_ppl"] for r in summary], yerr=err, marker=marker, capsize=3, label=s)
    ax.set(title="eval perplexity (each model's own distribution)", ylabel="perplexity")
    base = next(r for r in summary if r["heads"] == 1)
    for ax, s in ((axes[0, 1], "docs"), (axes[1, 0], "code")):
        # each term's contribution to the change of CE relative to H=1: dCE = dEE + dSA - dConf
        for c, sign, style, label in (("cross_entropy", 1, "k-o", "CE"), ("error_entropy", 1, "C0-s", "Error-Entropy"),
                                      ("self_alignment", 1, "C1-^", "Self-Alignment"),
                                      ("confidence", -1, "C2-v", "- Confidence")):
            err = [r[f"{s}_{c}_std"] or 0 for r in summary]
            ax.errorbar(heads, [sign * (r[f"{s}_{c}"] - base[f"{s}_{c}"]) for r in summary], yerr=err, fmt=style,
                        capsize=3, label=label)
        ax.set(title=f"eval set '{s}': change vs CE (H=1), CE = EE + SA - Conf", ylabel="nats")
        ax.axhline(0, color="grey", lw=0.5)
    for ax in (axes[0, 0], axes[0, 1], axes[1, 0]):
        ax.set_xscale("log", base=2)
        ax.set_xticks(heads, [f"{h}\n(CE)" if h == 1 else str(h) for h in heads])
        ax.set_xlabel("heads H")
        ax.legend(fontsize=8)
    ax = axes[1, 1]
    for i, h in enumerate(heads):
        for r in (r for r in rows if r["heads"] == h):
            pts = sorted({(st, ce) for st, name, ce, _ in r["curve"] if name == "docs"})
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=f"C{i}", marker=".",
                    label=f"H={h}" if r["seed"] == rows[0]["seed"] else None)
    ax.set(title="eval loss on docs during training (every seed)", xlabel="step", ylabel="nats")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def main(argv=None) -> dict:
    args, extra = parse_args(argv)
    started = time.time()
    out = args.out
    os.makedirs(out, exist_ok=True)
    if args.replot:
        previous = load_results(out)
        return report(out, [{**r, "curve": [tuple(c) for c in r["curve"]]} for r in previous["runs"]],
                      previous["config"], started - previous["wall_seconds"])

    def jobs_of(options: dict, tokenizer: str) -> list[tuple[str, list[str]]]:
        jobs = []
        for seed in args.seeds:
            for h in args.heads:
                loss = ["--loss", "ce"] if h == 1 else ["--loss", "mhce", "--num_heads", str(h)]
                name = f"h{h}_s{seed}"
                jobs.append((name, ["--output_dir", os.path.join(out, "runs", name), "--tokenizer", tokenizer, *loss,
                                    "--seed", str(seed), *options_argv(options), *extra]))
        return sorted(jobs, key=lambda j: -int(j[0][1:].split("_")[0]))  # slowest (largest H) first

    options, tokenizer, jobs = prepare_runs(args, DEFAULT, REDUCED, jobs_of)
    summaries = run_jobs(jobs, out, args.workers, args.threads)
    rows = [run_row(h, seed, summaries[f"h{h}_s{seed}"]) for seed in args.seeds for h in args.heads]
    config = {"quick": args.quick, "heads": sorted(args.heads), "seeds": args.seeds, "options": options,
              "extra": extra, "workers": args.workers, "threads": args.threads,
              "parameters": rows[0]["parameters"], "tokenizer": tokenizer}
    return report(out, rows, config, started)


def report(out: str, rows: list[dict], config: dict, started: float) -> dict:
    """Per-H summary, verdict, results.json, table.md and the plot from the per-run rows; prints the table."""
    summary = aggregate(rows, config["heads"])
    table = markdown_table(summary)
    text = verdict(summary, len(config["seeds"]))
    result = {"config": config, "runs": rows, "summary": summary, "verdict": text,
              "wall_seconds": round(time.time() - started, 1)}
    write_report(out, result, table, text)
    plot(summary, rows, os.path.join(out, "mhce_vs_ce.png"))
    print(f"\nMHCE vs CE: {config['parameters'] / 1e6:.2f}M parameters, {config['options']['max_steps']} steps, "
          f"seeds {config['seeds']}; perplexity = exp(eval loss) under each model's own distribution; "
          f"CE = EE + SA - Conf (nats)\n")
    print(table)
    print("\n" + text)
    print(f"\nwrote {out}/table.md, results.json, mhce_vs_ce.png ({result['wall_seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
