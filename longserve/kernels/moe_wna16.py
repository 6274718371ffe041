"""Integer-weight experts (W4A16 / W8A16: GPTQ, AWQ, compressed-tensors pack-quantized MoE) at the two ends of
the token range, where `fused_moe`'s int path is slowest. Its tiles unpack the packed weights byte by byte and
dequantize them in fp32 once per BLOCK_M block of (token, expert) pairs: measured on an H200 (2026-12-02,
35fd681, RESULTS.md seventh session) the Qwen3-30B-A3B shape with GPTQ int4 g128 experts took 33.2 ms a decode
step at batch 1 (32K context; bf16 4.66) and 4.94 s for a cold 32K prompt (bf16 1.10).

- Decode (4-bit groups of whole tiles; below MOE_WNA16_GROUPED_MIN_TOKENS tokens, or up to
  MOE_WNA16_GEMV_MAX_TOKENS where the grouped kernel does not apply): kernels/int4_gemv.py's
  one-row GEMV routed over the (token, k) pairs, grid axis 2: gate+up [T*k, 2I] (each pair's token row times its
  expert's w13), silu(gate) * up, down [T*k, H] (each pair's row times its expert's w2), then moe_sum adds the
  k rows times their routing weights. Four launches: the split-K partials of each GEMV are added by the launch
  after it (silu * up; moe_sum), not by reductions of their own (six launches at `c9a2ca1`, where one token
  took 19.5 us a layer, the 8 experts' 18.9 MB at ~1 TB/s: launch-bound). Each pair reads its expert's packed
  weights once: at batch 1 the bytes of the 8 experts touched, a quarter of bf16's.
- Mid-sized steps of 4-bit experts (past the grouped kernel's range or where it does not apply, up to
  MOE_WNA16_ROWS_MAX_PER_EXPERT rows an expert): fused_moe's int path with its tiles loaded as rows
  (moe_gemm.INT_ROWS), which reads the packed experts and writes nothing back (one A3B layer at 512 tokens: 444 us
  against 1,154-1,180 us dequantized, on an H100).
- Prefill (at least MOE_WNA16_DEQUANT_MIN_TOKENS tokens past the rows' range; past MOE_WNA16_GEMV_MAX_TOKENS where
  the grouped kernel does not apply for 8 bits): every expert dequantized to the activations' dtype
  (quant_gemm.wna16_dequantize, one launch a projection), then the 16-bit fused_moe, whose grouped GEMMs run at
  the tensor cores' bf16 rate. The dequantization is paid once a layer rather than once per block of pairs:
  at the A3B shape 0.3 GB read and 1.2 GB written a layer (~0.4 ms at 4.2 TB/s) against a 16-bit MoE layer's
  ~2 ms at 8K tokens. The transient [E, 2I, H] + [E, H, I] (1.2 GB at the A3B shape) comes out of the memory
  --mem-fraction-static leaves to activations, as the dense layers' dequantized weights do (quant_gemm).
- Grouped (4 bits in groups of 128, 16-bit activations; from MOE_WNA16_GROUPED_MIN_TOKENS, 16, below the
  dequantized experts): the pairs aligned per expert
  in blocks of GROUPED_BLOCK_M (fused_moe's alignment), each block's rows times its expert's weights with
  int4_gemv's word-wise unpacking on the tensor cores (int4_dot_tile): each expert's weights read once per
  block instead of once per pair (A3B int4 decode at batch 64: 31.81 -> 20.58 ms a step).
- Otherwise (act order, experts split over ranks, or decode sizes with no GEMV tile: 8 bits, groups the tile
  does not fit) fused_moe's int path serves, by rows where it has no act order.

Rounding: the dequantize path equals `fused_moe_ref` as the 16-bit fused_moe does (the weights rounded to the
dtype, as the reference rounds them). The GEMV keeps (q - z) * s in fp32 instead of rounding each weight to
the dtype first (as the dense GEMV: quant_gemv.py's docstring), then rounds each projection, silu(gate) * up,
the weighted products and their sum where the reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels import int4_gemv, quant_gemv, split_k
from longserve.kernels.extend_attention import interpreting
from longserve.kernels.int4_gemv import int4_dot_tile, int4_fast_block_n, int4_gemv_kernel, int4_tile_load
from longserve.kernels.launch import fast_launch, use_pdl
from longserve.kernels.moe_reference import MoEQuant
from longserve.kernels.moe_sum import moe_sum
from longserve.kernels.quant_gemm import wna16_dequantize
from longserve.kernels.quant_gemv import _tile_k
from longserve.kernels.quant_tiles import rounded
from longserve.kernels.split_k import split_k_output, splits_for

__all__ = [
    "GROUPED_BLOCK_M",
    "MOE_WNA16_DEQUANT_MIN_TOKENS",
    "MOE_WNA16_GEMV_MAX_TOKENS",
    "MOE_WNA16_GROUPED_MIN_TOKENS",
    "MOE_WNA16_PREFILL",
    "dequantize_experts",
    "moe_wna16_gemv",
    "moe_wna16_grouped",
    "moe_wna16_path",
    "silu_mul_partials",
]

# Which path a step of T tokens takes (moe_wna16_path): the routed GEMV below MOE_WNA16_GROUPED_MIN_TOKENS,
# the grouped kernel from there below MOE_WNA16_DEQUANT_MIN_TOKENS, the dequantized experts from there.
# Measured on an H200, one A3B MoE layer as CUDA graphs (tests/gpu/test_quant_kernels_gpu.py
# test_int4_experts_paths; 2026-12-02, c2dd2fd, RESULTS.md eighth session), us, GEMV / grouped / dequantized /
# fused int path: 1 token 19.6 / 46.4 / 562 / 267; 8: 88.4 / 181 / 697 / 5,705; 64: 481 / 385 / 813 / 2,937;
# 512: 3,618 / 1,398 / 1,001 / 1,637. In the engine (A3B int4 decode, ms a step, GEMV or dequantized ->
# grouped): batch 8 7.07 -> 7.28, 16 10.32 -> 8.97, 32 18.10 -> 14.86, 64 31.81 -> 20.58, 128 (dequantized)
# 42.78 -> 28.89, 256 (dequantized) 59.32 -> 55.36. The grouped kernel reads each expert once per block of
# GROUPED_BLOCK_M pairs routed to it (int4_gemv.int4_dot_tile on the tensor cores), where the GEMV reads it
# once per pair (at batch 64 the A3B shape's 512 pairs re-read ~1.2 GB a layer, 4x the experts' 0.3 GB).
# 257: the first size not timed in the engine (at 512 tokens the layer favoured the dequantized experts over the
# int path as it then was, by columns; by rows it takes 4-bit steps up to MOE_WNA16_ROWS_MAX_PER_EXPERT, below).
MOE_WNA16_GEMV_MAX_TOKENS = 64
MOE_WNA16_GROUPED_MIN_TOKENS: int | None = 16  # None: the GEMV up to MOE_WNA16_GEMV_MAX_TOKENS
MOE_WNA16_DEQUANT_MIN_TOKENS = 257
# What serves from MOE_WNA16_DEQUANT_MIN_TOKENS: "dequant" (the experts dequantized, then the 16-bit kernel) or
# "fused" (fused_moe's int path, which dequantizes each tile as it loads it: no 1.2 GB a layer written and read back
# at the A3B shape; with moe_gemm.INT_ROWS its tiles load each packed byte once). At prefill chunks it loses even
# by rows with tuned tiles: the A3B int4 cold 8K / 32K 0.1859 / 1.2596 s against 0.1800 / 1.2408 dequantized, and
# 1.2575 against 1.2410 without the int-to-float conversion (H100, `gpu_check.sh int4-fused-prefill`, RESULTS.md
# thirty-seventh and thirty-eighth sessions).
MOE_WNA16_PREFILL = "dequant"
# Up to this many (token, expert) rows an expert on average (T * top_k / E) from MOE_WNA16_DEQUANT_MIN_TOKENS, 4-bit
# experts take fused_moe's int path by rows (moe_gemm.INT_ROWS) rather than the dequantized experts: the
# dequantization is a fixed ~0.6 ms a layer at the A3B shape (1.2 GB written) that a step of a few hundred tokens
# does not amortize, and its rate is the rows an expert's weights serve. One Qwen3-30B-A3B layer (128 experts, top 8)
# as CUDA graphs on an H100 (test_int_rows_in_the_fused_int_path, two calls): 512 tokens (32 rows an expert) 444 us by
# rows against 1,154-1,180 dequantized, 4,096 (256) 1,638-1,654 against 1,700-1,759; at its cold 8K in the engine (one
# step of 8,192: 512 rows) the dequantized experts win (0.1800 against 0.1859 s with tuned row tiles, thirty-seventh
# session). The seed's Qwen3.5-35B-A3B (256 experts, top 8; H100, fifty-third session, `queue.sh int4-rows-a3b35`,
# one process a bound): a cold 8K (one step: 256 rows) 0.1806 s dequantized against 0.1738 / 0.1743 by rows, a cold
# 32K (its chunks longer than 8,192 tokens, up to 1,024 rows) 0.6454 dequantized against 0.7175 by rows. So a bound
# in rows, not tokens (it was 4,096 tokens: 128 rows an expert for the seed's model). 0: off.
MOE_WNA16_ROWS_MAX_PER_EXPERT = 256
GROUPED_BLOCK_M = 16
# the pairs aligned per expert in blocks of GROUPED_BLOCK_M (moe_align.align_routed_pairs): sorted pair ids,
# each block's expert, the padded length
Alignment = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _gemv_tile_k(quant: MoEQuant, k: int) -> int:
    """The routed GEMV's K tile for a projection over k (0: it cannot take it): int4_gemv's, a power of two
    of at least 16 values within one scale group, dividing K."""
    block_k = _tile_k(quant.group(k), k, 128)
    return block_k if block_k and k % block_k == 0 else 0


def moe_wna16_path(
    quant: MoEQuant,
    num_tokens: int,
    hidden_size: int,
    inter: int,
    distributed: bool,  # experts split over ranks (an expert map): remote pairs carry no local expert
    dtype: torch.dtype,  # the activations'
    num_experts: int,
    top_k: int,
) -> str:
    """Which path serves integer experts for a step of num_tokens: "gemv", "grouped", "dequant" or "fused"."""
    if not quant.is_int or distributed or quant.w13_g_idx is not None or quant.w2_g_idx is not None:
        return "fused"
    # what serves where the experts would otherwise be dequantized whole: 4 bits by rows up to
    # MOE_WNA16_ROWS_MAX_PER_EXPERT rows an expert (the dequantization's fixed cost weighs more at fewer), else the
    # dequantized experts
    by_rows = quant.bits == 4 and num_tokens * top_k <= MOE_WNA16_ROWS_MAX_PER_EXPERT * num_experts
    dequant_or_rows = "fused" if by_rows else "dequant"
    if num_tokens >= MOE_WNA16_DEQUANT_MIN_TOKENS:
        return "fused" if MOE_WNA16_PREFILL == "fused" else dequant_or_rows
    grouped_from = MOE_WNA16_GROUPED_MIN_TOKENS
    grouped_ok = dtype != torch.float32 and grouped_supported(quant, hidden_size, inter)  # 16-bit dots
    if grouped_from is not None and num_tokens >= grouped_from and grouped_ok:
        return "grouped"
    if num_tokens > MOE_WNA16_GEMV_MAX_TOKENS:  # past the GEMV's sizes without the grouped kernel
        return dequant_or_rows
    gemv_ok = quant.bits == 4 and _gemv_tile_k(quant, hidden_size) and _gemv_tile_k(quant, inter)
    return "gemv" if gemv_ok else "fused"


def grouped_supported(quant: MoEQuant, hidden_size: int, inter: int) -> bool:
    """The grouped kernel's tiles: 4 bits in groups of whole 128-value tiles along both projections' K."""
    return quant.bits == 4 and all(_gemv_tile_k(quant, k) == 128 for k in (hidden_size, inter))


def dequantize_experts(quant: MoEQuant, w: torch.Tensor, proj: str, dtype: torch.dtype) -> torch.Tensor:
    """The experts of projection `proj` ("w13" / "w2") of packed w [E, N, K * bits / 8] in `dtype` [E, N, K]:
    one launch over all E * N rows (the layout is per row; no act order)."""
    num_experts, n, packed = w.shape
    k = packed * 8 // quant.bits
    scale, zero = getattr(quant, f"{proj}_scale"), getattr(quant, f"{proj}_zero")
    flat = wna16_dequantize(
        w.reshape(num_experts * n, packed),
        scale.reshape(num_experts * n, -1),
        None if zero is None else zero.reshape(num_experts * n, -1),
        None,
        quant.bits,
        quant.group(k),
        dtype,
    )  # [E * N, K]
    return flat.view(num_experts, n, k)


@fast_launch
@triton.jit
def _silu_mul_kernel(
    x_ptr,  # [S, P, 2I]: gate|up rows, S split-K partial sums (fp32), or S = 1 rows in out's dtype
    out_ptr,  # [P, I]
    inter,
    num_splits,
    stride_xs,
    stride_xp,
    stride_op,
    BLOCK: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
):
    """silu(gate) * up of each pair, rounded as activation.silu_and_mul (silu to the dtype, the product
    again; by hand under the interpreter), after summing the partials in split order and rounding the
    projections to the dtype (split_k.splitk_reduce's result): one launch for both."""
    pair = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    ty = out_ptr.dtype.element_ty
    row = x_ptr + pair * stride_xp + cols
    gate = tl.zeros([BLOCK], dtype=tl.float32)
    up = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, num_splits):  # in order: deterministic
        gate += tl.load(row + s * stride_xs, mask=mask, other=0.0).to(tl.float32)
        up += tl.load(row + s * stride_xs + inter, mask=mask, other=0.0).to(tl.float32)
    gate, up = rounded(gate, ty, INTERPRET_BF16), rounded(up, ty, INTERPRET_BF16)
    act = rounded(gate / (1.0 + tl.exp(-gate)), ty, INTERPRET_BF16)
    tl.store(out_ptr + pair * stride_op + cols, rounded(act * up, ty, INTERPRET_BF16).to(ty), mask=mask)


