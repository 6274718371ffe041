"""The fused MoE for a handful of tokens (decode at small batches) in two launches, with no alignment and no
separate sum over k: `fused_moe_ref`'s contract, for 16-bit or fp32 experts that are not quantized.

At batch 1 the A3B shape's MoE layer is four launches in `fused_moe` (align, gate+up, down, the sum over k),
each a few microseconds of mostly fixed cost on an H200 (2026-12-02 profile: the two GEMMs 12.9 us a launch,
the bf16 sum 4.8 us; 0.58 ms of a 4.31 ms step is gaps between kernels). Here:

  1. gate+up, one program per (pair, block of I): the pair's token row times its expert's gate and up rows,
     silu(gate) * up written to [T*k, I]. Each touched expert's w13 is read once per pair routed to it.
  2. down with the k-sum, one program per (token, block of H): for j = 0..k-1 in order, the pair's row of
     [T*k, I] times its expert's w2 block, rounded, times the routing weight, accumulated in fp32; the token's
     output rounded once. Deterministic; every pair's w2 block is read once.

Rounding as `fused_moe_ref` and `fused_moe`: each projection to the dtype, silu and the product, the down
projection, its product with the routing weight in the promoted dtype, the sum over k in fp32 rounded once.
Weights are re-read per pair, so past a few tokens (experts shared between them) `fused_moe`'s grouped GEMMs
read less: `MOE_GEMV_MAX_TOKENS` (kernels/fused_moe.py) picks. Measured on an H200 (2026-12-02, RESULTS.md
fifth session) they lose at one token and win 4-8% of the MoE block at 2-8: off until a kernel reads the
experts nearer the bandwidth (75.5 MB at 2.1 TB/s at one token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels.extend_attention import interpreting
from longserve.kernels.launch import fast_launch, pdl_prologue, use_pdl
from longserve.kernels.quant_tiles import rounded as _rounded

__all__ = ["moe_gemv"]


@fast_launch
@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H]
    w13_ptr,  # [E, 2I, H]
    ids_ptr,  # [T*k] int32
    inter_ptr,  # [T*k, I] out
    hidden_size,
    inter_size,
    stride_x,
    stride_we,
    stride_wn,
    stride_i,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    pdl_prologue(USE_PDL)
    pair = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of the gate half
    n_mask = offs_n < inter_size
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // TOP_K) * stride_x
    w = w13_ptr + expert * stride_we
    act_ty = inter_ptr.dtype.element_ty
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < hidden_size
        x = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
        tile = offs_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
        mask = n_mask[:, None] & k_mask[None, :]
        g = tl.load(w + tile, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(w + inter_size * stride_wn + tile, mask=mask, other=0.0).to(tl.float32)
        gate += tl.sum(g * x[None, :], 1)
        up += tl.sum(u * x[None, :], 1)
    gate = _rounded(gate, act_ty, INTERPRET_BF16)
    up = _rounded(up, act_ty, INTERPRET_BF16)
    res = _rounded(gate / (1.0 + tl.exp(-gate)), act_ty, INTERPRET_BF16) * up
    res = _rounded(res, act_ty, INTERPRET_BF16)
    tl.store(inter_ptr + pair * stride_i + offs_n, res.to(act_ty), mask=n_mask)


@fast_launch
@triton.jit
def _down_sum_kernel(
    inter_ptr,  # [T*k, I]
    w2_ptr,  # [E, H, I]
    ids_ptr,  # [T*k] int32
    weights_ptr,  # [T*k] routing weights (float32, or the hidden dtype)
    out_ptr,  # [T, H] out
    hidden_size,
    inter_size,
    stride_i,
    stride_we,
    stride_wn,
    stride_o,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PROD_FP32: tl.constexpr,  # the routing weight's product in fp32 (Mixtral's fp32 weights), else act dtype
    INTERPRET_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns
    n_mask = offs_n < hidden_size
    act_ty = inter_ptr.dtype.element_ty
    prod_ty = tl.float32 if PROD_FP32 else act_ty
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # in order: the sum over k is deterministic
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        a_row = inter_ptr + pair * stride_i
        w = w2_ptr + expert * stride_we
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter_size, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < inter_size
            a = tl.load(a_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
            b = tl.load(
                w + offs_n[:, None] * stride_wn + offs_k[None, :],
                mask=n_mask[:, None] & k_mask[None, :],
                other=0.0,
            ).to(tl.float32)  # [BLOCK_N, BLOCK_K]
            acc += tl.sum(b * a[None, :], 1)
        weight = tl.load(weights_ptr + pair).to(tl.float32)
        down = _rounded(acc, act_ty, INTERPRET_BF16) * weight  # in the promoted dtype, as fused_moe
        total += _rounded(down, prod_ty, INTERPRET_BF16)
    out = _rounded(total, out_ptr.dtype.element_ty, INTERPRET_BF16)
    tl.store(out_ptr + token * stride_o + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def moe_gemv(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k] int32
    out: torch.Tensor,  # [T, H]
    up: tuple[int, int, int] = (16, 128, 8),
    down: tuple[int, int, int] = (8, 128, 8),
) -> torch.Tensor:
    """`fused_moe` without quantization or expert parallelism, in two launches (module docstring). `up`,
    `down`: each kernel's (BLOCK_N, BLOCK_K, num_warps); the defaults were the fastest at 1-2 tokens on the
    A3B expert shape (scripts/probes/moe_gemv_sweep.py, H200, 2026-12-02: 36.6 us at one token against
    fused_moe's 34.0; blocks of 64 rows left most SMs idle, 10.1 ms a decode step against 3.98)."""
    num_tokens, top_k = topk_ids.shape
    hidden_size, inter_size = hidden.shape[1], w2.shape[2]
    assert w13.shape[1] == 2 * inter_size and w13.stride(2) == 1 and w2.stride(2) == 1
    x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    ids = topk_ids.reshape(-1)
    ids = ids if ids.dtype == torch.int32 and ids.is_contiguous() else ids.to(torch.int32).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    inter = torch.empty(num_tokens * top_k, inter_size, dtype=hidden.dtype, device=hidden.device)
    interpret_bf16 = interpreting() and hidden.dtype == torch.bfloat16
    pdl = use_pdl(x)
    _gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter_size, up[0]))](
        x, w13, ids, inter, hidden_size, inter_size, x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        TOP_K=top_k, BLOCK_N=up[0], BLOCK_K=up[1], INTERPRET_BF16=interpret_bf16, USE_PDL=pdl, num_warps=up[2],
        launch_pdl=pdl,
    )  # fmt: skip
    _down_sum_kernel[(num_tokens, triton.cdiv(hidden_size, down[0]))](
        inter, w2, ids, weights, out, hidden_size, inter_size, inter.stride(0), w2.stride(0), w2.stride(1),
        out.stride(0), TOP_K=top_k, BLOCK_N=down[0], BLOCK_K=down[1],
        PROD_FP32=torch.promote_types(hidden.dtype, topk_weights.dtype) == torch.float32,
        INTERPRET_BF16=interpret_bf16, USE_PDL=pdl, num_warps=down[2], launch_pdl=pdl,
    )  # fmt: skip
    return out
