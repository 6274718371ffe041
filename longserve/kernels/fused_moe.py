"""Fused mixture-of-experts in Triton: block alignment of the routed tokens, two grouped GEMMs (gate+up with
SiLU-and-mul in the epilogue, down with the routing weights), the sum over k; reference: `fused_moe_ref`.

No host syncs anywhere (CUDA-graph safe): buffers are sized by their upper bound and programs past the real
padded length, read from a device tensor, exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels.extend_attention import interpreting
from longserve.kernels.launch import fast_launch
from longserve.kernels.moe_config import get_moe_config
from longserve.kernels.moe_reference import MoEQuant, check_moe_args, fused_moe_ref, route_topk

__all__ = [
    "MoEQuant",
    "fused_moe",
    "fused_moe_ref",
    "moe_align_block_size",
    "padded_size_bound",
    "route_topk",
]


def padded_size_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Most sorted rows alignment can produce: each non-empty expert (at most min(E, pairs) of them) pads
    its rows up to a multiple of BLOCK_M, adding at most BLOCK_M - 1; rounded up to whole blocks."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def moe_align_block_size(
    topk_ids: torch.Tensor,  # [T, k] int
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the T*k (token, k) pairs by expert in blocks of `block_m` rows, on the device, no host sync.

    Returns sorted_token_ids [S] int32 (flat pair index token*k + j, pairs of one expert in token order,
    each expert's run padded to a multiple of block_m with the out-of-range id T*k; S =
    `padded_size_bound`), expert_ids [S / block_m] int32 (one expert per block; blocks past the real
    padded length get E and are never read) and num_tokens_post_padded [1] int32 (the real padded length)."""
    flat = topk_ids.reshape(-1).to(torch.int64)  # [P]
    num_pairs, dev = flat.numel(), flat.device
    size = padded_size_bound(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)  # [E]
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # integer adds: exact and deterministic
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    sorted_experts, order = torch.sort(flat, stable=True)  # [P] each: token order kept within an expert
    rank = torch.arange(num_pairs, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_experts]  # [P]
    dest = (padded_end - padded)[sorted_experts] + rank  # [P] row of each pair in the padded layout
    sorted_token_ids = torch.full((size,), num_pairs, dtype=torch.int32, device=dev)  # [S]
    sorted_token_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, size, block_m, device=dev)  # [S / block_m]
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)  # [S / block_m]
    return sorted_token_ids, expert_ids, padded_end[-1:].to(torch.int32)


