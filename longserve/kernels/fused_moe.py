"""Fused mixture-of-experts in Triton: block alignment of the routed tokens (moe_align.align_routed_pairs: the
one-launch kernel up to moe_align.MOE_TRITON_ALIGN_MAX_PAIRS pairs, the torch ops of `moe_align_ref` beyond),
two grouped GEMMs (kernels/moe_gemm.py: gate+up with SiLU-and-mul in the epilogue, down with the routing
weights), the sum over k; reference: `fused_moe_ref`. Small steps take the routed GEMVs instead
(moe_fp8_gemv.py, moe_wna16.py, moe_gemv.py).

No host syncs anywhere (CUDA-graph safe): buffers are sized by their upper bound and programs past the real
padded length, read from a device tensor, exit at once.
"""

from __future__ import annotations

import torch

from longserve.kernels.activation import sigmoid_gated_add
from longserve.kernels.moe_align import align_routed_pairs
from longserve.kernels.moe_config import get_moe_config
from longserve.kernels.moe_fp8_gemv import moe_fp8_gemv, moe_fp8_gemv_supported
from longserve.kernels.moe_gemm import moe_gemm
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
    addend: tuple[torch.Tensor, torch.Tensor] | None = None,  # (gate [T, 1], shared [T, H])
) -> torch.Tensor:
    """sum_k w_k * down_e(silu(gate_e x) * up_e x) per token, [T, H]: same contract as `fused_moe_ref`.
    `addend` (a Qwen-MoE block's shared expert): + sigmoid(gate) * shared in the k-sum's launch (moe_sum) where a
    path ends in one, else in activation.sigmoid_gated_add's after it.

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
            quant, num_tokens, hidden.shape[1], w13.shape[1] // 2, expert_map is not None, hidden.dtype,
            num_experts, top_k,
        )  # fmt: skip
        if path == "gemv":
            return moe_wna16_gemv(hidden, w13, w2, topk_weights, topk_ids, quant, out, addend)
        if path == "grouped":
            align = align_routed_pairs(topk_ids, w13.shape[0], GROUPED_BLOCK_M)
            return moe_wna16_grouped(hidden, w13, w2, topk_weights, quant, align, out, addend)
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
        return moe_fp8_gemv(hidden, w13, w2, topk_weights, topk_ids, quant, out, addend=addend)
    if num_tokens <= MOE_GEMV_MAX_TOKENS and quant is None and expert_map is None and config is None:
        from longserve.kernels.moe_gemv import moe_gemv  # its down GEMV sums over k: the addend after it

        return _plus(moe_gemv(hidden, w13, w2, topk_weights, topk_ids, out), addend)
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
        return moe_sum(per_token, out, addend=addend)  # the same sum in one small launch
    if prod_dtype == out.dtype:
        torch.sum(per_token, dim=1, out=out)  # 16-bit inputs accumulate in fp32, rounded once (as HF)
    else:
        out.copy_(per_token.sum(dim=1))  # fp32 products (Mixtral): sum in fp32, round once
    return _plus(out, addend)


def _plus(out: torch.Tensor, addend: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """out + sigmoid(gate) * shared in place (no addend: out)."""
    return out if addend is None else sigmoid_gated_add(out, *addend)


def _fit_block_k(cfg: dict, quant: MoEQuant, k: int, has_gidx: bool) -> dict:
    """BLOCK_K dividing the projection's scale group (no limit when one group spans K or g_idx is read per
    column), at least 16 for tl.dot."""
    group = quant.group(k)
    if group >= k or (quant.is_int and has_gidx):
        return cfg
    return {**cfg, "BLOCK_K": fit_block_k(cfg["BLOCK_K"], group)}


def fit_block_k(block_k: int, group: int) -> int:
    """block_k halved until it divides the group (a K tile within one scale / activation group), at least 16."""
    while block_k > 16 and group % block_k:
        block_k //= 2
    if group % block_k:
        raise ValueError(f"quantization group {group} is not a multiple of 16")
    return block_k
