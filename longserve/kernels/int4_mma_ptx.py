"""The PTX of int4_mma_gemv.py's kernel (inline asm, one `mma.sync.m16n8k16` per 16 x 16 block) and the lane layout
it is written for; int4_mma_reference.py runs the same strings on the CPU (ptx_reference.run_ptx).

The mapping (PTX ISA, mma.m16n8k16 .bf16: lane = 4 g + t; A rows g, g + 8, B column g, C rows g, g + 8 and
columns 2t, 2t + 1):
- A = 16 weight rows (output columns) x 16 k, B = 16 k x 8 activation rows (tokens; those past M repeat row M - 1
  and are never stored), so C holds 16 output columns x 8 tokens; 9 to 16 rows take a second B and C (TOKEN_TILES
  2) on the same A (ptxas keeps one unpacking: 1.81 instructions a weight for 16 tokens, 186 registers). A warp's
  tile is 16 consecutive output columns: lane (g, t) reads the words 4t .. 4t + 3 of a 128-k step (one 16-byte
  load) of columns g (A's row g) and g + 8 (row g + 8).
- `((word >> 4i) & 0x000F000F) | 0x43004300` is one bf16 pair, 128 + q[8j + i] (low) and 128 + q[8j + i + 4]
  (high), exact. The k order inside an mma is free as long as A and B agree: A's register pair (k 2t, 2t + 1)
  is the pair i = 2s of word j, (k 2t + 8, 2t + 9) the pair 2s + 1, over s = 0, 1 (two mmas a word). B's must
  then be (x[8j + i], x[8j + i + 4]): one `prmt` each from x's natural pairs, once a step for every column.
- 128 + q instead of q - z keeps the unpacking at one LOP3 (and a shift) per pair: sum (q - z) x = sum (128 + q) x
  - (128 + z) sum x, where sum x over the step comes from one more mma chain with A = 1.0 (per token, shared by
  every column). The scale multiplies the step's sums: a step lies in one group.
- C's fp32 sums, scaled and summed over the steps, are a lane's 4 registers: columns g and g + 8 of the tile, tokens
  2t and 2t + 1. The inline asm runs on 4 consecutive elements of a thread (pack 4): the 4 words u of a load, and
  for C its 4 registers; the tensors are [REPS, 8 * warps, 4, 4] in one BlockedLayout whose lanes are (g, t).
"""

from __future__ import annotations

import triton
from triton.experimental.gluon import language as gl

__all__ = [
    "PRMT_HI",
    "PRMT_LO",
    "STEP_ASM",
    "STEP_CONSTRAINTS",
    "SUMS_ASM",
    "SUMS_CONSTRAINTS",
    "lane_layout",
]

_PAIR_MASK, _BF16_128, _AND_OR = "0x000F000F", "0x43004300", "0xEA"  # lop3 LUT 0xEA: (a & b) | c
_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


def _pair(reg: str, word: int, i: int) -> str:
    """PTX: bf16 pair i of word operand $word into `reg`: 128 + q[8j + i] (low), 128 + q[8j + i + 4] (high)."""
    if i == 0:
        return f"lop3.b32 {reg}, ${word}, {_PAIR_MASK}, {_BF16_128}, {_AND_OR};"
    return f"shr.u32 w, ${word}, {4 * i}; lop3.b32 {reg}, w, {_PAIR_MASK}, {_BF16_128}, {_AND_OR};"


def _steps_asm() -> str:
    """One 128-k step of a 16-column tile for a lane, pack 4: out $0-$3 (C: columns g, g + 8 x tokens 2t, 2t + 1),
    in: C $4-$7, words of column g $8-$11 and of column g + 8 $12-$15 (u = 0..3), then B's pairs X_0..X_3 of each
    word, X_i[u] = $(16 + 4 i + u). Eight mmas chained in C."""
    lines = ["{", ".reg .b32 a0, a1, a2, a3, w;"]
    for u in range(4):
        for s in range(2):
            for reg, (word, i) in enumerate(((8, 2 * s), (12, 2 * s), (8, 2 * s + 1), (12, 2 * s + 1))):
                lines.append(_pair(f"a{reg}", word + u, i))
            c_in = "$4, $5, $6, $7" if u == s == 0 else "$0, $1, $2, $3"
            b = f"${16 + 8 * s + u}, ${16 + 8 * s + 4 + u}"  # X_{2s}[u], X_{2s+1}[u]
            lines.append(f"{_MMA} {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{{b}}}, {{{c_in}}};")
    return "\n".join([*lines, "}"])


def _sums_asm() -> str:
    """sum x over a step per token (A = 1.0), pack 4: out $0-$3, in C $4-$7, X_0..X_3 as in _steps_asm from $8."""
    lines = ["{", ".reg .b32 one;", "mov.b32 one, 0x3F803F80;"]
    for u in range(4):
        for s in range(2):
            c_in = "$4, $5, $6, $7" if u == s == 0 else "$0, $1, $2, $3"
            b = f"${8 + 8 * s + u}, ${8 + 8 * s + 4 + u}"
            lines.append(f"{_MMA} {{$0, $1, $2, $3}}, {{one, one, one, one}}, {{{b}}}, {{{c_in}}};")
    return "\n".join([*lines, "}"])


STEP_ASM = gl.constexpr(_steps_asm())
STEP_CONSTRAINTS = gl.constexpr(",".join(["=&f"] * 4 + ["f"] * 4 + ["r"] * 24))
SUMS_ASM = gl.constexpr(_sums_asm())
SUMS_CONSTRAINTS = gl.constexpr(",".join(["=&f"] * 4 + ["f"] * 4 + ["r"] * 16))
PRMT_LO = gl.constexpr("prmt.b32 $0, $1, $2, 0x5410;")  # (a.lo, b.lo)
PRMT_HI = gl.constexpr("prmt.b32 $0, $1, $2, 0x7632;")  # (a.hi, b.hi)


@triton.constexpr_function
def lane_layout(reps, warps):
    """The layout the asm is written for, as registers, lanes and warps: a thread's registers u (the pack of 4) then
    r, lane = 4 g + t, warp w holding rows 8w .. 8w + 7 (the kernel asserts its BlockedLayout is this)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2]] + [[1 << i, 0, 0, 0] for i in range(reps.bit_length() - 1)],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
        warp_bases=[[0, 8 << i, 0, 0] for i in range(warps.bit_length() - 1)],
        block_bases=[],
        shape=[reps, 8 * warps, 4, 4],
    )
