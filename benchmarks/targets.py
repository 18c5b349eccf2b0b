"""Issue P6's targets read off a peers record: which hold, in which configuration, by how much.

    python benchmarks/targets.py benchmarks/results/<device>-<date>-peers-llama3.json   # prints the verdicts

peers.py appends the same section to the tables it writes.  The targets (bf16; the issue sets them for
the Llama-3-8B head, and they are read here for every shape of the record):

  time      our CE fwd+bwd <= 1.15x the 6NDV floor
  cce       our CE fwd+bwd <= Cut Cross-Entropy's default
  liger     our CE fwd+bwd <  Liger-Kernel's
  memory    our CE peak above the inputs <= 1.05x the dX + dW bound (what the step adds against what its
            gradients need; the issue names the bound X + W + dX + dW, and that ratio is shown beside it)
  mhce      MHCE with H = 4 and 8: fwd+bwd <= 1.10x our CE in the same workspace
  ranks     evaluation forward with ranks <= 1.05x the evaluation forward without

Our CE runs in three workspaces (peers.ENVIRONMENT), and a target holds for the product only in a
configuration a user can pick: so each is judged per configuration, and the summary names the
configurations in which every CE target holds at once.  A number the record lacks (a peer not
installed, out of memory) is "owed", never a pass.  A time verdict whose margin to its limit is smaller
than the spread of the rows it compares (their interquartile ranges over the median, added; a row that
does not record one adds none) is "within noise": the ratio is shown, and it counts as neither a pass
nor a miss.
"""

from __future__ import annotations

import json
import sys

# our CE rows: the configuration each measures (peers.ENVIRONMENT sets the workspace while it runs)
CONFIGURATIONS = {"hf_mhce_ce": "512 MB, default", "hf_mhce_ce_lean": "64 MB", "hf_mhce_ce_fast": "8192 MB"}
TIME_X_FLOOR, MEMORY_X_BOUND, MHCE_X_CE, RANKS_X_FORWARD = 1.15, 1.05, 1.10, 1.05
# (MHCE row, the CE row in the same workspace); (ranks row, the forward it is measured against)
MHCE_PAIRS = (("hf_mhce_mhce4", "hf_mhce_ce"), ("hf_mhce_mhce8", "hf_mhce_ce"), ("hf_mhce_mhce4_fast", "hf_mhce_ce_fast"))
# several heads rank in a second sweep (the mixture needs every head's logsumexp first): about 2x by construction
RANKS_PAIRS = (("hf_mhce_ranks", "hf_mhce_ce"), ("hf_mhce_mhce4_ranks", "hf_mhce_mhce4"), ("slab_ranks", "slab_stats"))


def _missing(rows: dict, name: str, key: str) -> str | None:
    """Why ``rows[name][key]`` cannot be read, or None when it can."""
    row = rows.get(name)
    if row is None:
        return f"{name} not run"
    if key not in row:
        return f"{name}: {row.get('note') or 'no ' + key}"
    return None


def _verdict(target, configuration, value, limit, strict=False, unit="x", why=None, spreads=()) -> dict:
    """``spreads``: the relative spreads of the timed numbers behind ``value`` (None: not recorded)."""
    if why is not None:
        return {"target": target, "configuration": configuration, "limit": limit, "strict": strict, "holds": None,
                "why": why}
    holds = value < limit if strict else value <= limit
    out = {"target": target, "configuration": configuration, "value": value, "limit": limit, "unit": unit,
           "holds": holds, "strict": strict}
    known = [s for s in spreads if s is not None]
    if known:  # a margin smaller than the runs' own spread says nothing either way
        out["spread"] = sum(known)
        out["within_noise"] = abs(value / limit - 1) < out["spread"]
    return out


def _spread(row: dict, key: str):
    """The recorded spread of ``row[key]`` (a time in ms), or None."""
    return row.get(key.removesuffix("_ms") + "_spread")


def _ratio(rows, num, den, key, target, configuration, limit, strict=False, unit="x"):
    """Verdict on rows[num][key] / rows[den][key] against ``limit``."""
    why = _missing(rows, num, key) or _missing(rows, den, key)
    value = None if why else rows[num][key] / rows[den][key]
    spreads = () if why else (_spread(rows[num], key), _spread(rows[den], key))
    return _verdict(target, configuration, value, limit, strict, unit, why, spreads)


def _memory(row: dict, label: str) -> dict:
    """The memory verdict on peak above the inputs / (dX + dW), with / (X + W + dX + dW) beside it
    (recorded since 2026-11-25; older rows give it from their peak and bound)."""
    why = _missing({row["variant"]: row}, row["variant"], "mem_vs_bound")
    out = _verdict("memory", label, None if why else row["mem_vs_bound"], MEMORY_X_BOUND, why=why)
    full = row.get("mem_vs_full_bound")
    if full is None and "peak_extra_mb" in row and row.get("floor_lower_bound_mb"):
        full = row["peak_extra_mb"] / row["floor_lower_bound_mb"]
    if full is not None and not why:
        out["full_bound"] = full
    return out


