"""Torch references of the kernels in `kernels/activation.py`, same signatures, no Triton needed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longserve.kernels.quant_reference import per_token_group_quant_fp8_ref

__all__ = [
    "sigmoid_gated_add_ref",
    "sigmoid_mul_ref",
    "silu_and_mul_quant_ref",
    "silu_and_mul_ref",
    "swiglu_gemm_ref",
]


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x = gate|up [T, 2I] (gate first, as gate_up_proj stacks them) -> silu(gate) * up [T, I]."""
    gate, up = x.chunk(2, dim=-1)  # [T, I] each
    return F.silu(gate) * up


def silu_and_mul_quant_ref(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x = gate|up [T, 2I] -> silu(gate) * up quantized to e4m3 per token-group: (e4m3 [T, I], float32 scales
    [T, ceil(I / group)]), rounded to x's dtype before the quantization as the kernel rounds it."""
    return per_token_group_quant_fp8_ref(silu_and_mul_ref(x), group_size)


def swiglu_gemm_ref(x: torch.Tensor, w13: torch.Tensor) -> torch.Tensor:
    """x [T, H] @ w13 [2I, H]^T (gate rows first) -> silu(gate) * up [T, I]: the product rounded to x's dtype, then
    `silu_and_mul_ref`, as the unfused path (cuBLAS, then silu_and_mul) rounds."""
    return silu_and_mul_ref((x.float() @ w13.float().T).to(x.dtype))


def sigmoid_gated_add_ref(out: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """out [T, H] + sigmoid(gate [T, 1]) * shared [T, H]: a Qwen-MoE block's routed experts plus its shared expert
    scaled by its gate, as transformers computes it (a new tensor; the kernel adds into out)."""
    return out + torch.sigmoid(gate) * shared


def sigmoid_mul_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate), both [T, H, D]: an attention output times its output gate, as transformers computes it
    (a new tensor; the kernel multiplies x in place)."""
    return x * torch.sigmoid(gate)
