"""Pieces shared by the Triton sweeps: the logits tile of one head and the launch settings.

A tile is y[rows, cols] = softcap(X[rows, head cols] @ W[cols, head cols]^T + b[cols]) for one
head (a contiguous slice of D of width Dh), accumulated in float32, plus an optional rank-R term
(LoRA on the head).  Offsets are 64-bit so that
N * V and V * D beyond 2^31 are addressed correctly.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .budget import interpreting

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# Whether the kernels run through Triton's interpreter: triton.jit decides when a kernel is defined, from
# TRITON_INTERPRET as it is then (this module is imported first by every kernel module), and setting it
# later switches nothing -- the compiled kernels would then fail on CPU tensors ("0 active drivers").
KERNELS_INTERPRETED = interpreting()


def dot_settings(dtype: torch.dtype) -> dict:
    """Constexprs for ``dot``: exact fp32 products for fp32 inputs (no TF32), native otherwise; and
    FMA contraction (``enable_fp_fusion``) stated rather than left to Triton's default, which 3.9
    warns will flip to off in 3.10 and would change the kernels' rounding with the Triton version.

    Under the interpreter, ``dot`` sums float32 products in k order instead of calling numpy's
    matmul: numpy has no bfloat16 (upcasting is exact), and its BLAS rounds an entry differently
    depending on where it sits in the tile, so a row of W equal to the target's would not tie with
    it as it does on the GPU, where every entry of a tile goes through the same instructions.
    """
    return {
        "DOT_IN_ORDER": interpreting(),
        "PRECISION": "ieee" if dtype == torch.float32 else None,
        "enable_fp_fusion": True,  # a compile option; the interpreter drops it
    }


# Launch settings per kernel ("forward", "backward", "ranks").  SPLITS (forward, ranks): vocabulary splits
# per token block, None = enough programs to fill the device twice.  GROUP_N (backward): token blocks per
# group in the tile order, so that the programs running at once read a few X and W rows (L2).  "ranks"
# compares its tiles' logits with the target logits formed with "forward"'s tiles: keep BLOCK_K and
# num_warps equal so that both accumulate in the same order (exact ties; see target_logits_tile).
_GPU_DEFAULTS = {
    "forward": {"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_K": 64, "SPLITS": None},
    # the dY slab kernel: GPU timings owed (tile_sweep.py).  Compiled as launches specialize, 128 x 128 and
    # 64 x 256 at 8 warps do not spill either (compile-check-2026-11-24-sweep.md), so the sweep decides
    "backward": {"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_K": 32, "GROUP_N": 8},
    "ranks": {"BLOCK_N": 64, "BLOCK_V": 64, "BLOCK_K": 64, "SPLITS": None},  # at H=4 neither 64 nor 128 spills: the GPU decides
}
# float32 inputs take exact FMA products (no tensor cores), whose operands sit in registers: for sm_80
# ptxas spills 1 KB per thread in the forward at BLOCK_K 64, 12-20 bytes at 16-32, none on sm_90a
# (compile-check-2026-11-24-sweep.md).  Same BLOCK_K for the three kernels, as the ranks' ties require.
_GPU_FLOAT32 = {"BLOCK_K": 16}
# Hopper (sm_90), 16-bit: the H100 sweep's fastest forward, 29.4 ms against 50.7 for the default tiles at
# Llama-3-8B's head and N = 16384 (tile_sweep-NVIDIA-H100-80GB-HBM3-2026-11-24-budget-s_240.md, Triton 3.6).
# Hopper only: the sweep that chose them ran on an H100 (for sm_80 they also spill, compile_check.py).
# BLOCK_K and num_warps stay those of the ranks kernel.
_HOPPER_16BIT = {"forward": {"BLOCK_N": 128, "BLOCK_V": 256, "num_stages": 4}}
_INTERPRETER = {"BLOCK_N": 16, "BLOCK_V": 32, "BLOCK_K": 16, "num_warps": 1, "SPLITS": 1, "GROUP_N": 2}
_overrides: dict[str, dict] = {}


def launch_config(kernel: str, dtype: torch.dtype, device: torch.device | None = None) -> dict:
    """Tile sizes and launch options of ``kernel`` for tensors of ``dtype`` on ``device``.  Small under
    the interpreter (speed of the CPU tests); the GPU defaults otherwise (Hopper's where it has its
    own); either replaced key by key inside ``override_tiles``."""
    if interpreting():
        cfg = {k: v for k, v in _INTERPRETER.items() if k in _GPU_DEFAULTS[kernel] or k == "num_warps"}
    else:
        # 8 warps whatever the head width: at 4, 128 x 256 tiles spill and run 7x slower (H100 sweep)
        cfg = {**_GPU_DEFAULTS[kernel], "num_warps": 8}
        if dtype == torch.float32:
            cfg.update(_GPU_FLOAT32)
        elif device is not None and device.type == "cuda" and _is_hopper(device):
            cfg.update(_HOPPER_16BIT.get(kernel, {}))
    cfg.update(_overrides.get(kernel, {}))
    return cfg


def vocab_splits(n_programs: int, v_blocks: int, device: torch.device, requested: int | None) -> int:
    """Vocabulary splits per token block: ``requested``, else enough programs for two per SM."""
    if requested is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        requested = -(-2 * sms // max(1, n_programs))  # an empty batch (N = 0) launches nothing
    return max(1, min(int(requested), v_blocks))


def vocab_grid(n: int, v: int, block_n: int, block_v: int, device: torch.device, requested: int | None,
               heads: int = 1) -> tuple[int, int, int]:
    """(token blocks, vocabulary splits, columns per split) of a sweep over [n, v] with ``heads`` programs
    per tile; every split holds at least one column, so each writes its partial results."""
    n_blocks, v_blocks = triton.cdiv(n, block_n), triton.cdiv(v, block_v)
    splits = vocab_splits(n_blocks * heads, v_blocks, device, requested)
    per_split = triton.cdiv(v_blocks, splits) * block_v
    return n_blocks, triton.cdiv(v, per_split), per_split


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _is_hopper(device: torch.device) -> bool:
    """sm_90 (H100, H200).  Not ROCm: an MI300 also reports major version 9 (gfx94x), with less shared
    memory per CU than these tiles' four stages take."""
    return torch.version.hip is None and _capability(device)[0] == 9


