"""hf_mhce against HF eager, torch.compile, Liger-Kernel and Cut Cross-Entropy (issue P6).

    python benchmarks/peers.py                               # GPU: the three heads, N = 4096 / 16384 / 32768, bf16
    python benchmarks/peers.py --shapes llama3 --tokens 8192 --variants hf_eager hf_mhce_ce cce
    TRITON_INTERPRET=1 python benchmarks/peers.py --device cpu --small    # checks the harness itself

For every shape (head D x V, tokens N) and variant: median time of the forward, the backward and
forward+backward (CUDA events as in triton.testing.do_bench: warm-up, L2 flushed between runs, at
least --reps runs; inputs rotated
over --rotate sets so that no run reuses the previous run's cached inputs), and the peak memory
allocated above the inputs.  Beside each row: the floor, 6NDV FLOPs (2NDV forward) at the bf16
matmul rate measured here in the same run (a plain [N, K] x [K, V] product, K = D or 4096, the faster;
see ``matmul_rate``), and the memory lower
bound X + W + dX + dW; ratios to the floor and to every peer.  A variant that cannot run here (a
peer not installed, a CUDA-only kernel on CPU) is a row that says why, never a silent gap.

Variants (bf16 inputs, float32 loss):
  hf_eager          logits = x W^T in bf16, upcast, F.cross_entropy (what transformers does)
  compile_chunked   torch.compile'd chunks of 4096 tokens, each checkpointed (logits recomputed)
  liger             Liger-Kernel's fused linear cross-entropy
  cce / cce_exact   Cut Cross-Entropy's linear_cross_entropy, default and without its gradient filter (cce_options)
  hf_mhce_ce        hf_mhce.linear_cross_entropy
  hf_mhce_ce_lean   the same with HF_MHCE_WORKSPACE_MB=64: the backward's dW and dX passes (10NDV, least memory)
  hf_mhce_ce_fast   the same with HF_MHCE_WORKSPACE_MB=8192: gradients in the forward (6NDV, more memory)
  hf_mhce_mhce4/8   hf_mhce.multi_head_cross_entropy with H = 4 / 8 (hf_mhce_mhce4_fast: 8192 MB as above)
  hf_mhce_ranks     hf_mhce CE forward under collect_ranks (evaluation: forward only)
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
import json
import statistics
import time

import torch
import torch.nn.functional as F
from records import Record, add_device_options, check_device, device_label, environment, positive_int
from targets import markdown as targets_markdown

SHAPES = {"gpt2": (768, 50257), "mistral7b": (4096, 32768), "llama3": (4096, 128256)}
SMALL = {"gpt2": (48, 263)}  # --small: the harness itself on CPU / under the interpreter (9 vocabulary tiles)
PEERS = ("hf_eager", "compile_chunked", "liger", "cce", "cce_exact")
OURS = ("hf_mhce_ce", "hf_mhce_ce_lean", "hf_mhce_ce_fast", "hf_mhce_mhce4", "hf_mhce_mhce4_fast", "hf_mhce_mhce8",
        "hf_mhce_ranks")
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


def _chunked_ce(x, w, labels, chunk=4096):
    from torch.utils.checkpoint import checkpoint

    def piece(xc, yc):
        return F.cross_entropy((xc @ w.T).float(), yc, ignore_index=-100, reduction="sum")

    total = sum(checkpoint(piece, x[i:i + chunk], labels[i:i + chunk], use_reentrant=False)
                for i in range(0, x.shape[0], chunk))
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
        # Dynamo's cache belongs to _chunked_ce's code object, shared by every shape of the run: each
        # shape adds two entries (with and without gradients), and past recompile_limit (8) it runs
        # the function eager, still timed as this row.  A fresh cache per shape stays under it.
        torch._dynamo.reset()
        return torch.compile(_chunked_ce, dynamic=False), False
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
    if name == "hf_mhce_ranks":  # what RBECallback does in evaluation: ranks from the same sweep
        from hf_mhce.losses import collect_ranks
        from hf_mhce.rbe.stats import RBEStats

        def ranked(x, w, y):
            ranked.stats = RBEStats(w.shape[0], device=x.device)  # run_shape checks that every token was ranked
            with collect_ranks(ranked.stats.add):
                return hf_mhce.linear_cross_entropy(x, w, y, backend="triton")
        return ranked, True
    raise ValueError(f"unknown variant {name!r}")


def inputs(n, d, v, device, dtype, rotate, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    sets = []
    for _ in range(rotate):
        x = (torch.randn(n, d, generator=g) / d ** 0.25).to(device, dtype)
        y = torch.randint(0, v, (n,), generator=g)
        y[torch.rand(n, generator=g) < 0.05] = -100
        sets.append((x, y.to(device)))
    w = (torch.randn(v, d, generator=g) / d ** 0.25).to(device, dtype)
    return w, sets


def _flush_buffer(device) -> torch.Tensor:
    """Zeroed before each timed run on CUDA: evicts L2 (50-60 MB on Hopper), as do_bench's buffer does."""
    return torch.empty(256 * 2**20, dtype=torch.int8, device=device)


