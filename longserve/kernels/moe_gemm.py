"""The fused MoE's grouped GEMM in Triton (kernels/fused_moe.py launches it twice a layer): each program multiplies
one block of routed (token, k) pairs, all of one expert after moe_align's sort, by a tile of that expert's
weights, 16-bit, packed integers (dequantized in the tile) or block FP8 (e4m3 activations and weights, each K
block's product scaled by both scales); gate+up with SiLU-and-mul in the epilogue, down with the routing weights.
Reference: moe_reference.fused_moe_ref. Programs past the real padded length (read from a device tensor) exit
at once: no host sync (CUDA-graph safe)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels import quant_fp8
from longserve.kernels.extend_attention import interpreting
from longserve.kernels.launch import fast_launch, pdl_prologue, use_pdl
from longserve.kernels.moe_reference import MoEQuant
from longserve.kernels.quant_tiles import int_weight_rows, int_weight_tile
from longserve.kernels.quant_tiles import rounded as _rounded

# Packed integer experts (no act order) by tiles loaded as the memory lies (quant_tiles.int_weight_rows: each row's
# bytes once, 8-byte loads in an sm90 build of the dequantization kernel) instead of int_weight_tile's [BLOCK_K,
# BLOCK_N] one byte a lane, every byte twice; the same values, bit for bit. What it is for: this int path at prefill
# sizes (moe_wna16.MOE_WNA16_PREFILL "fused") instead of dequantizing all 128 A3B experts every chunk (1.2 GB written a
# layer; the A3B int4 cold 32K 1.12x bf16 on an H100, thirty-sixth session). Built for sm90 here (Triton 3.9, the
# gate+up kernel at 64 x 128 x 128, 4 warps, 3 stages; scripts/dev/count_moe_sass.py '{"wq": 1, ...}'): the main loop
# 2,320 -> 1,642 instructions (LDG 130 -> 2, the bytes through cp.async; STS 256 -> 34), still 128 F2FP and 256 FMUL
# of dequantization where the bf16 kernel's loop holds 215 instructions; at the untuned prefill tiles (128 x 128 x
# 64, 8 warps) 1,666 -> 885, both spilling. Measured on an H100 (one A3B layer as CUDA graphs, us, by columns / by
# rows / the experts dequantized; tests/gpu/test_quant_kernels_gpu.py test_int_rows_in_the_fused_int_path, 4804d36 and
# 3352078, RESULTS.md thirty-seventh and thirty-eighth sessions): int4 at 512 tokens 1,684-1,834 / 444 / 1,154-1,180,
# at 4,096 25,124-28,898 / 1,638-1,654 / 1,700-1,759; int8 at 8 tokens 112-126 / 121-122 / 889. So on: the int
# path is only fast by rows, and by rows it serves the 4-bit experts' mid-sized steps (moe_wna16.
# MOE_WNA16_ROWS_MAX_PER_EXPERT); the 8-bit experts' decode moves within noise.
INT_ROWS = True


@triton.jit
def _b_tile(
    b_ptr, bs_ptr, bz_ptr, bg_ptr, offs_bn, offs_k, k0, k_valid, N_ROW_OFFSET,
    stride_bn, stride_bsn, stride_bzn, QUANT_GROUP, K,
    EVEN_K: tl.constexpr, WEIGHT_QUANT: tl.constexpr, BITS: tl.constexpr, HAS_ZP: tl.constexpr,
    HAS_GIDX: tl.constexpr, INT_ROWS: tl.constexpr, ACT_TY: tl.constexpr, INTERPRET_BF16: tl.constexpr,
):  # fmt: skip
    """One expert's weight tile [BLOCK_K, BLOCK_N] of output rows N_ROW_OFFSET + offs_bn (pointers already at
    the expert): packed integers dequantized in float32 and rounded to the activations' dtype ACT_TY (WEIGHT_QUANT
    1; INT_ROWS: loaded as rows and rounded before the transpose, INT_ROWS above), else as stored (fp8: scaled by
    `_fp8_scale`)."""
    rows = offs_bn + N_ROW_OFFSET
    # one return at the end: compiled Triton (3.6) keeps generating the statements after a return taken in a
    # constexpr branch and then refuses the function for returning two types (the interpreter does not mind)
    if WEIGHT_QUANT == 1 and INT_ROWS:  # the same values, each row's packed bytes loaded once
        PACK: tl.constexpr = 8 // BITS
        offs_kb = k0 // PACK + tl.arange(0, offs_k.shape[0] // PACK)
        kb_mask = None if EVEN_K else (offs_kb < K // PACK)[None, :]
        w = int_weight_rows(
            b_ptr, bs_ptr, bz_ptr, rows, offs_kb, k0, kb_mask, stride_bn, stride_bsn, stride_bzn, QUANT_GROUP,
            BITS, HAS_ZP, offs_k.shape[0],
        )  # fmt: skip
        w = _rounded(w, ACT_TY, INTERPRET_BF16)  # 16-bit through the transpose (half the registers of fp32)
        w = tl.trans(w if INTERPRET_BF16 else w.to(ACT_TY))
    elif WEIGHT_QUANT == 1:  # packed integers: dequantized here, in float32
        true_n = offs_bn >= 0
        w = int_weight_tile(
            b_ptr, bs_ptr, bz_ptr, bg_ptr, rows, offs_k, k0, true_n, k_valid,
            stride_bn, stride_bsn, stride_bzn, QUANT_GROUP, BITS, HAS_ZP, HAS_GIDX,
        )  # fmt: skip
        w = _rounded(w, ACT_TY, INTERPRET_BF16)  # the dequantized weights meet the activations at their dtype
        w = w if INTERPRET_BF16 else w.to(ACT_TY)
    else:
        ptrs = b_ptr + rows[None, :] * stride_bn + offs_k[:, None]
        if EVEN_K:
            w = tl.load(ptrs)
        else:
            w = tl.load(ptrs, mask=k_valid[:, None], other=0.0)
    return w


@triton.jit
def _fp8_scale(
    a_s, bs_ptr, offs_bn, n_first, N_ROW_OFFSET, kg, stride_bsn,
    BLOCK_N_SCALE: tl.constexpr, SCALAR_B_SCALE: tl.constexpr,
):  # fmt: skip
    """What a block-FP8 tile's product over K group `kg` is scaled by: the token's activation scale a_s
    [BLOCK_M] times the weight block's scale of each column. SCALAR_B_SCALE (the tile's columns lie in one
    scale block): one load and a per-row product, [BLOCK_M, 1], which the accumulation takes as one FFMA an
    element; else a scale per column, [BLOCK_M, BLOCK_N] (an FMUL more an element, and a load per column held).
    The A3B FP8 prefill's gate+up kernel (64 x 128 x 128, 8 warps) built for sm90 with Triton 3.6
    (scripts/dev/count_moe_sass.py), per scale a column -> one a tile: at max_num_imprecise_acc 0 (the default)
    the main loop 609 -> 526 instructions, 255 registers and a 32-byte spill -> 242 and none; at None 322 -> 175
    (LDG 34 -> 4, FMUL 64 -> 4), 255 -> 180 registers; at 32 531 -> 390 (but a 56-byte spill; at BLOCK_N 64 316
    -> 236 instructions, 172 -> 128 registers)."""
    if SCALAR_B_SCALE:
        b_s = tl.load(bs_ptr + ((n_first + N_ROW_OFFSET) // BLOCK_N_SCALE) * stride_bsn + kg)
        s = (a_s * b_s)[:, None]
    else:
        b_s = tl.load(bs_ptr + ((offs_bn + N_ROW_OFFSET) // BLOCK_N_SCALE) * stride_bsn + kg)  # [BLOCK_N]
        s = a_s[:, None] * b_s[None, :]
    return s


@fast_launch
@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [M_a, K] rows: tokens (gate+up, A_ROW_DIV = k) or (token, k) pairs (down, A_ROW_DIV = 1)
    b_ptr,  # [E, N_b, K] expert weights, rows are output columns (N_b = 2N with SILU_AND_MUL); int: packed K
    c_ptr,  # [T*k, N] one row per (token, k) pair
    a_scale_ptr,  # fp8: [M_a, K / QUANT_GROUP] float32 activation scales (else a stands in, never read)
    b_scale_ptr,  # int: [E, N_b, G]; fp8: [E, N_b / BLOCK_N_SCALE, K / QUANT_GROUP] (else unread)
    b_zero_ptr,  # int with zero points: uint8 [E, N_b, G]
    b_gidx_ptr,  # int act order: int32 [E, K]
    topk_weights_ptr,  # [T*k]
    sorted_token_ids_ptr,  # [S] int32
    expert_ids_ptr,  # [S / BLOCK_M] int32
    num_tokens_post_padded_ptr,  # [1] int32
    N,
    K,
    num_rows,  # S: the padded bound the grid was sized by
    num_valid,  # T*k: pair ids at or past it are padding
    QUANT_GROUP,  # K elements per scale group (int) / activation group (fp8)
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_bse,
    stride_bsn,
    stride_bze,
    stride_bzn,
    stride_bge,
    A_ROW_DIV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,  # BLOCK_K divides K: no masks in the main loop
    SILU_AND_MUL: tl.constexpr,  # b holds gate rows [0, N) then up rows [N, 2N): c = silu(gate) * up
    MUL_ROUTED_WEIGHT: tl.constexpr,
    WEIGHT_QUANT: tl.constexpr,  # 0: weights in a's dtype; 1: packed integers (W4A16/W8A16); 2: fp8 (W8A8)
    BITS: tl.constexpr,  # WEIGHT_QUANT 1: 4 or 8
    HAS_ZP: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    BLOCK_N_SCALE: tl.constexpr,  # WEIGHT_QUANT 2: rows per scale block (1: per channel)
    SCALAR_B_SCALE: tl.constexpr,  # WEIGHT_QUANT 2: BLOCK_N divides BLOCK_N_SCALE and N (one scale a tile)
    GROUP_BLOCKS: tl.constexpr,  # WEIGHT_QUANT 2: K blocks per scale group (the group's index by shifts)
    ACT_KIND: tl.constexpr,  # the activations' dtype when a is fp8: 1 bf16, 2 fp16, 3 fp32 (0: a's own)
    INTERPRET_BF16: tl.constexpr,  # the interpreter's bf16 dot and rounding are wrong: fp32 dot, RNE by hand
    FP32_DOT: tl.constexpr,  # WEIGHT_QUANT 2 with BLOCK_K under quant_fp8.FP8_DOT_MIN_K: the product in fp32
    DOT_PRECISION: tl.constexpr,
    MAX_IMPRECISE_ACC: tl.constexpr,  # WEIGHT_QUANT 2: the fp8 dots' (quant_fp8.FP8_DOT_MAX_IMPRECISE_ACC)
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py): before the routing's reads
    INT_ROWS: tl.constexpr = False,  # WEIGHT_QUANT 1 without g_idx: the tiles loaded as rows (INT_ROWS above)
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    # L2 reuse: GROUP_M consecutive row blocks (mostly one expert) sweep the N tiles together
    num_pid_m = tl.cdiv(num_rows, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_id = pid // (GROUP_M * num_pid_n)
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % (GROUP_M * num_pid_n)) % group_size_m
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size_m
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return  # past the real padded length: the grid is sized by the bound, not by the routing

    pair = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_valid = pair < num_valid
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    n_first = pid_n * BLOCK_N
    offs_n = n_first + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_bn = offs_n % N  # wrapped columns load real rows and are never stored: no mask on b
    a_rows = tl.where(row_valid, pair // A_ROW_DIV, 0).to(tl.int64)  # [BLOCK_M]
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + tl.arange(0, BLOCK_K)[None, :]  # [BLOCK_M, BLOCK_K]
    b_exp = b_ptr + expert * stride_be
    bs_exp = b_scale_ptr + expert * stride_bse
    bz_exp = b_zero_ptr + expert * stride_bze
    bg_exp = b_gidx_ptr + expert * stride_bge
    if ACT_KIND == 1:
        act_ty = tl.bfloat16
    elif ACT_KIND == 2:
        act_ty = tl.float16
    elif ACT_KIND == 3:
        act_ty = tl.float32
    else:
        act_ty = a_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # padding rows read row 0 (a_rows) and are never stored: only K's tail needs a mask, and not even
        # that when BLOCK_K divides K (every real shape): fewer predicate and address registers
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        if EVEN_K:
            a = tl.load(a_ptrs)  # [BLOCK_M, BLOCK_K]
        else:
            a = tl.load(a_ptrs, mask=k_valid[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        b = _b_tile(
            b_exp, bs_exp, bz_exp, bg_exp, offs_bn, offs_k, k0, k_valid, 0, stride_bn, stride_bsn, stride_bzn,
            QUANT_GROUP, K, EVEN_K, WEIGHT_QUANT, BITS, HAS_ZP, HAS_GIDX, INT_ROWS, act_ty, INTERPRET_BF16,
        )  # fmt: skip
        if INTERPRET_BF16 or FP32_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if WEIGHT_QUANT == 2:  # a block's product (fp8 tensor cores), scaled by the token's and the block's
            kg = k0 // BLOCK_K // GROUP_BLOCKS  # the scale group (constexpr powers of 2: shifts)
            a_s = tl.load(a_scale_ptr + a_rows * stride_asm + kg)  # [BLOCK_M]
            s = _fp8_scale(a_s, bs_exp, offs_bn, n_first, 0, kg, stride_bsn, BLOCK_N_SCALE, SCALAR_B_SCALE)
            acc += tl.dot(a, b, max_num_imprecise_acc=MAX_IMPRECISE_ACC) * s
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if SILU_AND_MUL:  # the same a tile feeds the up half: x is read once for both
            b_up = _b_tile(
                b_exp, bs_exp, bz_exp, bg_exp, offs_bn, offs_k, k0, k_valid, N, stride_bn, stride_bsn,
                stride_bzn, QUANT_GROUP, K, EVEN_K, WEIGHT_QUANT, BITS, HAS_ZP, HAS_GIDX, INT_ROWS, act_ty,
                INTERPRET_BF16,
            )  # fmt: skip
            if INTERPRET_BF16 or FP32_DOT:
                b_up = b_up.to(tl.float32)
            if WEIGHT_QUANT == 2:
                s_up = _fp8_scale(
                    a_s, bs_exp, offs_bn, n_first, N, kg, stride_bsn, BLOCK_N_SCALE, SCALAR_B_SCALE
                )
                acc_up += tl.dot(a, b_up, max_num_imprecise_acc=MAX_IMPRECISE_ACC) * s_up
            else:
                acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K

    # round where HF does: each projection to the activation dtype, silu, the product, the weighted output
    c_ty = c_ptr.dtype.element_ty
    if SILU_AND_MUL:
        gate = _rounded(acc, act_ty, INTERPRET_BF16)  # [BLOCK_M, BLOCK_N]
        up = _rounded(acc_up, act_ty, INTERPRET_BF16)
        res = _rounded(gate / (1.0 + tl.exp(-gate)), act_ty, INTERPRET_BF16) * up
    else:
        res = acc
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + pair, mask=row_valid, other=0.0).to(tl.float32)  # [BLOCK_M]
        res = _rounded(res, act_ty, INTERPRET_BF16) * w[:, None]  # product in c's dtype (bf16; fp32: Mixtral)
    res = _rounded(res, c_ty, INTERPRET_BF16)  # [BLOCK_M, BLOCK_N]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]  # [BLOCK_M, BLOCK_N]
    tl.store(c_ptrs, res.to(c_ty), mask=row_valid[:, None] & (offs_n < N)[None, :])


_ACT_KIND = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


def tile_switches(
    weight_quant: int, group: int, k: int, n: int, block_n_scale: int, cfg: dict[str, int]
) -> dict[str, int | bool]:
    """The constexprs that follow from a launch's tile `cfg` (BLOCK_N, BLOCK_K) for weights of `weight_quant`
    quantized in groups of `group` along K and scale blocks of `block_n_scale` rows, over [n, k]: fp8's
    GROUP_BLOCKS (K blocks an activation group: a K block lies in one, fused_moe.fit_block_k; one group over all of
    K, per channel, is index 0 throughout, by a shift past any K: one variant for every K), SCALAR_B_SCALE (one
    weight scale a tile) and FP32_DOT (K steps sm90's fp8 dot refuses). moe_gemm's launch and the compile check's
    GPU variants (testing/gpu_tiles.py) both take them from here."""
    fp8, block_n, block_k = weight_quant == 2, cfg["BLOCK_N"], cfg["BLOCK_K"]
    return {
        "GROUP_BLOCKS": (group // block_k if group < k else 1 << 30) if fp8 else 1,
        "SCALAR_B_SCALE": fp8 and block_n_scale % block_n == 0 and n % block_n == 0,
        "FP32_DOT": fp8 and block_k < quant_fp8.FP8_DOT_MIN_K,
    }


def moe_gemm(
    a: torch.Tensor,  # [M_a, K] (fp8 experts: e4m3, with a_scale)
    b: torch.Tensor,  # [E, N_b, K] (int: uint8 [E, N_b, K * bits / 8])
    c: torch.Tensor,  # [T*k, N]
    topk_weights: torch.Tensor,  # [T*k]
    sorted_token_ids: torch.Tensor,  # [S] int32
    expert_ids: torch.Tensor,  # [S / BLOCK_M] int32
    num_tokens_post_padded: torch.Tensor,  # [1] int32
    a_row_div: int,
    cfg: dict[str, int],
    silu_and_mul: bool,
    mul_routed_weight: bool,
    quant: MoEQuant | None = None,
    proj: str = "w13",  # which projection's scales of `quant` b is
    a_scale: torch.Tensor | None = None,  # fp8: [M_a, K / group] float32
    act_dtype: torch.dtype | None = None,  # fp8: the activations' dtype before quantization
) -> None:
    """One grouped GEMM launch (tuner and benchmarks time the two separately)."""
    k = a.shape[1]
    assert a.stride(1) == 1 and b.stride(2) == 1 and c.stride(1) == 1
    n, num_rows = c.shape[1], sorted_token_ids.numel()
    interpret_bf16 = interpreting() and (act_dtype or a.dtype) == torch.bfloat16
    weight_quant, bits, group, block_n = 0, 8, 0, 1
    scale = zero = gidx = b
    if quant is not None:
        weight_quant, bits, group = (1 if quant.is_int else 2), quant.bits, quant.group(k)
        block_n = quant.block_n
        scale = getattr(quant, f"{proj}_scale")
        zero = getattr(quant, f"{proj}_zero")
        gidx = getattr(quant, f"{proj}_g_idx")
        zero = b if zero is None else zero
        gidx = b if gidx is None else gidx
        assert b.shape[2] * (8 // bits if quant.is_int else 1) == k, f"b {tuple(b.shape)} for K={k}"
    else:
        assert b.shape[2] == k
    has_zp = quant is not None and getattr(quant, f"{proj}_zero") is not None
    has_gidx = quant is not None and getattr(quant, f"{proj}_g_idx") is not None
    a_scale = a if a_scale is None else a_scale
    fp32 = (act_dtype or a.dtype) == torch.float32
    block_k = cfg["BLOCK_K"]
    assert weight_quant != 2 or group >= k or group % block_k == 0, (group, block_k)
    grid = (triton.cdiv(num_rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    pdl = use_pdl(a)
    _moe_gemm_kernel[grid](
        a, b, c, a_scale, scale, zero, gidx, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        n, k, num_rows, c.shape[0], group, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        a_scale.stride(0), scale.stride(0), scale.stride(1), zero.stride(0), zero.stride(1), gidx.stride(0),
        A_ROW_DIV=a_row_div, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k,
        GROUP_M=cfg["GROUP_M"], EVEN_K=k % cfg["BLOCK_K"] == 0, SILU_AND_MUL=silu_and_mul,
        MUL_ROUTED_WEIGHT=mul_routed_weight, WEIGHT_QUANT=weight_quant, BITS=bits, HAS_ZP=has_zp,
        HAS_GIDX=has_gidx, BLOCK_N_SCALE=block_n, **tile_switches(weight_quant, group, k, n, block_n, cfg),
        ACT_KIND=_ACT_KIND[act_dtype] if act_dtype else 0, INTERPRET_BF16=interpret_bf16,
        DOT_PRECISION="ieee" if fp32 else "tf32",  # the interpreter ignores it: no switch of its own
        MAX_IMPRECISE_ACC=quant_fp8.FP8_DOT_MAX_IMPRECISE_ACC if weight_quant == 2 else None, USE_PDL=pdl,
        INT_ROWS=INT_ROWS and weight_quant == 1 and not has_gidx, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], launch_pdl=pdl,
    )  # fmt: skip