@contextlib.contextmanager
def override_tiles(kernel: str, **settings):
    """Replace launch settings of ``kernel`` (tile sweeps and tests; not thread-safe).

    Keys: BLOCK_N, BLOCK_V, BLOCK_K (powers of two >= 16), num_warps, num_stages, SPLITS
    (forward, ranks), GROUP_N (backward).
    """
    if kernel not in _GPU_DEFAULTS:
        raise ValueError(f"unknown kernel {kernel!r}; one of {sorted(_GPU_DEFAULTS)}")
    allowed = set(_GPU_DEFAULTS[kernel]) | {"num_warps", "num_stages"}
    unknown = sorted(set(settings) - allowed)
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown} for the {kernel} kernel; allowed: {sorted(allowed)}")
    previous = _overrides.get(kernel)
    _overrides[kernel] = {**(previous or {}), **settings}
    try:
        yield
    finally:
        if previous is None:
            _overrides.pop(kernel, None)
        else:
            _overrides[kernel] = previous


@triton.jit
def dot(a, b, acc, DOT_IN_ORDER: tl.constexpr, PRECISION: tl.constexpr):
    if DOT_IN_ORDER:  # interpreter only (see dot_settings): the same rounding at every tile position
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def tanh_parts(u):
    """(tanh(u), its derivative 1 - tanh(u)^2), each to a few float32 ulps for every u.

    Both from q = 1 - tanh|u| = 2 / (e^2|u| + 1), exact to its own size: tanh = sign(u) (1 - q) rounds once
    for either sign (1 - 2 / (e^2u + 1) of a negative u kept only the ulp of q ~ 2), and 1 - tanh^2 = q (2 - q)
    does not cancel where |tanh| -> 1 (from a rounded tanh it had 1e-7 / (1 - |tanh|) relative error).
    Below |u| = 1/4, where 1 - q cancels, tanh's Taylor series to u^9 (next term < 1e-9 relative): the
    exp form kept about |u| of float32's precision there (a softcap of 1e5 put the logits 1e-2 off).
    """
    q = 2.0 / (tl.exp(2.0 * tl.abs(u)) + 1.0)
    u2 = u * u
    series = u * (1.0 + u2 * (-1.0 / 3.0 + u2 * (2.0 / 15.0 + u2 * (-17.0 / 315.0 + u2 * (62.0 / 2835.0)))))
    t = tl.where(tl.abs(u) < 0.25, series, tl.where(u < 0, q - 1.0, 1.0 - q))
    return t, q * (2.0 - q)