class Timer:
    """Median milliseconds of fn(): CUDA events around each run (L2 flushed before it), perf_counter elsewhere."""

    def __init__(self, device, reps):
        self.device, self.reps = device, reps

    def __call__(self, fn) -> float:
        if self.device.type == "cuda":
            return self._cuda(fn)
        fn()
        times = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
        return statistics.median(times)

    def _cuda(self, fn) -> float:
        """do_bench's method (warm-up, L2 flushed, events; 100 ms of runs) with at least ``reps`` runs:
        do_bench times rep / estimate runs, one alone where a run takes over 100 ms (the P6 shapes),
        after five runs for its estimate; one run gives the estimate here."""
        fn()  # compilation and autotuning
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        estimate = max(1000 * (time.perf_counter() - t0), 1e-3)
        flush = _flush_buffer(self.device)
        for _ in range(max(1, int(25 / estimate))):
            fn()
        runs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(max(self.reps, min(int(max(100, 20 * self.reps) / estimate), 10_000)))]
        for start, end in runs:
            flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in runs)


COMPUTE_BOUND_K = 4096


def matmul_rate(n, d, v, device, dtype, timer) -> float:
    """FLOP/s of [N, K] x [K, V] products, the unit of the floor: the faster of K = D and K = 4096.

    At a narrow D (GPT-2's 768) the plain product is bound by writing its [N, V] output, which the
    fused losses never write: its rate put the GPT-2 floor below what torch.compile attained (0.33x
    "floor" on the H100, 2026-11-24).  At K = 4096 the same output costs a sixth as much per FLOP."""
    rates = []
    for k in dict.fromkeys((d, max(d, COMPUTE_BOUND_K))):
        a = torch.randn(n, k, device=device, dtype=dtype)
        b = torch.randn(v, k, device=device, dtype=dtype)
        ms = timer(lambda: a @ b.T)
        rates.append(2 * n * k * v / (ms / 1000))
    return max(rates)


def heads_of(name: str) -> int:
    """The number of MHCE heads a variant's loss has (1: cross-entropy)."""
    return int(name.removeprefix("hf_mhce_mhce").removesuffix("_fast")) if name.startswith("hf_mhce_mhce") else 1


def reference(x, w, labels, heads):
    """Loss, dX, dW of the mean (multi-head) CE in float32 (hf_mhce's chunked torch path on float32 copies)."""
    import hf_mhce

    xr, wr = (t.detach().float().requires_grad_() for t in (x, w))
    loss = hf_mhce.multi_head_cross_entropy(xr, wr, labels, heads, backend="torch")
    loss.backward()
    return loss.item(), xr.grad, wr.grad


def grad_errors(fn, x, w, labels, ref) -> dict:
    """Relative L2 errors of a variant's dX and dW against the float32 references."""
    xv, wv = (t.detach().clone().requires_grad_() for t in (x, w))
    fn(xv, wv, labels).backward()
    out = {}
    for key, got, want in (("dx_rel_err", xv.grad, ref[0]), ("dw_rel_err", wv.grad, ref[1])):
        out[key] = float((got.float() - want).norm() / want.norm())
    return out