def _routed_gemv(
    x: torch.Tensor,  # [rows, K]
    w: torch.Tensor,  # [E, N, K / 2] uint8
    scale: torch.Tensor,  # [E, N, G]
    zero: torch.Tensor | None,  # [E, N, G] uint8
    ids: torch.Tensor,  # [P] int32: each output row's expert
    x_row_div: int,  # output row p reads x row p // x_row_div
    group: int,
    block_k: int,
) -> torch.Tensor:
    """Row p = x[p // x_row_div] @ dequantize(w[ids[p]])^T: [P, N] in x's dtype, or with split-K its fp32
    partial sums [S, P, N] (the consumers add them: _silu_mul_kernel, moe_sum)."""
    num_rows, (_, n, packed) = ids.shape[0], w.shape
    k = packed * 2
    w = w if w.is_contiguous() else w.contiguous()
    assert x.stride(1) == 1 and w.data_ptr() % 16 == 0 and packed % 4 == 0, "rows of whole 32-bit words"
    sms = split_k.num_sms(x.device.index or 0) if x.device.type == "cuda" else 1
    if quant_gemv.INT4_MMA_ROUTED and x.is_cuda:  # the tensor cores' GEMV over the pairs (int4_mma_gemv.py)
        from longserve.kernels import int4_mma_gemv as mma

        if mma.supported() and mma.fits(x, w, None, 4, group, routed=True):
            num_steps = k // mma.K_STEP
            split = mma.splits(
                triton.cdiv(n, mma.block_n(1, routed=True)) * num_rows, num_steps, sms, 1, routed=True
            )
            steps_per_split, split, out = split_k_output(num_steps, split, num_rows, n, x.dtype, x.device)
            stride_os = out.stride(0) if split > 1 else 0
            mma.launch(x, w, scale, zero, None, group, steps_per_split, split, out, out, out, stride_os, False, False,
                       ids=ids, x_row_div=x_row_div)  # fmt: skip
            return out
    num_tiles = k // block_k
    block_n = min(int4_fast_block_n(n, num_tiles, num_rows, sms), max(16, triton.next_power_of_2(n)))
    n_blocks = triton.cdiv(n, block_n)
    split = splits_for(x.device, n_blocks * num_rows, num_tiles)
    tiles_per_split, split, out = split_k_output(num_tiles, split, num_rows, n, x.dtype, x.device)
    z = zero if zero is not None else scale
    pdl = use_pdl(x)
    int4_gemv_kernel[(n_blocks, split, num_rows)](
        x, w.view(torch.int32), scale, z, scale, ids, out, out, out, n, group, tiles_per_split, num_tiles,
        packed // 4, scale.stride(1), z.stride(1), out.stride(0) if split > 1 else 0,
        x.stride(0), out.stride(-2), w.stride(0) // 4, scale.stride(0), z.stride(0),
        HAS_ZP=zero is not None, HAS_BIAS=False, BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=split > 1,
        INTERPRET_BF16=interpreting() and x.dtype == torch.bfloat16, ROUTED=True, X_ROW_DIV=x_row_div,
        USE_RAW_HI=int4_gemv.INT4_GEMV_RAW_HI, USE_PDL=pdl, num_warps=4, num_stages=2, launch_pdl=pdl,
    )  # fmt: skip
    return out