@triton.jit
def softcap_and_slope(z, softcap):
    """(c tanh(z / c), its derivative 1 - tanh(z / c)^2): the dY kernels' softcap."""
    t, slope = tanh_parts(z / softcap)
    return softcap * t, slope


@triton.jit
def softcap_fn(z, softcap):
    """c * tanh(z / c), rounded as ``softcap_and_slope`` rounds it."""
    y, _ = softcap_and_slope(z, softcap)
    return y


@triton.jit
def add_tile(y, m, rest):
    """(m, rest) [BLOCK_N] after the logits tile y [BLOCK_N, BLOCK_V]: the running maximum m and rest =
    sum exp(y - m) - 1, the sum without the maximum's own 1 (-1 for an empty sum).

    A sum holding that 1 rounds each later tile's share of 1 - p_t to an ulp of 1: all of a confident
    token's loss at a large vocabulary (NOTES change 13).  Where the tile holds a new maximum, one entry
    equal to it becomes the implicit 1 (further ties add theirs) and the old sum 1 + rest is rescaled.
    The base is 0 while every entry so far is -inf (a masked vocabulary, e.g. a -inf bias, can fill whole
    tiles and splits): exp(-inf - -inf) would be NaN, exp(-inf - 0) is 0, and no entry equals 0 then.
    """
    tile_max = tl.max(y, axis=1)
    m_new = tl.maximum(m, tile_max)
    base = tl.where(m_new == float("-inf"), 0.0, m_new)
    below = tl.sum(tl.where(y == base[:, None], 0.0, tl.exp(y - base[:, None])), axis=1)  # NaN stays in
    # entries at the maximum, counted in int32 (a float32 count took 44 more spill bytes on Hopper's tiles)
    ties = tl.sum((y >= base[:, None]).to(tl.int32), axis=1).to(tl.float32)
    scale = tl.exp(m - base)
    carried = tl.where(tile_max > m, scale + rest * scale + (ties - 1.0), rest + ties)
    return m_new, carried + below


@triton.jit
def at_labels(labels, v0, BLOCK_V: tl.constexpr):
    """[BLOCK_N, BLOCK_V] bools: the tile's column v0 + j is the row's label.  In 32 bits, the label's offset
    in the tile against the tile's own column numbers (int64 columns cost two instructions and two registers
    an entry: NOTES change 16)."""
    return tl.arange(0, BLOCK_V)[None, :] == (labels - v0).to(tl.int32)[:, None]


def log_sum_from_rest_(top, rest):
    """log sum exp(y - top) from rest = that sum - 1 (``add_tile``), in place: log1p(rest), and NaN where the
    maximum is +inf, as eager's log_softmax and the torch sweep give (inf - inf).  The tiles count +inf
    entries as ties of a finite sum, which would make a diverged row's loss look finite."""
    return rest.log1p_().masked_fill_(top == float("inf"), float("nan"))


