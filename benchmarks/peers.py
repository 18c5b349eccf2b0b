"""hf_mhce against HF eager, torch.compile, Liger-Kernel and Cut Cross-Entropy (issue P6).

    python benchmarks/peers.py                               # GPU: the three heads, N = 4096 / 16384 / 32768, bf16
    python benchmarks/peers.py --shapes llama3 --tokens 8192 --variants hf_eager hf_mhce_ce cce
    TRITON_INTERPRET=1 python benchmarks/peers.py --device cpu --small    # checks the harness itself

For every shape (head D x V, tokens N) and variant: median time, and the spread of the runs, of the
evaluation forward, the backward alone (after an untimed forward in grad mode) and forward+backward
(timing.Timer: CUDA events as in triton.testing.do_bench, warm-up, L2 flushed between runs, at least
--reps runs; inputs rotated over --rotate sets so that no run reuses the previous run's cached inputs),
and the peak memory allocated above the inputs.  Logits have standard deviation --logit-scale (1 by
default; CCE's gradient filter depends on it).  Beside each row: the floor, 6NDV FLOPs (2NDV forward)
at the bf16 matmul rate measured here in the same run (a plain [N, K] x [K, V] product, K = D or 4096,
the faster, V rounded up to a multiple of 128; see ``timing.matmul_rate``), and the memory lower bound
X + W + dX + dW; ratios to the floor and to every peer.  A variant that cannot run here (a
peer not installed, a CUDA-only kernel on CPU) is a row that says why, never a silent gap.

Variants (bf16 inputs, float32 loss):
  hf_eager          logits = x W^T in bf16, upcast, F.cross_entropy (what transformers does)
  compile_chunked   a torch.compile'd chunk loss, chunks of 4096 tokens looped eagerly, each checkpointed
  liger             Liger-Kernel's fused linear cross-entropy
  cce / cce_exact   Cut Cross-Entropy's linear_cross_entropy, default and without its gradient filter (cce_options)
  hf_mhce_ce        hf_mhce.linear_cross_entropy
  hf_mhce_ce_lean   the same with HF_MHCE_WORKSPACE_MB=64: the backward's dW and dX passes (10NDV, least memory)
  hf_mhce_ce_fast   the same with HF_MHCE_WORKSPACE_MB=8192: gradients in the forward (6NDV, more memory)
  hf_mhce_mhce4/8   hf_mhce.multi_head_cross_entropy with H = 4 / 8 (hf_mhce_mhce4_fast: 8192 MB as above)
  hf_mhce_ranks     hf_mhce CE forward under collect_ranks (evaluation: forward only)
  hf_mhce_mhce4_ranks  the same for MHCE H = 4 (the ranks' second sweep under the mixture), against hf_mhce_mhce4
  slab_stats        candidate evaluation forward: cuBLAS float32 logit slabs and a row kernel
                    (triton_forward_grad.slab_forward_stats), against hf_mhce_ce's tile forward
  slab_ranks        the same with the target's rank in the row pass, against hf_mhce_ranks
  slab_vocab        prototype: cuBLAS on float32 logit slabs per vocabulary slice, 8NDV (slab_prototype.py)
  slab_fwdgrad      prototype: gradients in the forward per token chunk, float32 dW, 6NDV (slab_prototype.py)
Every variant's loss, and its dX and dW, are compared with float32 references of the same loss (hf_mhce's
torch path on float32 copies of the inputs; H heads for the MHCE rows): a fast wrong answer is no result.
Writes benchmarks/results/<device>-<date>-peers-<shapes>.md and .json (records.py's naming rule), after
every shape.  Off CUDA it needs --small and, for the hf_mhce rows, TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json

import torch
import torch.nn.functional as F
from records import Record, add_device_options, check_device, device_label, environment, positive_float, positive_int
from targets import markdown as targets_markdown
from timing import Timer, matmul_rate, measure  # moved there; peers.Timer and peers.measure stay importable

SHAPES = {"gpt2": (768, 50257), "mistral7b": (4096, 32768), "llama3": (4096, 128256)}
SMALL = {"gpt2": (48, 263)}  # --small: the harness itself on CPU / under the interpreter (9 vocabulary tiles)
PEERS = ("hf_eager", "compile_chunked", "liger", "cce", "cce_exact")
OURS = ("hf_mhce_ce", "hf_mhce_ce_lean", "hf_mhce_ce_fast", "hf_mhce_mhce4", "hf_mhce_mhce4_fast", "hf_mhce_mhce8",
        "hf_mhce_ranks", "hf_mhce_mhce4_ranks")
# Each row runs in the configuration its name says, whatever the caller's environment: the settings that
# choose a schedule are unset (their defaults) unless the row sets them, and restored after it.
SCHEDULE_SETTINGS = {"HF_MHCE_WORKSPACE_MB": None, "HF_MHCE_GRAD_IN_FORWARD": None}
ENVIRONMENT = {"hf_mhce_ce_lean": {"HF_MHCE_WORKSPACE_MB": "64"},  # set while the variant runs
               "hf_mhce_ce_fast": {"HF_MHCE_WORKSPACE_MB": "8192"},
               "hf_mhce_mhce4_fast": {"HF_MHCE_WORKSPACE_MB": "8192"}}
CANDIDATES = ("slab_stats", "slab_ranks")  # forward only, measured before a default uses them
PROTOTYPES = ("slab_vocab", "slab_fwdgrad")


class Unavailable(Exception):
    """This variant cannot run here; the message says why (it becomes the row's note)."""


CHUNK = 4096  # compile_chunked's tokens per chunk


def _chunk_loss(xc, w, yc):
    """One chunk's summed CE: the only part compile_chunked compiles."""
    return F.cross_entropy((xc @ w.T).float(), yc, ignore_index=-100, reduction="sum")


def _chunked_ce(piece, x, w, labels):
    """The chunks looped eagerly, each checkpointed: about one chunk's float32 logits alive at a time.
    Compiled as one graph with the loop, the compiled backward kept every chunk's logits (H100 record of
    2026-11-24: memory grew with the number of chunks)."""
    from torch.utils.checkpoint import checkpoint

    total = sum(checkpoint(piece, x[i:i + CHUNK], w, labels[i:i + CHUNK], use_reentrant=False)
                for i in range(0, x.shape[0], CHUNK))
    return total / (labels != -100).sum()


def cce_options(name: str) -> dict:
    """Keyword arguments of CCE's linear_cross_entropy for the row `name`.

    cce_exact is CCE without its gradient filter (which skips the gradient of entries below bf16
    resolution).  CCE after 25.1.1 (GitHub) names it impl="cce_exact", which also accumulates the
    gradients in float32; 25.1.1, PyPI's newest, has the impls cce and torch_compile only, and there
    the filter is turned off by filter_eps=None (impl="cce_exact" raises NotImplementedError).
    """
    if name == "cce":
        return {"impl": "cce"}  # its default filter_eps
    from cut_cross_entropy import LinearCrossEntropyImpl

    if "cce_exact" in {member.name.lower() for member in LinearCrossEntropyImpl}:
        return {"impl": "cce_exact"}
    return {"impl": "cce", "filter_eps": None}


def make_variant(name: str, device: torch.device):
    """A function (x, w, labels) -> scalar loss, plus whether it is forward-only."""
    import hf_mhce

    if name == "hf_eager":
        return (lambda x, w, y: F.cross_entropy((x @ w.T).float(), y, ignore_index=-100)), False
    if name == "compile_chunked":
        if device.type != "cuda":
            raise Unavailable("torch.compile benchmarked on CUDA only")
        # Dynamo's cache belongs to _chunk_loss's code object, shared by every shape of the run: each
        # shape adds entries (with and without gradients, a shorter last chunk), and past recompile_limit
        # (8) it runs the function eager, still timed as this row.  A fresh cache per shape stays under it.
        torch._dynamo.reset()
        return functools.partial(_chunked_ce, torch.compile(_chunk_loss, dynamic=False)), False
    if name == "liger":
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError as err:
            raise Unavailable(f"liger-kernel not installed ({err})") from None
        from hf_mhce.ops.budget import interpreting

        if device.type != "cuda" and not interpreting():  # its Triton kernels run under the interpreter too
            raise Unavailable("Liger's kernels need CUDA tensors (or TRITON_INTERPRET=1)")
        fn = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
        return (lambda x, w, y: fn(w, x, y)), False
    if name in ("cce", "cce_exact"):
        try:
            from cut_cross_entropy import linear_cross_entropy as cce
        except ImportError as err:
            raise Unavailable(f"cut-cross-entropy not installed ({err})") from None
        if device.type != "cuda":  # its kernels call libdevice, which the interpreter lacks
            raise Unavailable("Cut Cross-Entropy's kernels need CUDA tensors")
        options = cce_options(name)
        return (lambda x, w, y: cce(x, w, y, **options)), False
    if name in ("hf_mhce_ce", "hf_mhce_ce_lean", "hf_mhce_ce_fast"):
        return (lambda x, w, y: hf_mhce.linear_cross_entropy(x, w, y, backend="triton")), False
    if name.endswith("_ranks") and name.startswith("hf_mhce_"):  # what RBECallback does in evaluation
        return ranked_forward(heads_of(name)), True
    if name.startswith("hf_mhce_mhce"):
        heads = heads_of(name)
        return (lambda x, w, y: hf_mhce.multi_head_cross_entropy(x, w, y, heads, backend="triton")), False
    if name in CANDIDATES:
        from hf_mhce.ops import mixture, triton_forward_grad

        def slab_forward(x, w, y):
            labels = torch.where(y == -100, -1, y)  # the ops' encoding of ignored tokens
            stats = triton_forward_grad.slab_forward_stats(x, w, None, labels, 1, None, False,
                                                           need_ranks=name == "slab_ranks")
            if stats is None:
                raise Unavailable("a chunk of MIN_ROWS tokens does not fit HF_MHCE_WORKSPACE_MB")
            valid = labels >= 0
            losses = mixture.token_losses(stats.lse, stats.log_p_target, None, valid, w.shape[0], 0.0, 0.0)
            return losses.sum() / valid.sum().clamp_min(1)
        return slab_forward, True
    if name in PROTOTYPES:
        import slab_prototype

        return getattr(slab_prototype, name), False
    raise ValueError(f"unknown variant {name!r}")


def ranked_forward(heads: int):
    """The evaluation forward with ranks: one head counts them in the same sweep, several in a second one."""
    import hf_mhce
    from hf_mhce.losses import collect_ranks
    from hf_mhce.rbe.stats import RBEStats

    def ranked(x, w, y):
        ranked.stats = RBEStats(w.shape[0], device=x.device)  # run_shape checks that every token was ranked
        with collect_ranks(ranked.stats.add):
            if heads == 1:
                return hf_mhce.linear_cross_entropy(x, w, y, backend="triton")
            return hf_mhce.multi_head_cross_entropy(x, w, y, heads, backend="triton")
    return ranked


def inputs(n, d, v, device, dtype, rotate, seed=0, logit_scale=1.0):
    """W and ``rotate`` sets of (X, labels, 5 % ignored): standard normal entries scaled so that the logits
    x . w have standard deviation ``logit_scale`` (trained heads are peakier than 1, and CCE's gradient
    filter skips more blocks the peakier they are)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    sets = []
    for _ in range(rotate):
        x = (torch.randn(n, d, generator=g) / d ** 0.25).to(device, dtype)
        y = torch.randint(0, v, (n,), generator=g)
        y[torch.rand(n, generator=g) < 0.05] = -100
        sets.append((x, y.to(device)))
    w = (torch.randn(v, d, generator=g) * (logit_scale / d ** 0.25)).to(device, dtype)
    return w, sets


def heads_of(name: str) -> int:
    """The number of MHCE heads a variant's loss has (1: cross-entropy)."""
    if not name.startswith("hf_mhce_mhce"):
        return 1
    return int(name.removeprefix("hf_mhce_mhce").removesuffix("_fast").removesuffix("_ranks"))


def reference(x, w, labels, heads):
    """Loss, dX, dW of the mean (multi-head) CE in float32 (hf_mhce's chunked torch path on float32 copies)."""
    import hf_mhce

    xr, wr = (t.detach().float().requires_grad_() for t in (x, w))
    loss = hf_mhce.multi_head_cross_entropy(xr, wr, labels, heads, backend="torch")
    loss.backward()
    return loss.item(), xr.grad, wr.grad


def grad_errors(fn, x, w, labels, ref_loss, ref) -> dict:
    """Relative errors of a variant's loss in grad mode (Liger and our 6NDV rows compute it by other code
    than the evaluation forward's) and of its dX and dW (L2) against the float32 references."""
    xv, wv = (t.detach().clone().requires_grad_() for t in (x, w))
    loss = fn(xv, wv, labels)
    loss.backward()
    out = {"loss_grad_rel_err": abs(float(loss.detach()) - ref_loss) / abs(ref_loss)}
    for key, got, want in (("dx_rel_err", xv.grad, ref[0]), ("dw_rel_err", wv.grad, ref[1])):
        out[key] = float((got.float() - want).norm() / want.norm())
    return out


def run_shape(label, d, v, n, variants, device, dtype, reps, rotate, logit_scale=1.0) -> list[dict]:
    timer = Timer(device, reps)
    rate = matmul_rate(n, d, v, device, dtype, timer)
    w, sets = inputs(n, d, v, device, dtype, rotate, logit_scale=logit_scale)
    elem = torch.finfo(dtype).bits // 8
    floor = {"fwd_ms": 1000 * 2 * n * d * v / rate, "fwd_bwd_ms": 1000 * 6 * n * d * v / rate,
             "lower_bound_mb": 2 * (n * d + v * d) * elem / 2**20}  # X, W, dX, dW
    rows = []
    x0, y0 = sets[0]
    references = {}  # per number of heads: a fast wrong answer is no result
    for name in variants:
        row = {"shape": label, "D": d, "V": v, "N": n, "variant": name, "logit_std": logit_scale,
               **{f"floor_{k}": x for k, x in floor.items()}}
        with environment({**SCHEDULE_SETTINGS, **ENVIRONMENT.get(name, {})}):  # the row's settings, restored after it
            try:
                fn, forward_only = make_variant(name, device)
                heads = heads_of(name)
                if heads not in references:
                    references[heads] = reference(x0, w, y0, heads)
                ref_loss, *ref_grads = references[heads]
                with torch.no_grad():
                    row["loss_rel_err"] = abs(float(fn(x0, w, y0)) - ref_loss) / abs(ref_loss)
                if hasattr(fn, "stats") and fn.stats.num_tokens != int((y0 != -100).sum()):  # ranks: a row timing no ranks
                    raise RuntimeError(f"{fn.stats.num_tokens} tokens ranked of {int((y0 != -100).sum())}")
                # timed before the gradient check, whose fwd+bwd at the same N would run out of memory first
                measure(fn, forward_only, w, sets, timer, device, row)  # fills the row as it goes
                row["vs_floor"] = row.get("fwd_bwd_ms", row["fwd_ms"]) / floor["fwd_bwd_ms" if "fwd_bwd_ms" in row else "fwd_ms"]
                if "peak_extra_mb" in row:
                    # inputs X, W are allocated before: the verdict's bound on what the step adds is dX + dW;
                    # the issue's whole bound X + W + dX + dW beside it
                    row["mem_vs_bound"] = row["peak_extra_mb"] / (floor["lower_bound_mb"] / 2)
                    row["mem_vs_full_bound"] = row["peak_extra_mb"] / floor["lower_bound_mb"]
                if not forward_only:
                    row.update(grad_errors(fn, x0, w, y0, ref_loss, ref_grads))
            except Unavailable as why:
                row["note"] = str(why)
            except torch.cuda.OutOfMemoryError:
                row["note"] = "out of memory"
            except Exception as err:  # one broken peer must not cost the whole (one-shot) device run
                row["note"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def versions() -> str:
    """The packages each row ran with: a peer's speed and defaults change between its releases."""
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"
    return ", ".join(f"{name} {version(name)}" for name in ("torch", "triton", "liger-kernel", "cut-cross-entropy"))


def _cells(r: dict) -> dict:
    """A row's table cells: times with their spread, the memory ratios, the larger loss error."""
    def t(key):
        if f"{key}_ms" not in r:
            return "-"
        spread = r.get(f"{key}_spread")
        return f"{r[f'{key}_ms']:.2f}" + (f" ({100 * spread:.0f}%)" if spread is not None else "")
    bound = f"{r['mem_vs_bound']:.2f}" if "mem_vs_bound" in r else "-"
    if "mem_vs_full_bound" in r:
        bound += f" ({r['mem_vs_full_bound']:.2f})"
    loss = [r[k] for k in ("loss_rel_err", "loss_grad_rel_err") if k in r]
    return {"fwd": t("fwd"), "bwd": t("bwd"), "fwd_bwd": t("fwd_bwd"), "bound": bound,
            "loss": format(max(loss), ".1e") if loss else "-"}


def markdown(rows: list[dict], device_name: str, today: str, logit_scale: float = 1.0) -> str:
    try:  # which call cce_exact is depends on CCE's release
        call = ", ".join(f"{k}={v!r}" for k, v in cce_options("cce_exact").items())
        exact = f" cce_exact called linear_cross_entropy(x, w, labels, {call})."
    except ImportError:
        exact = ""
    lines = [f"# Fused cross-entropy vs peers on {device_name} ({today})", "", f"Versions: {versions()}.{exact}", "",
             f"Inputs: logits x . w with standard deviation {logit_scale:g} (--logit-scale), 5 % of tokens ignored. "
             "CCE's default gradient filter skips the blocks whose gradient is below bf16 resolution, so its time "
             "depends on this spread (trained heads are peakier than std 1).", "",
             "Times in ms (median; in brackets the interquartile range of the runs over the median); floor = 6NDV "
             "(fwd+bwd) or 2NDV (fwd) FLOPs at the matmul rate measured in the same run; fwd = an evaluation forward (no "
             "gradients); bwd = the backward alone (loss.backward() timed after an untimed forward in grad mode: for rows "
             "that compute their gradients in that forward, the work is in fwd+bwd, not in fwd or bwd); x hf_mhce_ce: "
             "fwd+bwd, or fwd for forward-only rows; x bound = peak allocated above the inputs over dX + dW (the memory "
             "verdict's reading), in brackets over X + W + dX + dW; loss / dX / dW err = relative difference from the "
             "float32 reference of the row's own loss (cross-entropy; MHCE with H heads for the MHCE rows), loss err the "
             "larger of the evaluation forward's and the grad-mode forward's.", ""]
    for shape in dict.fromkeys((r["shape"], r["N"]) for r in rows):
        group = [r for r in rows if (r["shape"], r["N"]) == shape]
        g0 = group[0]
        lines += [f"## {shape[0]} (D={g0['D']}, V={g0['V']}), N={shape[1]}: floor {g0['floor_fwd_bwd_ms']:.2f} ms "
                  f"fwd+bwd, {g0['floor_fwd_ms']:.2f} ms fwd", "",
                  "| variant | fwd | bwd | fwd+bwd | x floor | peak extra MB | x bound | x hf_mhce_ce | loss err | dX err | dW err | note |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        ours = next((r for r in group if r["variant"] == "hf_mhce_ce" and "fwd_bwd_ms" in r), None)
        for r in group:
            def f(key, fmt=".2f"):
                return format(r[key], fmt) if key in r else "-"
            key = "fwd_bwd_ms" if "fwd_bwd_ms" in r else "fwd_ms"  # forward-only rows (ranks): vs our forward
            rel = f"{r[key] / ours[key]:.2f}" if ours and key in r else "-"
            c = _cells(r)
            lines.append(f"| {r['variant']} | {c['fwd']} | {c['bwd']} | {c['fwd_bwd']} | {f('vs_floor')} | "
                         f"{f('peak_extra_mb', '.0f')} | {c['bound']} | {rel} | {c['loss']} | "
                         f"{f('dx_rel_err', '.1e')} | {f('dw_rel_err', '.1e')} | {r.get('note', '')} |")
        lines.append("")
    return "\n".join(lines) + "\n" + targets_markdown(rows)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), help=f"default: {' '.join(SHAPES)} (--small: its own tiny shape)")
    p.add_argument("--tokens", type=positive_int, nargs="+", help="default: 4096 16384 32768 (--small: 37 64)")
    # the prototypes only on request: hf_mhce_ce (8NDV) and hf_mhce_ce_fast (6NDV) are their designs, built
    p.add_argument("--variants", nargs="+", default=[*PEERS, *OURS, *CANDIDATES],
                   choices=[*PEERS, *OURS, *CANDIDATES, *PROTOTYPES])
    add_device_options(p, reps=5)
    p.add_argument("--rotate", type=positive_int, default=3, help="input sets cycled through (cache fairness)")
    p.add_argument("--logit-scale", type=positive_float, default=1.0,
                   help="standard deviation of the logits (CCE's gradient filter skips more of a peakier head)")
    args = p.parse_args(argv)
    if args.small and args.shapes:
        p.error("--small runs its own tiny shape; leave out --shapes")
    device = check_device(p, args, triton=any(v in OURS or v in CANDIDATES for v in args.variants))
    dtype = getattr(torch, args.dtype)
    shapes = SMALL if args.small else {k: SHAPES[k] for k in args.shapes or SHAPES}
    tokens = args.tokens or ([37, 64] if args.small else [4096, 16384, 32768])
    name = device_label(device)
    today = datetime.date.today().isoformat()
    record = Record(p, args, f"{name}-{today}-peers-{'-'.join(shapes)}" + ("-small" if args.small else ""),
                    named={"shapes", "small"})
    rows = []
    for label, (d, v) in shapes.items():
        for n in tokens:
            rows += run_shape(label, d, v, n, args.variants, device, dtype, args.reps, args.rotate, args.logit_scale)
            # rewritten after every shape: a run cut short by the device's time limit keeps what it measured
            record.write(rows, markdown(rows, name, today, args.logit_scale))
    return rows


if __name__ == "__main__":
    main()
