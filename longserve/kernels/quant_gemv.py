"""W4A16 / W8A16 GEMV and skinny GEMM for decode batch sizes (M from 1 to 64): y = x @ dequantize(w)^T
(+ bias) for integer weights in the layout of `quant_reference` (uint8 [N, K * bits / 8] packed along K,
scales [N, G], optional uint8 zero points [N, G], optional act-order g_idx [K]). Its reference is
`quant_reference.wna16_gemm_ref`; `quant_gemm.wna16_gemm` routes here when M <= WNA16_GEMV_MAX_TOKENS.

At decode sizes the product is bound by reading the packed weights (N * K / 2 bytes for 4 bits: the floor of
the Llama-3.1-8B gate_up projection is ~14 us on an H200). The design, for that floor:

- Each program owns BLOCK_N output rows and a run of K tiles; the weight tile [BLOCK_N, BLOCK_K * bits / 8]
  is loaded as bytes contiguous along K (each row of the layout is contiguous), which Triton turns into 16-byte
  vector loads per thread (no K mask unless K is not a multiple of BLOCK_K: EVEN_K).
- The nibbles are unpacked in registers (low, high: `tl.join` + reshape back to K order) and turned into
  floats without an int -> float conversion (16 a clock an SM, an eighth of the float add's rate):
  quant_tiles.minus_zero reads q | 0x4B000000 as float32, 2^23 + q exactly, and subtracts 2^23 + z.
- Scales (and zero points) are loaded once per tile per row, not per element: a tile lies within one group
  (BLOCK_K divides the group size), so sum_k (q - z) s x = s * sum_k (q - z) x, and the scale multiplies the
  tile's [BLOCK_M, BLOCK_N] partial sums. Act order (g_idx) and groups that are not a multiple of 16 take the
  per-element path (SCALE_PER_COL: every column gathers its group's scale and zero point).
- Products: for M <= WNA16_GEMV_FMA_MAX_TOKENS (or float32 activations) fp32 FMAs on the CUDA cores reduced
  along K; above it (16-bit activations) tl.dot of x [BLOCK_M >= 16, BLOCK_K] with (q - z), which is exact in
  bf16/fp16 (|q - z| <= 255), accumulated in fp32, then scaled per tile.
- Split-K: the grid is (N / BLOCK_N, SPLIT_K); SPLIT_K is chosen so that about 8 programs per SM run even for
  N = 4096. With SPLIT_K > 1 each program writes fp32 partial sums [SPLIT_K, M, N] and a second small kernel
  adds them in a fixed order (deterministic, no atomics, no counters to reset), adds the bias in fp32 and rounds
  once to x's dtype. No host syncs: CUDA graphs capture both launches.

Rounding differs from the reference in one place: the reference rounds each dequantized weight to x's dtype
before the product; here (q - z) is exact and the scale is applied to fp32 partial sums (more accurate, not
bit-equal for bf16/fp16; equal up to summation order for float32). The per-element path keeps the weight in
fp32 on the FMA path and rounds it to x's dtype on the tl.dot path (as the reference does).

Compiles for sm90 on a machine without a GPU (triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))
reaches cubin; scripts/dev/compile_quant_gemv.py, run by tests/unit/test_quant_gemv.py; every variant there also
compiles with Triton 3.6.0, checked once by hand with it installed aside). What the SASS of the decode
case (M = 1, int4 g128, BLOCK_N 64, BLOCK_K 128, 4 warps) shows, Triton 3.9: 69 registers, no spills, two
LDG.E.128 of packed weights per thread per tile, the activation row through shared memory (one layout
conversion per tile), and ~6.5 instructions per weight value (~2.5 integer ones unpacking, ~3 float ones: the
2^23 subtraction, the product, the tree sum). At 128 instructions / clock / SM that bounds the gate_up product at
~24 us against the 14 us memory floor: not yet measured. If the GPU shows it issue-bound, the next steps are
PTX unpacking (prmt/lop3 via tl.inline_asm_elementwise, as Marlin does: ~1 instruction per value) and fp16x2
arithmetic. Not measured either: the act-order path (scale and zero point gathered per value from L1) and the
cost of the second launch of split-K (a single-launch alternative: the last program of a row block adds the
partials, ordered by a counter that it resets).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels import int4_gemv, split_k
from longserve.kernels.extend_attention import interpreting
from longserve.kernels.gemv_tables import tuned_gemv_config
from longserve.kernels.int4_gemv import int4_fast_block_n, int4_fast_supported, int4_gemv_kernel
from longserve.kernels.launch import pdl_prologue, use_pdl
from longserve.kernels.quant_reference import wna16_gemm_ref
from longserve.kernels.quant_tiles import minus_zero, rounded, store_gemv_out
from longserve.kernels.split_k import split_k_outputs, splits_for

__all__ = [
    "WNA16_GEMV_FMA_MAX_TOKENS",
    "wna16_gemv",
    "wna16_gemv_config",
    "wna16_gemv_supported",
    "wna16_gemm_ref",
]

# One-row products of 4-bit weights in whole-tile groups take kernels/int4_gemv.py's word-wise unpacking (sm90
# SASS: 4.4 instructions a weight against 6.1). Measured on an H200 (2026-12-02, 35fd681, that commit's
# `gpu_check.sh int4-fast`, RESULTS.md seventh session): its GPU tests pass; at M=1 (CUDA-graph replays) the 8B
# projections take qkv 11.2 / o 9.8 / gate_up 34.7 / down 21.1 us against 12.5 / 11.0 / 41.8 / 23.8 with the
# general kernel (gate_up at 42% of 4.2 TB/s), and the 8B int4 decode at batch 1 (32K) 4.79 ms against 5.01.
INT4_FAST_PATH = True
# 2 to 64 rows: the general kernel below. The one-row kernel's word-wise unpacking with the products on the
# tensor cores (tl.dot) was slower at every M there (an H200, 2026-12-02, c2dd2fd, RESULTS.md eighth session:
# the 8B gate_up at M=16 172.1 us against 56.9, the int4 decode at batch 64 66.84 ms against 16.78) and was
# removed; kernels/moe_wna16.py's grouped kernel keeps that unpacking (int4_gemv.int4_dot_tile), where reading
# each expert once per block of pairs, not once per pair, outweighs it.
# M up to which the CUDA-core FMA path serves 16-bit activations; above it tl.dot (BLOCK_M >= 16). A placeholder
# until the GPU session measures both (scripts/gpu/bench_quant_kernels.py --sweep-gemv prints them per M).
WNA16_GEMV_FMA_MAX_TOKENS = 4
# INT4_MMA_MIN_ROWS to 64 rows of 4-bit weights on the tensor cores (kernels/int4_mma_gemv.py: Gluon, mma.sync; past
# 16 rows in blocks of 16, its MAX_ROWS); imported only when on (Gluon). Measured on an H200 (2026-12-05, 46763a7,
# `gpu_check.sh int4-mma` and the 8B GPTQ int4 decode, RESULTS.md twenty-fifth session): its GPU tests pass; per
# projection (weights from HBM) it wins from 8 rows (gate_up 28.7 against 51.0 us at 8, 36.4 / 52.6 at 16) and loses
# at one (36.6 against 32.1); the decode at b8@4K 5.47 -> 4.85 ms, b16@8K 8.44 -> 7.44, b64@4K 16.43 -> 15.44, and
# b1@32K 4.12 -> 4.90: so from 2 rows, the one-row kernel (int4_gemv.py) keeping batch 1. With its words by a TMA
# ring at one row (int4_mma_gemv.ONE_ROW: 2 tiles a warp, 2 stages) the b1@32K decode 4.13 -> 3.73 ms (twenty-eighth
# session, 6f283db; 0.651x bf16's 5.73): from one row.
INT4_MMA_GEMV = True
INT4_MMA_MIN_ROWS = 1
# An MLP's down projection at one row takes gate|up and makes its input silu(gate) * up inside the tensor-core GEMV
# (int4_mma_gemv GATED: a slot ahead into shared memory, each warp its copy) instead of by activation.silu_and_mul's
# launch before it: one launch less a layer (the 8B int4 b1 profile: SiLU 0.081 ms of 3.71). sm90 builds (Triton
# 3.6): the one-row loop 494 -> 568 instructions, 80 registers. On since the thirty-first session (`gpu_check.sh
# int4-gated` at 82a0989, H100, its GPU test passing): the 8B int4 decode b1@32K 4.55 -> 4.45 ms, with AHEAD too.
INT4_MMA_GATED = True
# moe_wna16's routed expert GEMV (one row a (token, k) pair) through the same kernel: unmeasured (`gpu_check.sh
# int4-mma-moe`); at one row the dense projections lost above.
INT4_MMA_ROUTED = False
GEMV_MAX_BLOCK_M = 64  # the largest M the kernel takes (tl.dot path); beyond it quant_gemm's kernels serve


@triton.jit
def _wna16_gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K * BITS / 8] uint8
    s_ptr,  # [N, G]
    z_ptr,  # [N, G] uint8 (HAS_ZP)
    g_ptr,  # [K] int32 (HAS_GIDX)
    b_ptr,  # [N] bias (HAS_BIAS, not PARTIAL)
    out_ptr,  # [M, N] in x's dtype, or (PARTIAL: split K) [splits, M, N] float32 partial sums
    res_ptr,  # SERIAL: [M, N] in x's dtype, the partials' sum (quant_tiles.store_gemv_out)
    lock_ptr,  # SERIAL: int32 counters, one per column tile, zero
    M, N, K, group_size, tiles_per_split, num_tiles,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om, stride_os,
    BITS: tl.constexpr, HAS_ZP: tl.constexpr, HAS_GIDX: tl.constexpr, SCALE_PER_COL: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
    INTERPRET: tl.constexpr, INTERPRET_BF16: tl.constexpr, USE_PDL: tl.constexpr, SERIAL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(USE_PDL)
    PACK: tl.constexpr = 8 // BITS  # values per byte
    BLOCK_KB: tl.constexpr = BLOCK_K // PACK  # bytes of one tile row
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_kb = tl.arange(0, BLOCK_KB)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask, m_mask = offs_n < N, offs_m < M
    x_ty = x_ptr.dtype.element_ty
    w_rows = w_ptr + offs_n[:, None] * stride_wn  # [BLOCK_N, 1]
    # the FMA path accumulates [BLOCK_N, BLOCK_M] in the weight tile's layout (rows along dim 0, as the K
    # reduction leaves them); the tl.dot path [BLOCK_M, BLOCK_N]
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    for t in range(t_begin, t_end):
        k0 = t * BLOCK_K
        cols = k0 + offs_k  # [BLOCK_K]
        k_ok = cols < K
        # the packed tile [BLOCK_N, BLOCK_KB]: each row's bytes are contiguous (16-byte vector loads)
        if EVEN_K:
            packed = tl.load(w_rows + (t * BLOCK_KB + offs_kb)[None, :], mask=n_mask[:, None], other=0)
        else:
            kb_mask = (t * BLOCK_KB + offs_kb) < (K // PACK)
            packed = tl.load(w_rows + (t * BLOCK_KB + offs_kb)[None, :], mask=n_mask[:, None] & kb_mask[None, :],
                             other=0)  # fmt: skip
        pi = packed.to(tl.int32)
        if BITS == 4:  # column 2j is the low nibble of byte j, 2j + 1 the high one
            q = tl.reshape(tl.join(pi & MASK, (pi >> 4) & MASK), [BLOCK_N, BLOCK_K])
        else:
            q = pi & MASK
        if SCALE_PER_COL:  # every column its own group (act order, or groups not a multiple of 16)
            if HAS_GIDX:
                grp = tl.load(g_ptr + cols, mask=k_ok, other=0)
            else:
                grp = cols // group_size
            sz_mask = n_mask[:, None] & k_ok[None, :]
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + grp[None, :], mask=sz_mask, other=0.0).to(
                tl.float32
            )
            if HAS_ZP:
                z = tl.load(z_ptr + offs_n[:, None] * stride_zn + grp[None, :], mask=sz_mask, other=0).to(
                    tl.float32
                )
            else:
                z = 2.0 ** (BITS - 1)
            w = minus_zero(q, z) * s  # [BLOCK_N, BLOCK_K] float32, the dequantized weights
            if USE_DOT and not INTERPRET:
                w_dot = w.to(x_ty)  # rounded to x's dtype, as the reference
            else:
                w_dot = rounded(w, x_ty, INTERPRET_BF16)
            s_row = tl.full([BLOCK_N], 1.0, tl.float32)  # unused
        else:  # the tile lies in one group (BLOCK_K divides group_size): one scale per row and tile
            grp = k0 // group_size
            s_row = tl.load(s_ptr + offs_n * stride_sn + grp, mask=n_mask, other=0.0).to(
                tl.float32
            )  # [BLOCK_N]
            if HAS_ZP:
                z = tl.load(z_ptr + offs_n * stride_zn + grp, mask=n_mask, other=0).to(tl.float32)[:, None]
            else:
                z = 2.0 ** (BITS - 1)
            w = minus_zero(q, z)  # q - z, exactly: integers of at most 9 bits
            if USE_DOT and not INTERPRET:
                w_dot = w.to(x_ty)  # exact in bf16/fp16
            else:
                w_dot = w
        if USE_DOT:
            xv = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + cols[None, :],
                mask=m_mask[:, None] & k_ok[None, :],
                other=0.0,
            )  # fmt: skip  [BLOCK_M, BLOCK_K]
            if INTERPRET:  # the interpreter's bf16 dot is wrong: dot in fp32 (w_dot already rounded)
                part = tl.dot(xv.to(tl.float32), tl.trans(w_dot), input_precision="ieee")
            else:
                part = tl.dot(xv, tl.trans(w_dot))  # [BLOCK_M, BLOCK_N] float32
            if SCALE_PER_COL:
                acc += part
            else:
                acc += part * s_row[None, :]
        else:
            for mi in tl.static_range(BLOCK_M):  # one activation row at a time: the weight tile is reused
                xm = tl.load(x_ptr + mi * stride_xm + cols, mask=k_ok & ((cols * 0 + mi) < M),
                             other=0.0).to(tl.float32)  # fmt: skip
                part = tl.sum(w * xm[None, :], axis=1)  # [BLOCK_N]: within each thread, then a few shuffles
                if not SCALE_PER_COL:
                    part = part * s_row
                if BLOCK_M == 1:
                    acc += part[:, None]
                else:
                    acc += tl.where(offs_m[None, :] == mi, part[:, None], 0.0)
    if USE_DOT:
        out_off = offs_m[:, None] * stride_om + offs_n[None, :]
        out_mask = m_mask[:, None] & n_mask[None, :]
        n_bcast = offs_n[None, :]
    else:
        out_off = offs_m[None, :] * stride_om + offs_n[:, None]
        out_mask = m_mask[None, :] & n_mask[:, None]
        n_bcast = offs_n[:, None]
    store_gemv_out(out_ptr, acc, out_off, out_mask, b_ptr, n_bcast, n_bcast < N, pid_k, stride_os, res_ptr,
                   lock_ptr, HAS_BIAS, PARTIAL, INTERPRET_BF16, SERIAL)  # fmt: skip


def pow2_at_most(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _tile_k(group_size: int, k: int, target: int) -> int:
    """The largest power of two <= target that divides the group (a tile in one group), or 0 if none >= 16."""
    bk = target
    while bk >= 16:
        if group_size % bk == 0:
            return bk
        bk //= 2
    return 0


def wna16_gemv_supported(m: int, k: int, bits: int) -> bool:
    """Whether the GEMV kernel takes this product (else quant_gemm's kernels serve it)."""
    return 1 <= m <= GEMV_MAX_BLOCK_M and bits in (4, 8) and k % 2 == 0


def wna16_gemv_config(
    m: int,
    n: int,
    k: int,
    group_size: int,
    bits: int,
    has_gidx: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, int]:
    """Defaults (scripts/gpu/bench_quant_kernels.py --sweep-gemv measures candidates), and for the one-row int4
    kernel the tiles of gemv_tables' entry for (N, K, M) on this GPU where one was timed.
    The tile lies in one group: BLOCK_K up to 128 values for 4 bits (64 bytes of a row), 128 for 8 bits, dividing
    the group; BLOCK_N so that a tile holds ~8K values (64 per thread at 4 warps: two 16-byte loads for 4 bits),
    fewer for the FMA path at M > 4 (its registers: the tile plus BLOCK_M accumulators per row); the per-element
    path (act order) 32 x 64 (its scale and zero point gathers: more would spill, as compiled for sm90).
    SPLIT_K for ~8 programs per SM (N = 4096: 64 row blocks x 16 splits)."""
    group = group_size if group_size > 0 else k
    per_col = has_gidx or _tile_k(group, k, 16) == 0
    block_k = 64 if per_col else _tile_k(group, k, 128)
    use_dot = dtype != torch.float32 and m > WNA16_GEMV_FMA_MAX_TOKENS
    block_m = max(16, triton.next_power_of_2(m)) if use_dot else triton.next_power_of_2(m)
    if per_col:
        block_n = 32
    else:
        budget = 8192 if use_dot or block_m <= 4 else 4096  # values of a tile
        block_n = max(16, min(128, pow2_at_most(budget // block_k)))
    fast = INT4_FAST_PATH and int4_fast_supported(m, bits, k, per_col, use_dot, block_k)
    if fast:
        sms = split_k.num_sms(device.index or 0) if device.type == "cuda" else 1
        block_n = int4_fast_block_n(n, triton.cdiv(k, block_k), 1, sms)
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    splits = splits_for(device, triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": splits,
           "USE_DOT": int(use_dot), "SCALE_PER_COL": int(per_col), "num_warps": 4, "num_stages": 2}  # fmt: skip
    # the one-row kernel's tiles as timed on this GPU (kernels/gemv_tables.py), where they were
    tuned = tuned_gemv_config(f"int4_fast_gemv_bk{block_k}", n, k, m, device) if fast else None
    return {**cfg, **(tuned or {})}


def mma_gemv(
    x, qweight, scales, zeros, bias, group_size: int, m: int, n: int, k: int, gated=False, norm=None
):
    """[M, N] by int4_mma_gemv (a product its `fits` takes), split K for one wave (gated: x = gate|up [1, 2K]);
    norm (gluon_gemv.RowNorm, one row): (normed, new residual), or None if a launch after would sum the splits."""
    from longserve.kernels import int4_mma_gemv as mma

    num_steps, n_tiles = k // mma.K_STEP, triton.cdiv(n, mma.block_n(m))
    programs = n_tiles * mma.row_blocks(m)  # a serial sum's counters: one a program column
    split = (
        mma.splits(n_tiles, num_steps, split_k.num_sms(x.device.index or 0), m, gated=gated)
        if mma.WAVE_SPLITS
        else splits_for(x.device, programs, num_steps)
    )
    sk = split_k_outputs(num_steps, split, m, n, programs, x.dtype, x.device)
    if norm is not None and not sk.summed_in_kernel:
        return None
    mma.launch(x, qweight, scales, zeros, bias, group_size, sk.tiles_per_split, sk.splits, *sk.pointers(),
               sk.stride_os, sk.serial, sk.bias_in_kernel(bias), gated=gated, norm=norm)  # fmt: skip
    return sk.result(bias, x.dtype) if norm is None else norm.results()


def wna16_gemv(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K * bits / 8] uint8
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor | None,  # [N, G] uint8
    g_idx: torch.Tensor | None,  # [K] int32
    bits: int,
    group_size: int,  # <= 0: one group of all K
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """[M, N] in x's dtype; same contract as `wna16_gemm_ref` (module docstring: rounding)."""
    m, k = x.shape
    n = qweight.shape[0]
    assert qweight.dtype == torch.uint8 and qweight.shape[1] * 8 == k * bits, (
        f"qweight {tuple(qweight.shape)} {qweight.dtype} for K={k}, {bits} bits"
    )
    assert wna16_gemv_supported(m, k, bits), f"GEMV of M={m}, K={k}, {bits} bits"
    group = group_size if group_size > 0 else k
    assert g_idx is not None or scales.shape[1] == -(-k // group), (
        f"scales {tuple(scales.shape)}, group {group}"
    )
    x = x if x.stride(1) == 1 else x.contiguous()
    qweight = qweight if qweight.stride(1) == 1 else qweight.contiguous()
    if INT4_MMA_GEMV and m >= INT4_MMA_MIN_ROWS and x.is_cuda:
        from longserve.kernels import int4_mma_gemv as mma

        if mma.supported() and mma.fits(x, qweight, g_idx, bits, group_size):
            return mma_gemv(x, qweight, scales, zeros, bias, group_size, m, n, k)
    cfg = dict(
        wna16_gemv_config(m, n, k, group, bits, g_idx is not None, x.dtype, x.device), **(config or {})
    )
    per_col = bool(cfg["SCALE_PER_COL"]) or g_idx is not None
    block_k = cfg["BLOCK_K"]
    assert per_col or group % block_k == 0, f"BLOCK_K {block_k} must divide the group {group}"
    assert cfg["BLOCK_M"] >= m and (not cfg["USE_DOT"] or cfg["BLOCK_M"] >= 16)
    num_tiles = triton.cdiv(k, block_k)
    n_tiles = triton.cdiv(n, cfg["BLOCK_N"])
    sk = split_k_outputs(num_tiles, cfg["SPLIT_K"], m, n, n_tiles, x.dtype, x.device)
    interp = interpreting()
    interpret_bf16 = interp and x.dtype == torch.bfloat16
    z = zeros if zeros is not None else scales
    g = g_idx if g_idx is not None else scales
    b = bias if bias is not None else scales
    words_ok = qweight.stride(0) % 4 == 0 and qweight.data_ptr() % 16 == 0  # rows of whole 32-bit words
    fast = int4_fast_supported(m, bits, k, per_col, bool(cfg["USE_DOT"]), block_k)
    pdl = use_pdl(x)
    if INT4_FAST_PATH and words_ok and fast:
        int4_gemv_kernel[(n_tiles, sk.splits, 1)](
            x, qweight.view(torch.int32), scales, z, b, scales, *sk.pointers(), n, group, sk.tiles_per_split,
            num_tiles, qweight.stride(0) // 4, scales.stride(0), z.stride(0), sk.stride_os,
            0, 0, 0, 0, 0, HAS_ZP=zeros is not None, HAS_BIAS=sk.bias_in_kernel(bias),
            BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, PARTIAL=sk.partial, INTERPRET_BF16=interpret_bf16,
            ROUTED=False, X_ROW_DIV=1, USE_RAW_HI=int4_gemv.INT4_GEMV_RAW_HI, USE_PDL=pdl,
            PREFETCH=int4_gemv.INT4_GEMV_PREFETCH if pdl else 0, SERIAL=sk.serial,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=pdl,
        )  # fmt: skip
    else:
        _wna16_gemv_kernel[(n_tiles, sk.splits)](
            x, qweight, scales, z, g, b, *sk.pointers(), m, n, k, group, sk.tiles_per_split, num_tiles,
            x.stride(0), qweight.stride(0), scales.stride(0), z.stride(0), sk.out.stride(-2), sk.stride_os,
            BITS=bits, HAS_ZP=zeros is not None, HAS_GIDX=g_idx is not None, SCALE_PER_COL=per_col,
            HAS_BIAS=sk.bias_in_kernel(bias), EVEN_K=k % block_k == 0, USE_DOT=bool(cfg["USE_DOT"]),
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, PARTIAL=sk.partial,
            INTERPRET=interp, INTERPRET_BF16=interpret_bf16, USE_PDL=pdl, SERIAL=sk.serial,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=pdl,
        )  # fmt: skip
    return sk.result(bias, x.dtype)