@triton.jit
def logits_tile(
    X, W, B, U, LB, rows, cols, row_mask, col_mask, col0, Dh, u_col0, R,
    stride_x, stride_w, stride_u, stride_lb, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_LOW_RANK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_IN_ORDER: tl.constexpr, PRECISION: tl.constexpr,
):
    """Float32 logits tile [BLOCK_N, BLOCK_V] of one head (softcap applied when enabled).

    With HAS_LOW_RANK the rank-R term U[rows, u_col0:u_col0+R] @ LB[cols, :R]^T is added in the
    same accumulator (a LoRA adapter on the head; see ``torch_sweep``).
    """
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, Dh, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < Dh
        x = tl.load(X + rows[:, None] * stride_x + (col0 + ks)[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(W + cols[:, None] * stride_w + (col0 + ks)[None, :],
                    mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc = dot(x, tl.trans(w), acc, DOT_IN_ORDER, PRECISION)
    if HAS_LOW_RANK:
        for r0 in range(0, R, BLOCK_K):
            rs = r0 + tl.arange(0, BLOCK_K)
            r_mask = rs < R
            u = tl.load(U + rows[:, None] * stride_u + (u_col0 + rs)[None, :],
                        mask=row_mask[:, None] & r_mask[None, :], other=0.0)
            b = tl.load(LB + cols[:, None] * stride_lb + rs[None, :],
                        mask=col_mask[:, None] & r_mask[None, :], other=0.0)
            acc = dot(u, tl.trans(b), acc, DOT_IN_ORDER, PRECISION)
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_SOFTCAP:
        acc = softcap_fn(acc, softcap)
    return acc


@triton.jit
def target_logits_tile(
    X, W, B, U, LB, Labels, N, row0, rows, row_mask, col0, Dh, u_col0, R,
    stride_x, stride_w, stride_u, stride_lb, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_LOW_RANK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_IN_ORDER: tl.constexpr, PRECISION: tl.constexpr,
):
    """Float32 target logit [BLOCK_N] of each row (0 where its label is -1), read off the diagonal
    of ``logits_tile`` tiles whose columns are the block's own targets.

    Same function, shapes and accumulation order as the sweep's tiles, so a row of W equal to the
    target's gives exactly the target's logit (a tie, as in one full logits matmul); a separate
    dot product rounds differently and ranked such rows above the target about half the time.
    Costs ceil(BLOCK_N / BLOCK_V) tiles, against V / BLOCK_V for the sweep.
    """
    t = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c0 in tl.static_range(0, BLOCK_N, BLOCK_V):
        slots = c0 + tl.arange(0, BLOCK_V)  # which rows of the block these columns serve
        src = row0 + slots
        cols = tl.load(Labels + src, mask=(slots < BLOCK_N) & (src < N), other=-1)
        col_valid = cols >= 0
        cols = tl.where(col_valid, cols, 0)  # ignored tokens gather nothing (their row would be out of bounds)
        y = logits_tile(X, W, B, U, LB, rows, cols, row_mask, col_valid, col0, Dh, u_col0, R,
                        stride_x, stride_w, stride_u, stride_lb, softcap, HAS_BIAS, HAS_SOFTCAP,
                        HAS_LOW_RANK, BLOCK_N, BLOCK_V, BLOCK_K, DOT_IN_ORDER, PRECISION)
        diagonal = (tl.arange(0, BLOCK_N)[:, None] == slots[None, :]) & col_valid[None, :]
        t += tl.sum(tl.where(diagonal, y, 0.0), axis=1)
    return t


def low_rank_args(low_rank, fallback: torch.Tensor) -> tuple:
    """Kernel arguments (U, LB, R, stride_u, stride_lb) of an optional (U [N, H, R], B [V, R]) pair;
    placeholders (never read: HAS_LOW_RANK is false) without one."""
    if low_rank is None:
        return fallback, fallback, 0, 0, 0
    u, b = low_rank
    return u, b, b.shape[1], u.stride(0), b.stride(0)  # both contiguous: U row h*R + r, B row r
