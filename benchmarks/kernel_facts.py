"""Static facts of a compiled kernel, from ptxas's numbers and the cubin's SASS (compile_check.py): how many
blocks an SM keeps resident, and where the instructions sit (the K loop, once per tile).  No GPU, no Triton."""

from __future__ import annotations

import re

# Per SM (CUDA occupancy calculator, compute capability 8.0 and 9.0): shared memory (bytes), of which 1 KB is
# reserved per resident block; 64K registers in four sub-partitions, each warp's share rounded up to 256; 64 warps.
SM_SHARED = {"sm_90a": 233472, "sm_80": 167936}
RESERVED_SHARED, SUBPARTITION_REGISTERS, REGISTER_UNIT, MAX_WARPS, MAX_BLOCKS = 1024, 16384, 256, 64, 32


def resident_blocks(registers: int, num_warps: int, shared_bytes: int, arch: str) -> tuple[int, str]:
    """(blocks of this launch resident per SM, the resource that limits them): static occupancy.  A kernel
    that crosses a limit (ranks take the forward at 64 x 128, 8 warps, from 107 to 149 registers, Triton 3.9)
    keeps half the warps per SM resident to hide its loads and MMAs, which its SASS count does not show."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    limits = {"registers": 4 * (SUBPARTITION_REGISTERS // per_warp) // num_warps,
              "shared memory": SM_SHARED[arch] // (shared_bytes + RESERVED_SHARED),
              "warps": MAX_WARPS // num_warps, "blocks": MAX_BLOCKS}
    least = min(limits.values())
    return least, "/".join(name for name, n in limits.items() if n == least)


def sass_counts(sass: str | None) -> dict:
    """Static SASS instructions: all of them, those of the innermost loop that holds an MMA (the K loop,
    run D / BLOCK_K times per tile) and those of the loop around it outside the K loop (once per tile:
    the statistics of a logits tile; for a kernel of one tile per program, all of it outside the K loop).  Per
    warp, a tile costs about k_loop * D / BLOCK_K + per_tile issue slots (branches inside either aside)."""
    if sass is None:
        return {"sass_instructions": None}
    code = [(int(a, 16), op) for a, op in re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass, re.M)]
    loops = []  # (first, last) address of every backward branch's span
    for address, op in code:
        target = re.search(r"\bBRA\s+(0x[0-9a-f]+)", op)
        if target and int(target.group(1), 16) < address:
            loops.append((int(target.group(1), 16), address))

    def size(first, last):
        return sum(first <= a <= last and not op.startswith("NOP") for a, op in code)

    mma = [a for a, op in code if re.search(r"\b(HGMMA|HMMA)\b", op)]
    inner = min((span for span in loops if any(span[0] <= a <= span[1] for a in mma)), key=lambda s: s[1] - s[0],
                default=None)
    outer = None if inner is None else min((s for s in loops if s[0] <= inner[0] and inner[1] <= s[1] and s != inner),
                                           key=lambda s: s[1] - s[0], default=None)
    if inner is None:  # a row pass: no matmul
        return {"sass_instructions": len(code), "k_loop_instructions": None, "per_tile_instructions": None}
    whole = outer or (code[0][0], code[-1][0])  # one tile per program: all the rest is that tile's
    return {"sass_instructions": len(code), "k_loop_instructions": size(*inner),
            "per_tile_instructions": size(*whole) - size(*inner)}
