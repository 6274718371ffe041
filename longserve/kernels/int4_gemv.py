"""The int4 decode GEMV's fast path: y = x @ dequantize(w)^T for 4-bit weights in the layout of `quant_reference`
with groups that hold whole tiles (no act order), at one token (decode at batch 1) on the CUDA cores. Same
contract as `quant_reference.wna16_gemm_ref`; `quant_gemv.wna16_gemv` routes here when it applies
(`int4_fast_supported`), else its general kernel serves.

Why: measured on an H200 (2026-12-02, 95cf20e, benchmarks/RESULTS.md sixth session) the general kernel read the
Llama-3.1-8B gate_up weights (58.7 MB packed) in 42.2 us at M=1, 34% of 4.2 TB/s: issue-bound, at ~6.5
instructions per weight (its docstring): the nibbles unpacked byte by byte, joined and reshaped back into K
order (register shuffles), then 2^23 + q made a float and q - z subtracted before the product. Here:

- Weights are read as 32-bit words, 8 values each (element 8j + i of the row in bits 4i..4i+3 of word j:
  little-endian bytes, low nibble first). For i in 0..3, `((word >> 4i) & 0x000F000F) | 0x43004300` holds two
  bf16 values, 128 + q[8j + i] (low half) and 128 + q[8j + i + 4] (high half); a bf16 widens to fp32 by its bits
  alone, so the high half is `t & 0xFFFF0000` and the low one `t << 16`, bitcast. Two integer operations per
  value (the shift, the and-or: one LOP3; the widening), no conversion instruction, no reordering: each of the
  eight values of a word meets activation column 8j + i, loaded as its own strided vector.
- The zero point comes out of the inner loop: sum_k (q_k - z) x_k = sum_k (128 + q_k) x_k - (128 + z) sum_k x_k,
  so a value costs one FMA, and the tile's sum of x (the same for every row) one subtraction per row and tile.
  The scale multiplies the tile's sum, as in the general kernel (a tile lies within one group).
- Products accumulate element-wise in a [BLOCK_N, BLOCK_W] fp32 tile and reduce across threads once per tile.
- One activation row a program: rows beyond the first would each need their own product tile or a second
  unpacking (Triton keeps no lists of tiles), and the general kernel serves them. Routed (MoE decode,
  kernels/moe_wna16.py), grid axis 2 runs over (token, expert) pairs, each program the pair's token row times
  its expert's weights: the experts are stacked [E, N, K / 8] and each pair's are read once.

Rounding: the exact integers (128 + q, 128 + z) times the activations, summed in fp32; the cancellation of the
128 * sum(x) terms costs ~5 bits of fp32's 24 (|128 + q| <= 143 against |q - z| ~ 4 on average): ~2e-6
relative, far below one bf16 ulp. With 16-bit activations the high value of each pair is read unmasked
(INT4_GEMV_RAW_HI, below): ~2e-5 relative more, still far below one bf16 ulp of the output. Split-K and its
reduction are quant_gemv's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from longserve.kernels.launch import pdl_prologue, prefetch_l2
from longserve.kernels.quant_tiles import store_gemv_out

__all__ = [
    "int4_dot_tile",
    "int4_fast_block_n",
    "int4_fast_supported",
    "int4_gemv_kernel",
    "int4_tile_load",
    "int4_tile_scales",
]

_BF16_128 = tl.constexpr(0x43004300)  # two bf16 128.0: OR-ed with a nibble in each half, 128 + q
_LOW_NIBBLES = tl.constexpr(0x000F000F)
_HIGH_HALF = tl.constexpr(-65536)  # 0xFFFF0000 as int32
_LOW_BITS_AS_HIGH = tl.constexpr(17152 / 65536)  # the low bf16 128's bits (0x4300) read below the high one's

# The unmasked high value (RAW_HI in int4_gemv_kernel) for 16-bit activations; fp32 activations always take the
# exact loop. Measured on an H200 (RESULTS.md ninth session, gpu_check.sh raw-hi): the 8B int4 decode at batch 1
# (32K) 4.79 -> 4.62 ms, the A3B int4 decode at batch 8 (4K) 6.99 -> 6.71 ms (batch 1: 4.32 both); the one-row
# GEMV per 8B projection 9.8 / 9.3 / 32.1 / 18.5 -> 9.4 / 8.7 / 31.2 / 17.1 us (qkv / o / gate_up / down).
INT4_GEMV_RAW_HI = True
# K tiles int4_gemv_kernel asks L2 for before its PDL wait (launch.prefetch_l2; not routed: a routed program's expert
# is the router's output, so moe_wna16 passes none); 0: none. Only with PDL (quant_gemv passes 0 without). Why: at one
# row the 8B int4 projections run at ~35% of HBM's rate (76.8 us a layer against a 26.7 us floor, RESULTS.md
# twenty-fifth session), and HBM idles while the kernel before drains; the weights never depend on it. Not in the
# loop: a thread already holds 2 rows x 16 words of a tile in flight (64 KB an SM at 4 programs), the kernel is bound
# by its issue (3.76 instructions a weight), and its loop is at 128 registers (one more prefetch a tile spills 8 bytes
# with Triton 3.9). Off: measured on an H200 (twenty-sixth session, 0aed29a, `gpu_check.sh gemv-prefetch`, with
# int4_mma_gemv.PREFETCH alike) the 8B int4 decode at 2 lost, b1@32K 4.09 -> 4.15 ms, b16@8K 7.45 -> 7.54 (alone, with
# no kernel before to drain, the one-row projections are unchanged: 76.3 -> 76.5 us a layer).
INT4_GEMV_PREFETCH = 0


def int4_fast_supported(m: int, bits: int, k: int, per_col: bool, use_dot: bool, block_k: int) -> bool:
    """Whether the fast path takes a product the general kernel would run with this config: one row (decode at
    batch 1: the unpacked tile serves one activation row, so nothing is kept across rows), 4 bits, groups of
    whole tiles, the FMA path, K a multiple of the tile (no masks along K; whole words)."""
    return m == 1 and bits == 4 and not per_col and not use_dot and block_k % 8 == 0 and k % block_k == 0


def int4_fast_block_n(n: int, num_tiles: int, rows: int, sms: int) -> int:
    """int4_gemv_kernel's weight rows per program for `rows` output rows of N over num_tiles K tiles: up to 256
    (a thread then holds 8 rows of its 4 words, so the activations it loads, widens and sums serve 8 rows; sm90
    SASS of the loop, Triton 3.6: 4.4 instructions a weight against 6.1 at 64 rows; 118 registers, 4 programs an
    SM), fewer where the grid would not reach 2 programs an SM (32 KB of weights in flight each: enough for the
    bandwidth)."""
    block_n = 256
    while block_n > 64 and triton.cdiv(n, block_n) * rows * min(32, num_tiles // 2) < 2 * sms:
        block_n //= 2
    return block_n


@triton.jit
def int4_tile_scales(s_ptr, z_ptr, offs_n, n_mask, stride_sn, stride_zn, grp, HAS_ZP: tl.constexpr):
    """The tile's scale and 128 + zero point per weight row [BLOCK_N] (fp32; without zero points 128 + 8)."""
    s_row = tl.load(s_ptr + offs_n * stride_sn + grp, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_ZP:
        z = tl.load(z_ptr + offs_n * stride_zn + grp, mask=n_mask, other=0).to(tl.float32) + 128.0
    else:
        z = tl.full(s_row.shape, 136.0, tl.float32)  # 128 + 2^(4 - 1)
    return s_row, z


@triton.jit
def int4_tile_load(w_rows, s_ptr, z_ptr, offs_n, offs_w, valid, stride_sn, stride_zn, group_size, t,
                    BLOCK_K: tl.constexpr, HAS_ZP: tl.constexpr):  # fmt: skip
    """Tile t's packed words [BLOCK_N, BLOCK_K / 8] and its scales and 128 + zero points [BLOCK_N], rows where
    `valid`."""
    words = tl.load(w_rows + (t * (BLOCK_K // 8) + offs_w)[None, :], mask=valid[:, None], other=0)
    s_row, z = int4_tile_scales(
        s_ptr, z_ptr, offs_n, valid, stride_sn, stride_zn, t * BLOCK_K // group_size, HAS_ZP
    )
    return words, s_row, z


@triton.jit
def int4_gemv_kernel(
    x_ptr,  # [rows, K]: one row per program along axis 2 (ROUTED: a pair's token row, pair // X_ROW_DIV)
    w_ptr,  # [N, K / 8] int32: the packed uint8 [N, K / 2] as words (ROUTED: [E, N, K / 8], the pair's expert)
    s_ptr,  # [N, G] (ROUTED: [E, N, G])
    z_ptr,  # [N, G] uint8 (HAS_ZP; ROUTED: [E, N, G])
    b_ptr,  # [N] bias (HAS_BIAS, not PARTIAL)
    ids_ptr,  # ROUTED: [P] int32, each output row's expert
    out_ptr,  # [P, N] in x's dtype, or (PARTIAL) [splits, P, N] float32 partial sums
    res_ptr,  # SERIAL (one row: not ROUTED): [1, N] in x's dtype, the partials' sum (quant_tiles.store_gemv_out)
    lock_ptr,  # SERIAL: int32 counters, one per column tile, zero
    N, group_size, tiles_per_split, num_tiles, stride_wn, stride_sn, stride_zn, stride_os,
    stride_xm, stride_om, stride_we, stride_se, stride_ze,
    HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr, INTERPRET_BF16: tl.constexpr, ROUTED: tl.constexpr, X_ROW_DIV: tl.constexpr,
    USE_RAW_HI: tl.constexpr = False, USE_PDL: tl.constexpr = False, SERIAL: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0,
):  # fmt: skip
    BLOCK_W: tl.constexpr = BLOCK_K // 8  # words of a tile row
    pid_n, pid_k, row = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    # the first tiles into L2 while the kernel before drains (INT4_GEMV_PREFETCH)
    if PREFETCH > 0 and not ROUTED:
        for j in tl.static_range(PREFETCH):
            prefetch_l2(w_ptr + offs_n * stride_wn + (t_begin + j) * BLOCK_W, n_mask & (t_begin + j < t_end))
    pdl_prologue(USE_PDL)  # before the routed expert id (the router's output) and x
    if ROUTED:  # MoE decode (moe_wna16.py): output row `row` is a (token, k) pair, its expert's weights
        expert = tl.load(ids_ptr + row).to(tl.int64)
        w_ptr += expert * stride_we
        s_ptr += expert * stride_se
        z_ptr += expert * stride_ze
    x_ptr += (row // X_ROW_DIV) * stride_xm
    out_ptr += row * stride_om
    offs_w = tl.arange(0, BLOCK_W)
    w_rows = w_ptr + offs_n[:, None] * stride_wn  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Register double-buffering of the next tile (prefetch) was tried and measured slower on an H200 (ninth
    # session, RESULTS.md): Triton pipelines only loads that feed a tl.dot.
    # RAW_HI (16-bit activations, INT4_GEMV_RAW_HI): the pair's word as an fp32 is 128 + q_hi + (17152 + q_lo) /
    # 2^16 (the low bf16's bits below the high one's mantissa), so the high value is used unmasked: 17152 / 2^16
    # (exact) times the tile's sum of the high columns is subtracted, and q_lo / 2^16 x_hi is left, ~2e-5 of the
    # output (|q_lo| <= 15 against |q - z| ~ 4), below a bf16 output's rounding (2^-9). One operation less per
    # pair: sm90 SASS of the loop at BLOCK_N 256 (scripts/dev/count_gemv_sass.py, Triton 3.9) 4.18 -> 3.76
    # instructions a weight, 128 registers either way. (Loading the activations as one [BLOCK_W, 8] tile and
    # splitting it by position made 3.48, but 167 registers: 3 programs an SM instead of 4.)
    RAW_HI: tl.constexpr = USE_RAW_HI and x_ptr.dtype.element_ty != tl.float32
    for t in range(t_begin, t_end):
        words, s_row, z = int4_tile_load(w_rows, s_ptr, z_ptr, offs_n, offs_w, n_mask, stride_sn, stride_zn,
                                          group_size, t, BLOCK_K, HAS_ZP)  # fmt: skip
        x_cols = x_ptr + t * BLOCK_K + offs_w * 8  # [BLOCK_W]: column 8j of the tile
        prod = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        x_sum = tl.zeros([BLOCK_W], dtype=tl.float32)
        x_hi_sum = tl.zeros([BLOCK_W], dtype=tl.float32)  # RAW_HI: the high positions' own sum
        for i in tl.static_range(4):  # the value pairs (8j + i, 8j + i + 4) of every word
            pair = ((words >> (4 * i)) & _LOW_NIBBLES) | _BF16_128
            lo = (pair << 16).to(tl.float32, bitcast=True)  # 128 + q[8j + i]
            if RAW_HI:
                hi = pair.to(tl.float32, bitcast=True)  # 128 + q[8j + i + 4] + (17152 + q[8j + i]) / 2^16
            else:
                hi = (pair & _HIGH_HALF).to(tl.float32, bitcast=True)  # 128 + q[8j + i + 4]
            x_lo = tl.load(x_cols + i).to(tl.float32)
            x_hi = tl.load(x_cols + i + 4).to(tl.float32)
            # two FMAs (written as one sum, the second product compiled to a multiply and an add)
            prod += lo * x_lo[None, :]
            prod += hi * x_hi[None, :]
            x_sum += x_lo + x_hi
            if RAW_HI:
                x_hi_sum += x_hi
        dot = tl.sum(prod, axis=1) - z * tl.sum(x_sum, axis=0)
        if RAW_HI:
            dot -= _LOW_BITS_AS_HIGH * tl.sum(x_hi_sum, axis=0)
        acc += dot * s_row
    store_gemv_out(out_ptr, acc, offs_n, n_mask, b_ptr, offs_n, n_mask, pid_k, stride_os, res_ptr, lock_ptr,
                   HAS_BIAS, PARTIAL, INTERPRET_BF16, SERIAL)  # fmt: skip


@triton.jit
def int4_dot_tile(words, x_cols, m_mask, INTERPRET_FP32_DOT: tl.constexpr):
    """One K tile of the word-wise unpacking on the tensor cores (kernels/moe_wna16.py's grouped kernel, where a
    block of pairs shares its expert's tile; as a dense GEMV at 2-64 rows it lost to the general kernel at every
    M, RESULTS.md eighth session): words [BLOCK_N, BLOCK_K / 8] int32 of the weights' rows, x_cols [BLOCK_M,
    BLOCK_K / 8] pointers to column 8j of the tile in each activation row -> (sum_k (128 + q) x [BLOCK_M,
    BLOCK_N], sum_k x [BLOCK_M]) in fp32. Value position i of every word (columns 8j + i) is one operand of
    128 + q in the activations' dtype (exact: 128..143) against the activations' columns 8j + i: 8 dots of K =
    BLOCK_K / 8. INTERPRET_FP32_DOT: both operands in fp32 (the interpreter's 16-bit dot is not exact)."""
    ty = x_cols.dtype.element_ty
    prod = tl.zeros([x_cols.shape[0], words.shape[0]], dtype=tl.float32)
    x_sum = tl.zeros([x_cols.shape[0]], dtype=tl.float32)
    for i in tl.static_range(4):  # the value pairs (8j + i, 8j + i + 4) of every word
        pair = ((words >> (4 * i)) & _LOW_NIBBLES) | _BF16_128
        lo = (pair << 16).to(tl.float32, bitcast=True)  # [BLOCK_N, BLOCK_W]: 128 + q[8j + i]
        hi = (pair & _HIGH_HALF).to(tl.float32, bitcast=True)  # 128 + q[8j + i + 4]
        x_lo = tl.load(x_cols + i, mask=m_mask[:, None], other=0.0)  # [BLOCK_M, BLOCK_W]
        x_hi = tl.load(x_cols + i + 4, mask=m_mask[:, None], other=0.0)
        if INTERPRET_FP32_DOT:
            prod += tl.dot(x_lo.to(tl.float32), tl.trans(lo), input_precision="ieee")
            prod += tl.dot(x_hi.to(tl.float32), tl.trans(hi), input_precision="ieee")
        else:
            prod += tl.dot(x_lo, tl.trans(lo.to(ty)))
            prod += tl.dot(x_hi, tl.trans(hi.to(ty)))
        x_sum += tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
    return prod, x_sum