@fast_launch
@triton.jit
def _grouped_int4_kernel(
    x_ptr,  # [rows, K] 16-bit
    w_ptr,  # [E, N, K / 8] int32
    s_ptr,  # [E, N, G]
    z_ptr,  # [E, N, G] uint8 (HAS_ZP)
    sorted_ptr,  # [S] int32 pair ids, each expert's padded to BLOCK_M (ids >= num_valid: padding)
    expert_ids_ptr,  # [S / BLOCK_M] int32
    num_post_ptr,  # [1] int32: the padded length the grid's bound covers
    out_ptr,  # [P, N] in x's dtype
    N, group_size, num_tiles, num_valid, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ze,
    stride_zn, stride_om,
    X_ROW_DIV: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, INTERPRET_FP32_DOT: tl.constexpr, INTERPRET_BF16: tl.constexpr,
):  # fmt: skip
    """Rows of a block of pairs routed to one expert times that expert's weights, tile by tile on the tensor
    cores (int4_gemv.int4_dot_tile) over the pairs' token rows (x row pair // X_ROW_DIV), each row rounded once
    to the dtype."""
    BLOCK_W: tl.constexpr = BLOCK_K // 8
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return  # past the real padded length: the grid is sized by the bound, not by the routing
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    valid = pair < num_valid
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W)
    n_mask = offs_n < N
    x_rows = x_ptr + tl.where(valid, pair // X_ROW_DIV, 0).to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_rows = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn  # [BLOCK_N, 1]
    s_exp, z_exp = s_ptr + expert * stride_se, z_ptr + expert * stride_ze
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # Loading the next tile before this one's math (prefetch) was measured slower here too on an H200 (187 -> 236
    # us at 8 tokens, ninth session, RESULTS.md).
    for t in range(0, num_tiles):
        words, s_row, z = int4_tile_load(w_rows, s_exp, z_exp, offs_n, offs_w, n_mask, stride_sn, stride_zn,
                                         group_size, t, BLOCK_K, HAS_ZP)  # fmt: skip
        prod, x_sum = int4_dot_tile(
            words, x_rows + t * BLOCK_K + offs_w[None, :] * 8, valid, INTERPRET_FP32_DOT
        )
        acc += (prod - x_sum[:, None] * z[None, :]) * s_row[None, :]
    ty = out_ptr.dtype.element_ty
    out = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, rounded(acc, ty, INTERPRET_BF16).to(ty), mask=valid[:, None] & n_mask[None, :])


