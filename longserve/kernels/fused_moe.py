"""Fused mixture-of-experts in Triton: block alignment of the routed tokens (moe_align.align_routed_pairs: the
one-launch kernel up to moe_align.MOE_TRITON_ALIGN_MAX_PAIRS pairs, the torch ops of `moe_align_ref` beyond),
two grouped GEMMs (gate+up with SiLU-and-mul in the epilogue, down with the routing
weights), the sum over k; reference: `fused_moe_ref`.

No host syncs anywhere (CUDA-graph safe): buffers are sized by their upper bound and programs past the real
padded length, read from a device tensor, exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels import quant_fp8
from longserve.kernels.extend_attention import interpreting
from longserve.kernels.launch import fast_launch, pdl_prologue, use_pdl
from longserve.kernels.moe_align import align_routed_pairs
from longserve.kernels.moe_config import get_moe_config
from longserve.kernels.moe_fp8_gemv import moe_fp8_gemv, moe_fp8_gemv_supported
from longserve.kernels.moe_reference import (
    MoEQuant,
    check_moe_args,
    fused_moe_ref,
    moe_align_block_size,
    padded_size_bound,
    route_topk,
)
from longserve.kernels.moe_sum import moe_sum
from longserve.kernels.moe_wna16 import (
    GROUPED_BLOCK_M,
    dequantize_experts,
    moe_wna16_gemv,
    moe_wna16_grouped,
    moe_wna16_path,
)
from longserve.kernels.quant_fp8 import per_token_group_quant
from longserve.kernels.quant_tiles import int_weight_tile
from longserve.kernels.quant_tiles import rounded as _rounded

__all__ = [
    "MoEQuant",
    "fused_moe",
    "fused_moe_ref",
    "moe_align_block_size",
    "padded_size_bound",
    "route_topk",
]


# A step of at most this many tokens, with experts neither quantized nor split over ranks, runs as
# kernels/moe_gemv.py's two launches (no alignment, the sum over k inside the down projection) instead of
# four. 0 (off): measured on an H200 (scripts/probes/moe_gemv_sweep.py, 2026-12-02, RESULTS.md fifth session)
# the A3B expert block took 36.6 us at one token against 34.0 here, and 4-8% less at 2-8 tokens.
MOE_GEMV_MAX_TOKENS = 0
# A step of at most this many tokens with block-FP8 experts (not split over ranks) runs as kernels/moe_fp8_gemv.py's
# routed GEMVs (four launches) instead of the alignment, two activation quantizations, the grouped GEMMs and the
# sum over k. Measured on an H200 (854fbd1, `gpu_check.sh fp8-moe-gemv`, RESULTS.md fourteenth session), the A3B
# expert block alone: 21.9 against 28.3 us at 1 token, 54.8 / 62.9 at 4, 155.1 / 133.0 at 16; the A3B FP8 decode
# with it up to 16 tokens: b1 (32K) 4.21 -> 4.04 ms, b8 (4K) 8.31 -> 8.06. 8: the largest size that gained.
FP8_MOE_GEMV_MAX_TOKENS = 8
# A step of at most this many tokens sums its pairs' 16-bit outputs over k with kernels/moe_sum.py instead of
# torch.sum (4.8 us a layer at batch 1 in the A3B decode, 2026-12-02 profile). Measured on an H200 (95cf20e,
# `gpu_check.sh dense-gemv`, RESULTS.md sixth session; both runs with the 16-bit GEMV since reverted): the A3B
# decode at batch 1 3.88 ms with it against 4.03 (4K), 4.71 against 4.87 (32K); at batch 8 11.06 against 11.16.
# Against that call's plain run (neither): 3.99 and 4.80 ms. 8: the largest batch measured.
MOE_SUM_TRITON_MAX_TOKENS = 8


@triton.jit
def _b_tile(
    b_ptr, bs_ptr, bz_ptr, bg_ptr, offs_bn, offs_k, k0, k_valid, N_ROW_OFFSET,
    stride_bn, stride_bsn, stride_bzn, QUANT_GROUP,
    EVEN_K: tl.constexpr, WEIGHT_QUANT: tl.constexpr, BITS: tl.constexpr, HAS_ZP: tl.constexpr,
    HAS_GIDX: tl.constexpr, BLOCK_N_SCALE: tl.constexpr,
):  # fmt: skip
    """One expert's weight tile [BLOCK_K, BLOCK_N] of output rows N_ROW_OFFSET + offs_bn (pointers already at
    the expert) and, for fp8, its block scale per column [BLOCK_N] (else a dummy 1)."""
    rows = offs_bn + N_ROW_OFFSET
    # one return at the end: compiled Triton (3.6) keeps generating the statements after a return taken in a
    # constexpr branch and then refuses the function for returning two types (the interpreter does not mind)
    if WEIGHT_QUANT == 1:  # packed integers: dequantized here, in float32
        true_n = offs_bn >= 0
        w = int_weight_tile(
            b_ptr, bs_ptr, bz_ptr, bg_ptr, rows, offs_k, k0, true_n, k_valid,
            stride_bn, stride_bsn, stride_bzn, QUANT_GROUP, BITS, HAS_ZP, HAS_GIDX,
        )  # fmt: skip
        scale = 1.0
    else:
        ptrs = b_ptr + rows[None, :] * stride_bn + offs_k[:, None]
        if EVEN_K:
            w = tl.load(ptrs)
        else:
            w = tl.load(ptrs, mask=k_valid[:, None], other=0.0)
        if WEIGHT_QUANT == 2:  # e4m3 with one scale per (block of rows, block of K)
            scale = tl.load(bs_ptr + (rows // BLOCK_N_SCALE) * stride_bsn + k0 // QUANT_GROUP)
        else:
            scale = 1.0
    return w, scale


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
    ACT_KIND: tl.constexpr,  # the activations' dtype when a is fp8: 1 bf16, 2 fp16, 3 fp32 (0: a's own)
    INTERPRET_BF16: tl.constexpr,  # the interpreter's bf16 dot and rounding are wrong: fp32 dot, RNE by hand
    UPCAST_DOT: tl.constexpr,  # the interpreter has no fp8 dot: both operands in fp32 (exact)
    DOT_PRECISION: tl.constexpr,
    MAX_IMPRECISE_ACC: tl.constexpr,  # WEIGHT_QUANT 2: the fp8 dots' (quant_fp8.FP8_DOT_MAX_IMPRECISE_ACC)
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py): before the routing's reads
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
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
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
        b, b_s = _b_tile(
            b_exp, bs_exp, bz_exp, bg_exp, offs_bn, offs_k, k0, k_valid, 0, stride_bn, stride_bsn, stride_bzn,
            QUANT_GROUP, EVEN_K, WEIGHT_QUANT, BITS, HAS_ZP, HAS_GIDX, BLOCK_N_SCALE,
        )  # fmt: skip
        if WEIGHT_QUANT == 1:  # dequantized weights meet the activations at their dtype
            b = _rounded(b, act_ty, INTERPRET_BF16)
            b = b if INTERPRET_BF16 else b.to(act_ty)
        if INTERPRET_BF16 or UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if WEIGHT_QUANT == 2:  # a block's product (fp8 tensor cores), scaled by the token's and the block's
            a_s = tl.load(a_scale_ptr + a_rows * stride_asm + k0 // QUANT_GROUP)  # [BLOCK_M]
            acc += tl.dot(a, b, max_num_imprecise_acc=MAX_IMPRECISE_ACC) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if SILU_AND_MUL:  # the same a tile feeds the up half: x is read once for both
            b_up, b_up_s = _b_tile(
                b_exp, bs_exp, bz_exp, bg_exp, offs_bn, offs_k, k0, k_valid, N, stride_bn, stride_bsn,
                stride_bzn, QUANT_GROUP, EVEN_K, WEIGHT_QUANT, BITS, HAS_ZP, HAS_GIDX, BLOCK_N_SCALE,
            )  # fmt: skip
            if WEIGHT_QUANT == 1:
                b_up = _rounded(b_up, act_ty, INTERPRET_BF16)
                b_up = b_up if INTERPRET_BF16 else b_up.to(act_ty)
            if INTERPRET_BF16 or UPCAST_DOT:
                b_up = b_up.to(tl.float32)
            if WEIGHT_QUANT == 2:
                acc_up += (
                    tl.dot(a, b_up, max_num_imprecise_acc=MAX_IMPRECISE_ACC) * a_s[:, None] * b_up_s[None, :]
                )
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
    grid = (triton.cdiv(num_rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    pdl = use_pdl(a)
    _moe_gemm_kernel[grid](
        a, b, c, a_scale, scale, zero, gidx, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        n, k, num_rows, c.shape[0], group, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        a_scale.stride(0), scale.stride(0), scale.stride(1), zero.stride(0), zero.stride(1), gidx.stride(0),
        A_ROW_DIV=a_row_div, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"], EVEN_K=k % cfg["BLOCK_K"] == 0, SILU_AND_MUL=silu_and_mul,
        MUL_ROUTED_WEIGHT=mul_routed_weight, WEIGHT_QUANT=weight_quant, BITS=bits, HAS_ZP=has_zp,
        HAS_GIDX=has_gidx, BLOCK_N_SCALE=block_n, ACT_KIND=_ACT_KIND[act_dtype] if act_dtype else 0,
        INTERPRET_BF16=interpret_bf16, UPCAST_DOT=interpreting() and weight_quant == 2,
        DOT_PRECISION="ieee" if fp32 or interpret_bf16 or interpreting() else "tf32",
        MAX_IMPRECISE_ACC=quant_fp8.FP8_DOT_MAX_IMPRECISE_ACC if weight_quant == 2 else None, USE_PDL=pdl,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=pdl,
    )  # fmt: skip


def fused_moe(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows [0, I), then up rows [I, 2I)
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float32, or the hidden dtype (Qwen-MoE)
    topk_ids: torch.Tensor,  # [T, k] int32 expert ids in [0, E)
    out: torch.Tensor | None = None,
    quant: MoEQuant | None = None,
    config: dict | None = None,
    expert_map: torch.Tensor | None = None,  # [E_global] int32: global expert id -> row of w13/w2, or -1
) -> torch.Tensor:
    """sum_k w_k * down_e(silu(gate_e x) * up_e x) per token, [T, H]: same contract as `fused_moe_ref`.

    Gate+up is one GEMM whose programs hold a gate tile and the matching up tile and write silu(gate) * up,
    so the [T*k, 2I] projection never reaches memory and x is read once for both halves. The down GEMM
    writes each pair's weighted output into [T*k, H] (in the promoted dtype of hidden and the weights, as
    HF multiplies), then a fixed-order sum over k in fp32 (deterministic, no atomics). `config`: a
    `get_moe_config` entry (BLOCK_M, ..., an optional "down" override). `quant` (MoEQuant): integer experts
    take kernels/moe_wna16.py's routed GEMV (or its grouped kernel) at decode sizes and are dequantized whole
    for prefill steps (no `config` given), otherwise are dequantized tile by tile inside the GEMMs; fp8 experts read activations
    quantized per token-group first (kernels/quant_fp8.py), and scale each block's product by both scales.

    `expert_map` (expert parallelism): pairs routed to another rank's expert (-1) are aligned as one extra
    expert E after the real ones, and the real padded length handed to the GEMMs stops before its blocks,
    so they are never computed (no host sync: the length is a device value); their rows of the pair
    buffer are zeros."""
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids, quant)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter = w13.shape[:2]
    hidden_size = hidden.shape[1]
    out = torch.empty_like(hidden) if out is None else out  # [T, H]
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    if num_tokens == 0:
        return out
    if quant is not None and quant.is_int and config is None:  # the ends of the token range: moe_wna16.py
        path = moe_wna16_path(
            quant, num_tokens, hidden.shape[1], w13.shape[1] // 2, expert_map is not None, hidden.dtype
        )
        if path == "gemv":
            return moe_wna16_gemv(hidden, w13, w2, topk_weights, topk_ids, quant, out)
        if path == "grouped":
            align = align_routed_pairs(topk_ids, w13.shape[0], GROUPED_BLOCK_M)
            return moe_wna16_grouped(hidden, w13, w2, topk_weights, quant, align, out)
        if path == "dequant":  # then the 16-bit kernels below
            w13, w2 = (
                dequantize_experts(quant, w, proj, hidden.dtype) for w, proj in ((w13, "w13"), (w2, "w2"))
            )
            quant = None
    if (
        num_tokens <= FP8_MOE_GEMV_MAX_TOKENS
        and quant is not None
        and expert_map is None
        and config is None
        and moe_fp8_gemv_supported(quant, hidden_size, two_inter // 2)
    ):
        return moe_fp8_gemv(hidden, w13, w2, topk_weights, topk_ids, quant, out)
    if num_tokens <= MOE_GEMV_MAX_TOKENS and quant is None and expert_map is None and config is None:
        from longserve.kernels.moe_gemv import moe_gemv

        return moe_gemv(hidden, w13, w2, topk_weights, topk_ids, out)
    cfg = config or get_moe_config(
        num_experts, two_inter // 2, hidden_size, top_k, hidden.dtype, num_tokens,
        weights=quant.weight_dtype if quant is not None else None,
    )  # fmt: skip
    down_cfg = {**cfg, **cfg.get("down", {}), "BLOCK_M": cfg["BLOCK_M"]}  # one alignment serves both
    if quant is not None:  # a K tile must lie in one scale group (int) / activation group (fp8)
        cfg = _fit_block_k(cfg, quant, hidden_size, quant.w13_g_idx is not None)
        down_cfg = _fit_block_k(down_cfg, quant, two_inter // 2, quant.w2_g_idx is not None)
    hidden, w13, w2 = (x if x.stride(-1) == 1 else x.contiguous() for x in (hidden, w13, w2))
    weights = topk_weights.reshape(-1)  # [T*k]
    if not weights.is_contiguous():
        weights = weights.contiguous()
    block_m = cfg["BLOCK_M"]
    sorted_ids, expert_ids, num_post = align_routed_pairs(topk_ids, num_experts, block_m, expert_map)
    num_pairs = num_tokens * top_k
    # expert parallel: the remote pairs' rows are never written; zeros keep them out of the sum over k (and
    # keep uninitialized memory out of the padding rows the down GEMM reads and discards)
    alloc = torch.empty if expert_map is None else torch.zeros
    inter = alloc(num_pairs, two_inter // 2, dtype=hidden.dtype, device=hidden.device)  # [T*k, I]
    prod_dtype = torch.promote_types(hidden.dtype, topk_weights.dtype)
    pair_out = alloc(num_pairs, hidden_size, dtype=prod_dtype, device=hidden.device)  # [T*k, H]
    routing = (weights, sorted_ids, expert_ids, num_post)
    if quant is not None and not quant.is_int:  # fp8 experts: each GEMM's activations quantized first
        a13, s13 = per_token_group_quant(hidden, quant.group_size)
        moe_gemm(a13, w13, inter, *routing, top_k, cfg, True, False, quant, "w13", s13, hidden.dtype)
        a2, s2 = per_token_group_quant(inter, quant.group_size)
        moe_gemm(a2, w2, pair_out, *routing, 1, down_cfg, False, True, quant, "w2", s2, hidden.dtype)
    else:
        moe_gemm(hidden, w13, inter, *routing, top_k, cfg, True, False, quant, "w13")
        moe_gemm(inter, w2, pair_out, *routing, 1, down_cfg, False, True, quant, "w2")
    per_token = pair_out.view(num_tokens, top_k, hidden_size)  # [T, k, H]
    if prod_dtype == out.dtype and num_tokens <= MOE_SUM_TRITON_MAX_TOKENS:
        moe_sum(per_token, out)  # the same sum in one small launch
    elif prod_dtype == out.dtype:
        torch.sum(per_token, dim=1, out=out)  # 16-bit inputs accumulate in fp32, rounded once (as HF)
    else:
        out.copy_(per_token.sum(dim=1))  # fp32 products (Mixtral): sum in fp32, round once
    return out


def _fit_block_k(cfg: dict, quant: MoEQuant, k: int, has_gidx: bool) -> dict:
    """BLOCK_K dividing the projection's scale group (no limit when one group spans K or g_idx is read per
    column), at least 16 for tl.dot."""
    group = quant.group(k)
    if group >= k or (quant.is_int and has_gidx):
        return cfg
    block_k = cfg["BLOCK_K"]
    while block_k > 16 and group % block_k:
        block_k //= 2
    if group % block_k:
        raise ValueError(f"quantization group {group} is not a multiple of 16")
    return {**cfg, "BLOCK_K": block_k}
