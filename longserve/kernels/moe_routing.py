"""The MoE router's top-k in one Triton launch: router logits [T, E] -> (weights [T, k], ids [T, k] int32), what
`route_topk` (kernels/moe_reference.py) computes with 5-7 torch launches (the fp32 copy, softmax, top-k, the
sum and the division of the renormalization, the int32 ids, the weights' rounding for Qwen-MoE).

One program per token: its E logits in fp32, softmax (max, exp, sum) or sigmoid, then k rounds of argmax
(the lowest index among equal scores) that each take one expert out; the k weights renormalized by their sum
when asked, written in the caller's dtype (float32 for Mixtral, the logits' dtype for Qwen2/Qwen3-MoE, which
round them). The ids equal torch.topk's whenever no two scores tie at the k-th place; the weights equal the
reference's to fp32 rounding (exp and the sums round differently from torch's). The switch that uses it
(models/moe.py, MOE_TRITON_ROUTING_MAX_TOKENS) is set from an H200 measurement, and the MoE engine GPU test
(tests/gpu/test_moe_engine_gpu.py) checks a model's greedy output with it against the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels.launch import fast_launch, pdl_prologue, use_pdl

__all__ = ["route_topk_fused"]


@fast_launch
@triton.jit
def _route_topk_kernel(
    logits_ptr,  # [T, E]
    weights_ptr,  # [T, K] out (float32 or the logits' dtype)
    ids_ptr,  # [T, K] int32 out
    num_experts,
    stride_l,
    K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SOFTMAX: tl.constexpr,  # else sigmoid
    RENORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    x = tl.load(logits_ptr + row * stride_l + offs, mask=valid, other=0.0).to(tl.float32)  # [BLOCK_E]
    if SOFTMAX:
        x = tl.where(valid, x, float("-inf"))
        p = tl.exp(x - tl.max(x, 0))
        scores = p / tl.sum(p, 0)
    else:
        scores = 1.0 / (1.0 + tl.exp(-x))
    scores = tl.where(valid, scores, -1.0)  # below every real score (all >= 0)
    offs_k = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(scores, 0)
        idx = tl.min(tl.where(scores == best, offs, BLOCK_E), 0)  # the lowest index of the maximum
        w = tl.where(offs_k == j, best, w)
        ids = tl.where(offs_k == j, idx, ids)
        scores = tl.where(offs == idx, -2.0, scores)  # taken: below the padding too
    if RENORMALIZE:
        w = w / tl.sum(tl.where(offs_k < K, w, 0.0), 0)
    out = row * K + offs_k
    tl.store(weights_ptr + out, w.to(weights_ptr.dtype.element_ty), mask=offs_k < K)
    tl.store(ids_ptr + out, ids, mask=offs_k < K)


def route_topk_fused(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    weights_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_topk` (then `.to(weights_dtype)`) in one launch: (weights [T, k] in weights_dtype, ids [T, k]
    int32). No host sync."""
    assert router_logits.dim() == 2 and 1 <= top_k <= router_logits.shape[1], (
        f"logits {tuple(router_logits.shape)}, top_k {top_k}"
    )
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown MoE scoring {scoring!r} (softmax, sigmoid)")
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=weights_dtype, device=logits.device)  # [T, k]
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)  # [T, k]
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    pdl = use_pdl(logits)
    _route_topk_kernel[(num_tokens,)](
        logits, weights, ids, num_experts, logits.stride(0),
        K=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), SOFTMAX=scoring == "softmax",
        RENORMALIZE=renormalize, USE_PDL=pdl, num_warps=1 if block_e <= 256 else 4, launch_pdl=pdl,
    )  # fmt: skip
    return weights, ids
