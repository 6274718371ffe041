"""Torch reference of the fused rotary-embedding kernel (`kernels/rope.py`) and HF's rotation it shares with
the model's CPU path; importable without Triton. Convention: rotate_half (neox), the two halves of head_dim.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary", "rotary_embedding_ref", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # [..., D/2] each
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D] -> rotated x [T, H, D]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq*D] or [T, Hq, D] and k [T, Hkv*D] or [T, Hkv, D] in place; returns (q, k).

    positions [T] index cos_sin_cache [P, D] (cos | sin halves, float32); the rotation is HF's: cos/sin
    cast to q's dtype, then `x * cos + rotate_half(x) * sin` in that dtype. Reference of the Triton kernel.
    """
    head_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos = torch.cat((cos, cos), dim=-1).to(q.dtype)  # [T, D]
    sin = torch.cat((sin, sin), dim=-1).to(q.dtype)  # [T, D]
    for x in (q, k):
        x3 = x.view(x.shape[0], -1, head_dim)  # [T, H, D]
        x3.copy_(apply_rotary(x3, cos, sin))
    return q, k
