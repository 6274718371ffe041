"""Torch reference of the fused rotary-embedding kernel (`kernels/rope.py`) and HF's rotation it shares with
the model's CPU path; importable without Triton. Convention: rotate_half (neox), the two halves of the rotated
dims. Partial rotary (Qwen3.5, Qwen3-Next: `partial_rotary_factor`) rotates only a head's first R = cos.shape[-1]
dims and passes the other D - R through, as HF's `apply_rotary_pos_emb` splits q_rot | q_pass.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary", "rotary_embedding_ref", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # [..., R/2] each
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, R] (R <= D: the rotated dims, the first of each head) -> rotated x [T, H, D]."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:  # the whole head (every model but the partial-rotary ones): no split, no copy
        return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]  # [T, H, R], [T, H, D - R]
    return torch.cat((x_rot * cos[:, None, :] + rotate_half(x_rot) * sin[:, None, :], x_pass), dim=-1)


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place; returns (q, k). Flat q [T, Hq*R] and k [T, Hkv*R] are
    rotated whole (D = R, the cache's width).

    positions [T] index cos_sin_cache [P, R] (cos | sin halves, float32; R = D unless partial rotary); the
    rotation is HF's: cos/sin cast to q's dtype, then `x * cos + rotate_half(x) * sin` in that dtype over the
    first R dims of each head, the rest unchanged. Reference of the Triton kernel.
    """
    rot_dim = cos_sin_cache.shape[-1]
    head_dim = q.shape[-1] if q.dim() == 3 else rot_dim
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, R/2] each
    cos = torch.cat((cos, cos), dim=-1).to(q.dtype)  # [T, R]
    sin = torch.cat((sin, sin), dim=-1).to(q.dtype)  # [T, R]
    for x in (q, k):
        x3 = x.view(x.shape[0], -1, head_dim)  # [T, H, D]
        x3.copy_(apply_rotary(x3, cos, sin))
    return q, k