@triton.jit
def _rounded(x, ty: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """fp32 x rounded to dtype ty (to nearest even), returned in fp32."""
    if ty == tl.float32:
        return x
    elif INTERPRET_BF16:  # the interpreter truncates fp32 -> bf16: round the bits by hand
        bits = x.to(tl.uint32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        return x.to(ty).to(tl.float32)


@fast_launch
@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [M_a, K] rows: tokens (gate+up, A_ROW_DIV = k) or (token, k) pairs (down, A_ROW_DIV = 1)
    b_ptr,  # [E, N_b, K] expert weights, rows are output columns (N_b = 2N with SILU_AND_MUL)
    c_ptr,  # [T*k, N] one row per (token, k) pair
    b_scale_ptr,  # [E, N_b, K / QUANT_GROUP] (quantized experts, not implemented: b stands in, never read)
    topk_weights_ptr,  # [T*k]
    sorted_token_ids_ptr,  # [S] int32
    expert_ids_ptr,  # [S / BLOCK_M] int32
    num_tokens_post_padded_ptr,  # [1] int32
    N,
    K,
    num_rows,  # S: the padded bound the grid was sized by
    num_valid,  # T*k: pair ids at or past it are padding
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    stride_bse,
    stride_bsn,
    A_ROW_DIV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,  # BLOCK_K divides K: no masks in the main loop
    SILU_AND_MUL: tl.constexpr,  # b holds gate rows [0, N) then up rows [N, 2N): c = silu(gate) * up
    MUL_ROUTED_WEIGHT: tl.constexpr,
    WEIGHT_QUANT: tl.constexpr,  # 0: weights in a's dtype; reserved: 1 int4 packed along K, 2 fp8
    QUANT_GROUP: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,  # the interpreter's bf16 dot and rounding are wrong: fp32 dot, RNE by hand
    DOT_PRECISION: tl.constexpr,
):
    tl.static_assert(WEIGHT_QUANT == 0, "quantized experts are not implemented yet")
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
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    a_rows = tl.where(row_valid, pair // A_ROW_DIV, 0).to(tl.int64)  # [BLOCK_M]
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + expert * stride_be + offs_bn[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # padding rows read row 0 (a_rows) and are never stored: only K's tail needs a mask, and not even
        # that when BLOCK_K divides K (every real shape): fewer predicate and address registers
        if EVEN_K:
            a = tl.load(a_ptrs)  # [BLOCK_M, BLOCK_K]
            b = tl.load(b_ptrs)  # [BLOCK_K, BLOCK_N]
        else:
            k_valid = offs_k < K - k0  # [BLOCK_K]
            a = tl.load(a_ptrs, mask=k_valid[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            b = tl.load(b_ptrs, mask=k_valid[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        if INTERPRET_BF16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if SILU_AND_MUL:  # the same a tile feeds the up half: x is read once for both
            if EVEN_K:
                b_up = tl.load(b_ptrs + N * stride_bn)  # [BLOCK_K, BLOCK_N]
            else:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=k_valid[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
            if INTERPRET_BF16:
                b_up = b_up.to(tl.float32)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    # round where HF does: each projection to the activation dtype, silu, the product, the weighted output
    act_ty = a_ptr.dtype.element_ty
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


def moe_gemm(
    a: torch.Tensor,  # [M_a, K]
    b: torch.Tensor,  # [E, N_b, K]
    c: torch.Tensor,  # [T*k, N]
    topk_weights: torch.Tensor,  # [T*k]
    sorted_token_ids: torch.Tensor,  # [S] int32
    expert_ids: torch.Tensor,  # [S / BLOCK_M] int32
    num_tokens_post_padded: torch.Tensor,  # [1] int32
    a_row_div: int,
    cfg: dict[str, int],
    silu_and_mul: bool,
    mul_routed_weight: bool,
) -> None:
    """One grouped GEMM launch (tuner and benchmarks time the two separately)."""
    assert a.stride(1) == 1 and b.stride(2) == 1 and c.stride(1) == 1 and b.shape[2] == a.shape[1]
    n, num_rows = c.shape[1], sorted_token_ids.numel()
    interpret_bf16 = interpreting() and a.dtype == torch.bfloat16
    grid = (triton.cdiv(num_rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _moe_gemm_kernel[grid](
        a, b, c, b, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        n, a.shape[1], num_rows, c.shape[0], a.stride(0), b.stride(0), b.stride(1), c.stride(0), 0, 0,
        A_ROW_DIV=a_row_div, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"], EVEN_K=a.shape[1] % cfg["BLOCK_K"] == 0, SILU_AND_MUL=silu_and_mul, MUL_ROUTED_WEIGHT=mul_routed_weight,
        WEIGHT_QUANT=0, QUANT_GROUP=0, INTERPRET_BF16=interpret_bf16,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 or interpret_bf16 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
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
) -> torch.Tensor:
    """sum_k w_k * down_e(silu(gate_e x) * up_e x) per token, [T, H]: same contract as `fused_moe_ref`.

    Gate+up is one GEMM whose programs hold a gate tile and the matching up tile and write silu(gate) * up,
    so the [T*k, 2I] projection never reaches memory and x is read once for both halves. The down GEMM
    writes each pair's weighted output into [T*k, H] (in the promoted dtype of hidden and the weights, as
    HF multiplies), then a fixed-order sum over k in fp32 (deterministic, no atomics). `config`: a
    `get_moe_config` entry (BLOCK_M, ..., an optional "down" override); `quant`: reserved, raises."""
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids, quant)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden_size = w13.shape
    out = torch.empty_like(hidden) if out is None else out  # [T, H]
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    if num_tokens == 0:
        return out
    cfg = config or get_moe_config(num_experts, two_inter // 2, hidden_size, top_k, hidden.dtype, num_tokens)
    down_cfg = {**cfg, **cfg.get("down", {}), "BLOCK_M": cfg["BLOCK_M"]}  # one alignment serves both
    hidden, w13, w2 = (x if x.stride(-1) == 1 else x.contiguous() for x in (hidden, w13, w2))
    weights = topk_weights.reshape(-1)  # [T*k]
    if not weights.is_contiguous():
        weights = weights.contiguous()
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, num_experts, cfg["BLOCK_M"])
    num_pairs = num_tokens * top_k
    inter = torch.empty(num_pairs, two_inter // 2, dtype=hidden.dtype, device=hidden.device)  # [T*k, I]
    prod_dtype = torch.promote_types(hidden.dtype, topk_weights.dtype)
    pair_out = torch.empty(num_pairs, hidden_size, dtype=prod_dtype, device=hidden.device)  # [T*k, H]
    moe_gemm(hidden, w13, inter, weights, sorted_ids, expert_ids, num_post, top_k, cfg, True, False)
    moe_gemm(inter, w2, pair_out, weights, sorted_ids, expert_ids, num_post, 1, down_cfg, False, True)
    per_token = pair_out.view(num_tokens, top_k, hidden_size)  # [T, k, H]
    if prod_dtype == out.dtype:
        torch.sum(per_token, dim=1, out=out)  # 16-bit inputs accumulate in fp32, rounded once (as HF)
    else:
        out.copy_(per_token.sum(dim=1))  # fp32 products (Mixtral): sum in fp32, round once
    return out