def verdicts(group: list[dict]) -> list[dict]:
    """The verdicts for one shape and N (the rows peers.run_shape returned for it)."""
    rows = {r["variant"]: r for r in group}
    out = []
    for name, config in CONFIGURATIONS.items():
        if name not in rows:
            continue
        label = f"{name} ({config})"
        why = _missing(rows, name, "vs_floor") or _missing(rows, name, "fwd_bwd_ms")
        out.append(_verdict("time", label, None if why else rows[name]["vs_floor"], TIME_X_FLOOR, why=why,
                            spreads=() if why else (_spread(rows[name], "fwd_bwd_ms"),)))  # the floor's: not recorded
        out.append(_ratio(rows, name, "cce", "fwd_bwd_ms", "cce", label, 1.0, unit="x cce"))
        out.append(_ratio(rows, name, "liger", "fwd_bwd_ms", "liger", label, 1.0, strict=True, unit="x liger"))
        out.append(_memory(rows[name], label))
    for mhce, ce in MHCE_PAIRS:
        if mhce in rows:
            out.append(_ratio(rows, mhce, ce, "fwd_bwd_ms", "mhce", f"{mhce} vs {ce}", MHCE_X_CE, unit=f"x {ce}"))
    for ranks, forward in RANKS_PAIRS:
        if ranks in rows:
            out.append(_ratio(rows, ranks, forward, "fwd_ms", "ranks", f"{ranks} vs {forward}", RANKS_X_FORWARD,
                              unit=f"x {forward}"))
    return out


CE_TARGETS = ("time", "cce", "liger", "memory")


def all_at_once(found: list[dict]) -> dict[str, str]:
    """Per CE configuration: "yes" when its four CE targets hold, "no (...)" naming those that miss
    (and those within noise or owed), "not known (...)" when none misses but one is within noise or
    a number is lacking."""
    summary = {}
    for v in found:
        if v["target"] in CE_TARGETS:
            summary.setdefault(v["configuration"], []).append(v)
    out = {}
    for config, vs in summary.items():
        noisy = [v["target"] for v in vs if v.get("within_noise")]
        missed = [v["target"] for v in vs if v["holds"] is False and not v.get("within_noise")]
        owed = [v["target"] for v in vs if v["holds"] is None]
        rest = "; ".join(f"{what}: {', '.join(names)}" for what, names in (("within noise", noisy), ("owed", owed)) if names)
        out[config] = (f"no (misses {', '.join(missed)}{'; ' + rest if rest else ''})" if missed
                       else f"not known ({rest})" if rest else "yes")
    return out


def markdown(rows: list[dict]) -> str:
    """The section peers.py appends: per shape and N, a verdicts table and the all-at-once line."""
    lines = ["## P6 targets", "",
             f"time <= {TIME_X_FLOOR}x floor, cce <= 1x, liger < 1x, memory <= {MEMORY_X_BOUND}x bound, "
             f"MHCE <= {MHCE_X_CE}x our CE, ranks <= {RANKS_X_FORWARD}x the forward (benchmarks/targets.py). "
             "Memory: the verdict reads the peak above the inputs against dX + dW (what the step adds); in brackets "
             "the same peak against the issue's whole bound X + W + dX + dW. Within noise: the margin to the limit "
             "is smaller than the runs' spread (interquartile ranges over the median, of both rows compared).", ""]
    for shape in dict.fromkeys((r["shape"], r["N"]) for r in rows):
        found = verdicts([r for r in rows if (r["shape"], r["N"]) == shape])
        if not found:
            continue
        lines += [f"### {shape[0]}, N={shape[1]}", "", "| target | configuration | measured | limit | holds |",
                  "|---|---|---:|---:|---|"]
        for v in found:
            measured = f"{v['value']:.2f}{v['unit']}" if v['holds'] is not None else "-"
            if "full_bound" in v:
                measured += f" ({v['full_bound']:.2f}x X+W+dX+dW)"
            holds = {True: "yes", False: "**no**", None: f"owed: {v.get('why', '')}"}[v["holds"]]
            if v.get("within_noise"):
                holds = f"within noise ({holds}; margin {abs(v['value'] / v['limit'] - 1):.1%} < spread {v['spread']:.1%})"
            lines.append(f"| {v['target']} | {v['configuration']} | {measured} | "
                         f"{'<' if v.get('strict') else '<='} {v['limit']} | {holds} |")
        lines.append("")
        for config, status in all_at_once(found).items():
            lines.append(f"- every CE target at once, {config}: {status}")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    for path in paths:
        with open(path) as f:
            rows = json.load(f)
        if not isinstance(rows, list) or not all(isinstance(r, dict) and "variant" in r for r in rows):
            print(f"{path}: not a peers record (a list of rows with a 'variant')", file=sys.stderr)
            return 2
        print(f"# {path}\n\n{markdown(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
