"""Mixture-of-experts in pure torch (no triton): top-k routing and the reference expert computation whose
signature and rounding the Triton `fused_moe` shares; also the quantization descriptor of that signature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["MoEQuant", "check_moe_args", "fused_moe_ref", "route_topk"]


@dataclass(frozen=True)
class MoEQuant:
    """Per-expert weight quantization, reserved for quantized experts (next issue): NOT implemented yet.

    `weight_dtype` "int4" (two 4-bit values per uint8 along K, so w13 is [E, 2I, H/2]) or "fp8_e4m3"
    (w13 [E, 2I, H]); scales per output row and group of `group_size` K elements (0: one per row):
    w13_scale [E, 2I, H/group], w2_scale [E, H, I/group]; optional zero points of the same shapes (int4)."""

    weight_dtype: str
    group_size: int
    w13_scale: torch.Tensor  # [E, 2I, H/group] float
    w2_scale: torch.Tensor  # [E, H, I/group] float
    w13_zero: torch.Tensor | None = None  # [E, 2I, H/group]
    w2_zero: torch.Tensor | None = None  # [E, H, I/group]


def route_topk(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token on the logits' device, no host sync: (weights fp32 [T, k], ids int32 [T, k]).

    Scores in float32 (softmax, or sigmoid), top-k, then with `renormalize` the k weights divided by their
    sum: Mixtral always does, Qwen3-MoE when `norm_topk_prob` (its default), Qwen2-MoE only when set.
    HF's Qwen2/Qwen3-MoE routers then round the weights to the logits' dtype (`.to(router_logits.dtype)`)
    while Mixtral keeps them float32: the caller passes `weights.to(dtype)` for the former, since the
    experts multiply in the promoted dtype of (hidden, weights), as HF does (see `fused_moe_ref`)."""
    assert router_logits.dim() == 2 and 1 <= top_k <= router_logits.shape[1], (
        f"logits {tuple(router_logits.shape)}, top_k {top_k}"
    )
    if scoring == "softmax":
        scores = torch.softmax(router_logits.float(), dim=-1)  # [T, E] fp32
    elif scoring == "sigmoid":
        scores = torch.sigmoid(router_logits.float())  # [T, E] fp32
    else:
        raise ValueError(f"unknown MoE scoring {scoring!r} (softmax, sigmoid)")
    weights, ids = torch.topk(scores, top_k, dim=-1)  # [T, k] fp32, [T, k] int64
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)  # [T, k]
    return weights, ids.to(torch.int32)


def check_moe_args(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    quant: MoEQuant | None,
) -> None:
    """Shape checks shared by the reference and the kernel (shapes only: no host sync)."""
    if quant is not None:
        raise NotImplementedError(
            f"quantized experts ({quant.weight_dtype}, group {quant.group_size}) are not implemented yet: "
            "only unquantized float weights (w13 and w2 in the hidden states' dtype)"
        )
    assert hidden.dim() == 2 and w13.dim() == 3 and w2.dim() == 3, (
        "hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]"
    )
    num_experts, two_inter, hidden_size = w13.shape
    assert hidden.shape[1] == hidden_size and two_inter % 2 == 0, (
        f"w13 {tuple(w13.shape)} vs {tuple(hidden.shape)}"
    )
    assert w2.shape == (num_experts, hidden_size, two_inter // 2), (
        f"w2 {tuple(w2.shape)}, w13 {tuple(w13.shape)}"
    )
    assert w13.dtype == w2.dtype == hidden.dtype, f"dtypes {hidden.dtype}, {w13.dtype}, {w2.dtype}"
    assert topk_ids.shape == topk_weights.shape and topk_ids.dim() == 2, "topk_ids and topk_weights [T, k]"
    assert topk_ids.shape[0] == hidden.shape[0], f"{topk_ids.shape[0]} routed tokens for {hidden.shape[0]}"
    assert topk_weights.is_floating_point() and not topk_ids.is_floating_point()


def fused_moe_ref(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows [0, I), then up rows [I, 2I)
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float32, or the hidden dtype (Qwen-MoE)
    topk_ids: torch.Tensor,  # [T, k] int32 expert ids in [0, E)
    out: torch.Tensor | None = None,
    quant: MoEQuant | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """sum_k w_k * down_e(silu(gate_e x) * up_e x) per token: [T, H] in the hidden dtype.

    Weights as transformers 5 stores them (`experts.gate_up_proj` [E, 2I, H] with the gate half first,
    `experts.down_proj` [E, H, I]): loaded without a transpose. Rounds like transformers 5's default
    `grouped_mm` experts: both projections and silu(gate) * up round to the dtype, the routing weight
    multiplies in the promoted dtype of (hidden, topk_weights) (bf16 for Qwen-MoE, which rounds its weights;
    fp32 for Mixtral), and the k products are summed in fp32 and rounded once. Loops over the experts hit,
    with host syncs: a reference, not for CUDA graphs. `config` is the kernel's and ignored here."""
    del config
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids, quant)
    num_tokens, top_k = topk_ids.shape
    prod_dtype = torch.promote_types(hidden.dtype, topk_weights.dtype)
    weighted = torch.zeros(
        num_tokens, top_k, hidden.shape[1], dtype=prod_dtype, device=hidden.device
    )  # [T, k, H]
    ids = topk_ids.long()  # [T, k]
    for expert in torch.unique(ids).tolist():  # ascending; the only experts with work
        tok, pos = torch.where(ids == expert)  # [n] each: the (token, k) pairs routed here
        gate, up = F.linear(hidden[tok], w13[expert]).chunk(2, dim=-1)  # [n, I] each
        down = F.linear(F.silu(gate) * up, w2[expert])  # [n, H]
        weighted[tok, pos] = down * topk_weights[tok, pos, None].to(prod_dtype)  # [n, H]
    acc_dtype = torch.promote_types(prod_dtype, torch.float32)  # 16-bit products sum in fp32, as HF's .sum
    result = weighted.sum(dim=1, dtype=acc_dtype).to(hidden.dtype)  # [T, H]
    if out is None:
        return result
    return out.copy_(result)
