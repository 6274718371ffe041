"""Torch references of the RMSNorm kernels (`kernels/norm.py`), same signatures, importable without Triton.

Rounding is HF's: normalized in float32, cast back to the input dtype, then scaled (LlamaRMSNorm); or, with
`zero_centered` (Qwen3.5's, Qwen3-Next's and Gemma's RMSNorm: the weight is stored as an offset from 1), scaled
by (1 + w) in float32 and cast once, after. The residual sum is stored in the input dtype before it is
normalized. Layers run these on the CPU.
"""

from __future__ import annotations

import torch

__all__ = ["fused_add_rms_norm_ref", "rms_norm_ref"]


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False
) -> torch.Tensor:
    """x [..., H], weight [H] -> y [..., H]: normalized in float32, cast back, then scaled (HF's way); with
    zero_centered, (norm * (1 + weight)) in float32, then cast to x's dtype (Qwen3_5MoeRMSNorm's way)."""
    in_dtype = x.dtype
    h = x.to(torch.float32)  # [..., H]
    variance = h.pow(2).mean(-1, keepdim=True)  # [..., 1]
    h = h * torch.rsqrt(variance + eps)  # [..., H]
    if zero_centered:
        return (h * (1.0 + weight.float())).to(in_dtype)
    return weight * h.to(in_dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [..., H], residual [..., H]) -> (rms_norm(x + residual) [..., H], x + residual [..., H]).

    The sum is taken in float32 and stored in x's dtype (what torch does for a half-precision add), and
    the norm reads that stored sum, so the output equals `norm(residual + x)` of the unfused layer.
    """
    new_residual = (x.float() + residual.float()).to(x.dtype)  # [..., H]
    return rms_norm_ref(new_residual, weight, eps, zero_centered), new_residual
