"""Torch reference of the gated RMSNorm of the Gated DeltaNet layers (`kernels/gated_norm.py`), same signature,
importable without Triton.

HF's `Qwen3_5MoeRMSNormGated` (Qwen3-Next / Qwen3.5): each value head's output row o [V] is normalized in
float32, cast back to its dtype, scaled by the weight (the product in promote(weight, input) dtype, as torch
multiplies), times SiLU of the gate z taken in float32, and cast back to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["gated_rms_norm_ref"]


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., V], gate [..., V], weight [V] -> y [..., V] in x's dtype: rmsnorm(x) * weight * silu(gate)."""
    in_dtype = x.dtype
    h = x.to(torch.float32)  # [..., V]
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(in_dtype)  # rounded to promote(weight, x) dtype, as HF's product is
    return (h * F.silu(gate.to(torch.float32))).to(in_dtype)
