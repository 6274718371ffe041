"""Triton helpers shared by the dense quantized GEMMs (quant_gemm.py, quant_fp8.py), their decode GEMVs and the
fused MoE kernel: rounding that the interpreter gets right, the GEMVs' split-K store, and the dequantization of a
tile of packed integer weights (the layout of quant_reference.py); and the outputs and program size of the
kernels that quantize activations (quant_fp8.per_token_group_quant, activation.silu_and_mul_quant)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# values a program of the activation-quantizing kernels takes, in whole groups: up to 1,024 (4 warps, 16-byte
# loads), not one group of 128 on 128 threads (a 2-byte load each, 32 programs a row of the 8B shape's 4,096)
QUANT_VALUES_PER_PROGRAM = 1024


def groups_per_program(group_block: int, groups: int) -> int:
    """Groups (of group_block values, a power of two) a program quantizes, of a row's `groups`."""
    return max(1, min(QUANT_VALUES_PER_PROGRAM // group_block, triton.next_power_of_2(groups)))


def quant_outputs(
    rows: int, cols: int, groups: int, dtype: torch.dtype, device: torch.device, column_major_scales: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantized values [rows, cols] in dtype and their float32 scales [rows, groups], the scales stored [groups,
    rows] and returned transposed with column_major_scales (cuBLAS's block recipes read them so)."""
    q = torch.empty(rows, cols, dtype=dtype, device=device)
    if column_major_scales:
        return q, torch.empty(groups, rows, dtype=torch.float32, device=device).t()
    return q, torch.empty(rows, groups, dtype=torch.float32, device=device)


@triton.constexpr_function
def sum_loads(numel: int) -> int:
    """Partial planes a serial split-K sum (store_gemv_out, gluon_gemv.store_sums) loads at once, for a program of
    `numel` sums. Why: one at a time, the last program of a column tile waited out an L2 round trip a split before the
    GEMV could end (the 8B qkv at one row: 16 splits; sm90 SASS, Triton 3.6: each turn of the loop issued one plane's
    loads and waited for them). 4 up to 1,024 sums (8 a thread of 4 warps: the int4 ring's and the FP8 wgmma GEMV's
    at one row, their registers unchanged), else 1: each loaded sum holds its own 64-bit address (the FP8 GEMV at 16
    rows, 2,048 sums, took 112 registers at 2 loads and 166 at 4 against 80: 4 and 3 programs an SM, not 6)."""
    return 4 if numel <= 1024 else 1


@triton.jit
def rounded(x, ty: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """fp32 x rounded to dtype ty (to nearest even), returned in fp32."""
    if ty == tl.float32:
        return x
    elif INTERPRET_BF16:  # the interpreter truncates fp32 -> bf16: round the bits by hand
        bits = x.to(tl.uint32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        return x.to(ty).to(tl.float32)


@triton.jit
def store_gemv_out(
    out_ptr, acc, out_off, out_mask, b_ptr, b_off, b_mask, pid_k, stride_os, res_ptr, lock_ptr,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, INTERPRET_BF16: tl.constexpr, SERIAL: tl.constexpr,
):  # fmt: skip
    """A split-K GEMV program's fp32 sums `acc` stored: with one split (+ bias), rounded once to out's dtype at
    `out_off`; with several, as this split's fp32 partials (plane pid_k of [splits, M, N]) for
    split_k.splitk_reduce. Shared by the decode GEMVs (quant_gemv.py, int4_gemv.py, fp8_gemv.py), whose grids
    are (column tiles, splits[, rows]).

    SERIAL (split_k.SPLIT_K_SERIAL_REDUCE): no reduction kernel after the GEMV. The program that stores its
    column tile's last partial (a counter per tile in lock_ptr, zero between launches) sums the tile's partials
    in split order (+ bias) into res_ptr [M, N], rounded once: what splitk_reduce writes, bit for bit, whichever
    program comes last; then it zeroes the counter. The barrier orders the CTA's partial stores before the
    counter's release (acq_rel, GPU scope); the last program's loads follow its acquire, from L2 (.cg)."""
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(b_ptr + b_off, mask=b_mask, other=0.0).to(tl.float32)
        out_ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + out_off, rounded(acc, out_ty, INTERPRET_BF16).to(out_ty), mask=out_mask)
    else:
        tl.store(out_ptr + pid_k * stride_os + out_off, acc, mask=out_mask)
        if SERIAL:
            tl.debug_barrier()
            lock = lock_ptr + tl.program_id(0) + tl.num_programs(0) * tl.program_id(2)
            num_splits = tl.num_programs(1)
            if tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                total = tl.zeros_like(acc)
                # in order: what splitk_reduce adds; LOADS planes' loads in flight at once (-0.0: the identity)
                LOADS: tl.constexpr = sum_loads(acc.numel)
                for first in range(0, num_splits, LOADS):
                    for u in tl.static_range(LOADS):
                        # the split's bound as a tensor of out_off's shape (the interpreter takes no scalar here)
                        live = (out_off * 0 + first + u) < num_splits
                        total += tl.load(out_ptr + (first + u) * stride_os + out_off, mask=out_mask & live,
                                         other=-0.0, cache_modifier=".cg")  # fmt: skip
                if HAS_BIAS:
                    total += tl.load(b_ptr + b_off, mask=b_mask, other=0.0).to(tl.float32)
                res_ty = res_ptr.dtype.element_ty
                tl.store(res_ptr + out_off, rounded(total, res_ty, INTERPRET_BF16).to(res_ty), mask=out_mask)
                tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def minus_zero(q, z):
    """q - z in float32, for int32 0 <= q < 2^23 and an integer-valued z (a zero point, or 2^(BITS - 1)), exactly
    q.to(float32) - z without converting: the bits 0x4B000000 | q are the float 2^23 + q, and (2^23 + q) - (2^23 + z)
    is exact (CUTLASS's and AWQ's int4 converters avoid I2F alike). An SM converts 16 ints to floats a clock (the
    CUDA guide's throughput table), where a 3-input logic op takes 64 and a float add 128: in an sm90 build of the
    fused MoE kernel's int4 tiles by rows (tune_moe's 128 x 64 x 64, 4 warps, gate and up), the 64 I2F a thread a
    K step are 512 of the conversion unit's clocks, as many as its 16 wgmma take."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (z + 8388608.0)


@triton.jit
def int_weight_tile(
    w_ptr, s_ptr, z_ptr, g_ptr, offs_n, offs_k, k_start, n_mask, k_mask,
    stride_wn, stride_sn, stride_zn, group_size,
    BITS: tl.constexpr, HAS_ZP: tl.constexpr, HAS_GIDX: tl.constexpr,
):  # fmt: skip
    """The float32 weights [BLOCK_K, BLOCK_N] of output rows offs_n and input columns offs_k:
    (q - zero) * scale of their groups. Without g_idx the tile lies in one group (k_start's: BLOCK_K divides
    group_size), so one scale per column is loaded; with it every input column reads its own group."""
    PACK: tl.constexpr = 8 // BITS
    mask = k_mask[:, None] & n_mask[None, :]
    byte = tl.load(w_ptr + offs_n[None, :] * stride_wn + (offs_k // PACK)[:, None], mask=mask, other=0)
    if BITS == 4:
        q = (byte.to(tl.int32) >> ((offs_k % 2) * 4)[:, None]) & 0xF
    else:
        q = byte.to(tl.int32)
    if HAS_GIDX:
        g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)  # [BLOCK_K]
        s = tl.load(s_ptr + offs_n[None, :] * stride_sn + g[:, None], mask=mask, other=0.0).to(tl.float32)
        if HAS_ZP:
            z = tl.load(z_ptr + offs_n[None, :] * stride_zn + g[:, None], mask=mask, other=0).to(tl.float32)
        else:
            z = 2.0 ** (BITS - 1)
    else:
        g = k_start // group_size
        s = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_ZP:
            z = tl.load(z_ptr + offs_n * stride_zn + g, mask=n_mask, other=0).to(tl.float32)[None, :]
        else:
            z = 2.0 ** (BITS - 1)
    return minus_zero(q, z) * s


@triton.jit
def int_weight_rows(
    w_ptr, s_ptr, z_ptr, offs_n, offs_kb, k_start, mask, stride_wn, stride_sn, stride_zn, group_size,
    BITS: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """int_weight_tile without g_idx, as the memory lies: the float32 weights [BLOCK_N, BLOCK_K] of rows offs_n and
    input columns k_start.. (packed columns offs_kb, BLOCK_K / (8 // BITS) of them; `mask` [BLOCK_N, that] or None),
    each row's packed bytes one contiguous run loaded once, the nibbles unpacked in registers (column 2j the low
    nibble of byte j: quant_gemv's join + reshape). The values int_weight_tile's transpose holds, bit for bit; it
    loads every byte twice, one byte a lane. The tile lies in one group: one scale (and zero) a row."""
    rows = w_ptr + offs_n[:, None] * stride_wn + offs_kb[None, :]
    if mask is None:
        packed = tl.load(rows).to(tl.int32)
    else:
        packed = tl.load(rows, mask=mask, other=0).to(tl.int32)
    if BITS == 4:
        q = tl.reshape(tl.join(packed & 0xF, (packed >> 4) & 0xF), [offs_n.shape[0], BLOCK_K])
    else:
        q = packed & 0xFF
    g = k_start // group_size
    s = tl.load(s_ptr + offs_n * stride_sn + g).to(tl.float32)[:, None]
    if HAS_ZP:
        z = tl.load(z_ptr + offs_n * stride_zn + g).to(tl.float32)[:, None]
    else:
        z = 2.0 ** (BITS - 1)
    return minus_zero(q, z) * s


@triton.jit
def e4m3_rounded(y):
    """fp32 y (|y| <= 448) rounded to the nearest e4m3 value (ties to even), in fp32: the interpreter's own
    fp32 -> e4m3 cast mis-rounds when the mantissa carries into the exponent (126.8 -> 64)."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    # normal e4m3 (|y| >= 2^-6): keep 3 of fp32's 23 mantissa bits, round to nearest even
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # subnormal e4m3: multiples of 2^-9
    r = tl.abs(y) * 512.0
    f = tl.floor(r)
    d = r - f
    up = (d > 0.5) | ((d == 0.5) & ((f.to(tl.int32) & 1) == 1))
    sub = tl.where(up, f + 1.0, f) / 512.0
    out = tl.where(tl.abs(y) >= 0.015625, normal, sub)
    return (out.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