def _grouped_gemm(
    x: torch.Tensor,  # [rows, K] 16-bit
    w: torch.Tensor,  # [E, N, K / 2] uint8
    scale: torch.Tensor,  # [E, N, G]
    zero: torch.Tensor | None,  # [E, N, G] uint8
    align: Alignment,
    num_pairs: int,
    x_row_div: int,
    group: int,
) -> torch.Tensor:
    """[P, N] in x's dtype: row p = x[p // x_row_div] @ dequantize(w[expert of p])^T, grouped by expert."""
    sorted_ids, expert_ids, num_post = align
    _, n, packed = w.shape
    w = w if w.is_contiguous() else w.contiguous()
    assert x.stride(1) == 1 and w.data_ptr() % 16 == 0 and packed % 4 == 0, "rows of whole 32-bit words"
    out = torch.empty(num_pairs, n, dtype=x.dtype, device=x.device)
    block_n = 64
    z = zero if zero is not None else scale
    interp = interpreting()
    _grouped_int4_kernel[(triton.cdiv(sorted_ids.numel(), GROUPED_BLOCK_M), triton.cdiv(n, block_n))](
        x, w.view(torch.int32), scale, z, sorted_ids, expert_ids, num_post, out, n, group, packed * 2 // 128,
        num_pairs, x.stride(0), w.stride(0) // 4, packed // 4, scale.stride(0), scale.stride(1), z.stride(0),
        z.stride(1), out.stride(0), X_ROW_DIV=x_row_div, HAS_ZP=zero is not None, BLOCK_M=GROUPED_BLOCK_M,
        BLOCK_N=block_n, BLOCK_K=128, INTERPRET_FP32_DOT=interp, INTERPRET_BF16=interp and x.dtype == torch.bfloat16,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return out


def moe_wna16_grouped(
    hidden: torch.Tensor,  # [T, H] 16-bit
    w13: torch.Tensor,  # [E, 2I, H / 2] uint8
    w2: torch.Tensor,  # [E, H, I / 2] uint8
    topk_weights: torch.Tensor,  # [T, k]
    quant: MoEQuant,
    align: Alignment,
    out: torch.Tensor,  # [T, H]
    addend: tuple[torch.Tensor, torch.Tensor] | None = None,  # fused_moe's
) -> torch.Tensor:
    """`fused_moe_ref`'s result for 4-bit experts with the pairs grouped by expert (after the alignment): gate+up,
    silu * up, down, the weighted k-sum; rounding as the GEMV's (the module docstring)."""
    num_tokens, top_k = topk_weights.shape
    hidden_size, inter = hidden.shape[1], w13.shape[1] // 2
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    num_pairs = num_tokens * top_k
    gate_up = _grouped_gemm(hidden, w13, quant.w13_scale, quant.w13_zero, align, num_pairs, top_k,
                            quant.group(hidden_size))  # fmt: skip
    act = silu_mul_partials(gate_up, inter, hidden.dtype)
    down = _grouped_gemm(act, w2, quant.w2_scale, quant.w2_zero, align, num_pairs, 1, quant.group(inter))
    return moe_sum(down.view(num_tokens, top_k, hidden_size), out, topk_weights.contiguous(), addend)


def silu_mul_partials(gate_up: torch.Tensor, inter: int, dtype: torch.dtype) -> torch.Tensor:
    """silu(gate) * up [P, I] in `dtype` of gate|up rows [S, P, 2I] (S split-K partials in fp32) or [P, 2I] (rows
    in the dtype), each projection rounded to the dtype first: one launch of _silu_mul_kernel."""
    gate_up = gate_up if gate_up.dim() == 3 else gate_up.unsqueeze(0)
    num_pairs = gate_up.shape[1]
    act = torch.empty(num_pairs, inter, dtype=dtype, device=gate_up.device)  # [P, I]
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(num_pairs, triton.cdiv(inter, block))](
        gate_up, act, inter, gate_up.shape[0], gate_up.stride(0), gate_up.stride(1), act.stride(0), BLOCK=block,
        INTERPRET_BF16=interpreting() and dtype == torch.bfloat16,
    )  # fmt: skip
    return act


