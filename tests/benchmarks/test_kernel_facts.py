"""kernel_facts: blocks resident per SM (the CUDA occupancy calculator's rules for sm_80 / sm_90) and where a
kernel's SASS instructions sit (compile_check.py's columns), on known cases and synthetic SASS."""

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from kernel_facts import resident_blocks, sass_counts  # noqa: E402


def test_resident_blocks_of_the_h100_sweep_tiles():
    # the forward at 64 x 128 x 64, 8 warps, 3 stages: 112 registers on the H100, two blocks; with the first
    # run's ranks 184 registers, one (65536 registers in four sub-partitions of 16384, 256 a warp's unit)
    assert resident_blocks(112, 8, 73728, "sm_90a") == (2, "registers")
    assert resident_blocks(184, 8, 73728, "sm_90a") == (1, "registers")
    assert resident_blocks(128, 8, 0, "sm_90a") == (2, "registers")  # 4096 a warp: exactly four per sub-partition
    assert resident_blocks(129, 8, 0, "sm_90a") == (1, "registers")  # 4352: three
    # Hopper's tile: 247 registers and 192 KB of stages, one block by either
    assert resident_blocks(247, 8, 196608, "sm_90a") == (1, "registers/shared memory")
    # 64 x 128 x 64, 4 warps, 4 stages: registers allow three blocks, 96 KB of stages (+1 KB each) two
    assert resident_blocks(162, 4, 98304, "sm_90a") == (2, "shared memory")
    assert resident_blocks(162, 4, 98304, "sm_80") == (1, "shared memory")  # an A100's 164 KB
    assert resident_blocks(32, 8, 64, "sm_90a") == (8, "registers/warps")  # 64 warps an SM
    assert resident_blocks(16, 1, 0, "sm_90a") == (32, "blocks")


def sass(*lines):
    """cuobjdump -sass's layout: address comment, instruction, encoding comment."""
    body = "\n".join(f"        /*{16 * i:04x}*/                   {op} ;       /* 0x000000000000000000000000000000 */"
                     for i, op in enumerate(lines))
    return "\tcode for sm_90a\n" + body + "\n"


def test_sass_counts_finds_the_k_loop_and_the_tile_loop():
    code = sass("MOV R1, c[0x0][0x28]",            # 0x00
                "S2R R0, SR_CTAID.X",               # 0x10: tile loop from here
                "LDGSTS [R2], [R4.64]",             # 0x20: K loop from here
                "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ",
                "NOP",
                "IADD3 R5, R5, 0x1, RZ",
                "@P0 BRA 0x20",                     # 0x60: end of the K loop (5 instructions, the NOP aside)
                "FMNMX R7, R24, R25, !PT",
                "MUFU.EX2 R8, R7",
                "@P1 BRA 0x10",                     # 0x90: end of the tile loop
                "STG.E [R2.64], R8",
                "EXIT",
                "BRA 0xb0")                         # 0xc0: the trailing self-loop cuobjdump shows (no MMA inside)
    assert sass_counts(code) == {"sass_instructions": 13, "k_loop_instructions": 4, "per_tile_instructions": 4}


def test_sass_counts_of_one_tile_per_program_and_of_a_row_pass():
    one_tile = sass("MOV R1, c[0x0][0x28]", "HMMA.16816.F32.BF16 R8, R12, R16, R8", "@P0 BRA 0x10", "STG.E [R2.64], R8",
                    "EXIT")
    assert sass_counts(one_tile) == {"sass_instructions": 5, "k_loop_instructions": 2, "per_tile_instructions": 3}
    row_pass = sass("LDG.E R2, [R4.64]", "FADD R2, R2, 1", "@P0 BRA 0x0", "EXIT")
    assert sass_counts(row_pass) == {"sass_instructions": 4, "k_loop_instructions": None, "per_tile_instructions": None}
    assert sass_counts(None) == {"sass_instructions": None}