def measure(fn, forward_only, w, sets, timer, device) -> dict:
    it = iter(range(1 << 62))

    def pick():
        return sets[next(it) % len(sets)]

    def fwd():  # evaluation: no leaf wants a gradient (Liger computes them in its forward when one does)
        x, y = pick()
        with torch.no_grad():
            fn(x.detach(), w.detach(), y)

    def fwd_bwd():  # fresh leaves: the shared inputs never turn into ones that want gradients
        x, y = pick()
        fn(x.detach().requires_grad_(), w.detach().requires_grad_(), y).backward()

    row = {"fwd_ms": timer(fwd)}
    if not forward_only:
        row["fwd_bwd_ms"] = timer(fwd_bwd)
        row["bwd_ms"] = max(row["fwd_bwd_ms"] - row["fwd_ms"], 0.0)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd_bwd()
            torch.cuda.synchronize()
            row["peak_extra_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return row


def run_shape(label, d, v, n, variants, device, dtype, reps, rotate) -> list[dict]:
    timer = Timer(device, reps)
    rate = matmul_rate(n, d, v, device, dtype, timer)
    w, sets = inputs(n, d, v, device, dtype, rotate)
    elem = torch.finfo(dtype).bits // 8
    floor = {"fwd_ms": 1000 * 2 * n * d * v / rate, "fwd_bwd_ms": 1000 * 6 * n * d * v / rate,
             "lower_bound_mb": 2 * (n * d + v * d) * elem / 2**20}  # X, W, dX, dW
    rows = []
    x0, y0 = sets[0]
    references = {}  # per number of heads: a fast wrong answer is no result
    for name in variants:
        row = {"shape": label, "D": d, "V": v, "N": n, "variant": name, **{f"floor_{k}": x for k, x in floor.items()}}
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
                if not forward_only:
                    row.update(grad_errors(fn, x0, w, y0, ref_grads))
                row.update(measure(fn, forward_only, w, sets, timer, device))
                row["vs_floor"] = row.get("fwd_bwd_ms", row["fwd_ms"]) / floor["fwd_bwd_ms" if "fwd_bwd_ms" in row else "fwd_ms"]
                if "peak_extra_mb" in row:
                    # inputs X, W are allocated before; the bound on what the step adds is dX + dW
                    row["mem_vs_bound"] = row["peak_extra_mb"] / (floor["lower_bound_mb"] / 2)
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


def markdown(rows: list[dict], device_name: str, today: str) -> str:
    try:  # which call cce_exact is depends on CCE's release
        call = ", ".join(f"{k}={v!r}" for k, v in cce_options("cce_exact").items())
        exact = f" cce_exact called linear_cross_entropy(x, w, labels, {call})."
    except ImportError:
        exact = ""
    lines = [f"# Fused cross-entropy vs peers on {device_name} ({today})", "", f"Versions: {versions()}.{exact}", "",
             "Times in ms (median); floor = 6NDV (fwd+bwd) or 2NDV (fwd) FLOPs at the matmul rate measured in the "
             "same run; fwd = an evaluation forward (no gradients), bwd = fwd+bwd - fwd; x hf_mhce_ce: fwd+bwd, or fwd for "
             "forward-only rows; memory = peak allocated above the inputs vs dX + dW; loss / dX / dW err = relative difference from "
             "the float32 reference of the row's own loss (cross-entropy; MHCE with H heads for the MHCE rows).", ""]
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
            lines.append(f"| {r['variant']} | {f('fwd_ms')} | {f('bwd_ms')} | {f('fwd_bwd_ms')} | {f('vs_floor')} | "
                         f"{f('peak_extra_mb', '.0f')} | {f('mem_vs_bound')} | {rel} | {f('loss_rel_err', '.1e')} | "
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
            rows += run_shape(label, d, v, n, args.variants, device, dtype, args.reps, args.rotate)
            # rewritten after every shape: a run cut short by the device's time limit keeps what it measured
            record.write(rows, markdown(rows, name, today))
    return rows


if __name__ == "__main__":
    main()