def moe_wna16_gemv(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H / 2] uint8
    w2: torch.Tensor,  # [E, H, I / 2] uint8
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    quant: MoEQuant,
    out: torch.Tensor,  # [T, H]
    addend: tuple[torch.Tensor, torch.Tensor] | None = None,  # fused_moe's
) -> torch.Tensor:
    """`fused_moe_ref`'s result for 4-bit experts (the module docstring: rounding) in four launches, no host
    sync: gate+up, silu * up (adding gate+up's split-K partials), down, the weighted k-sum (adding down's, and
    the addend)."""
    num_tokens, top_k = topk_ids.shape
    hidden_size, inter = hidden.shape[1], w13.shape[1] // 2
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    ids = topk_ids.reshape(-1).to(torch.int32)  # [T*k], pair p = (token p // k, its j = p % k)
    gate_up = _routed_gemv(
        hidden, w13, quant.w13_scale, quant.w13_zero, ids, top_k, quant.group(hidden_size),
        _gemv_tile_k(quant, hidden_size),
    )  # fmt: skip
    act = silu_mul_partials(gate_up, inter, hidden.dtype)  # [T*k, I]
    down = _routed_gemv(
        act, w2, quant.w2_scale, quant.w2_zero, ids, 1, quant.group(inter), _gemv_tile_k(quant, inter)
    )  # [T*k, H], or its partials [S, T*k, H]
    rows = down.view(*down.shape[:-2], num_tokens, top_k, hidden_size)  # [(S,) T, k, H]
    return moe_sum(rows, out, topk_weights.contiguous(), addend)
