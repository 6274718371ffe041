"""Torch reference of the SiLU-and-mul kernel (`kernels/activation.py`), same signature, no Triton needed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["silu_and_mul_ref"]


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x = gate|up [T, 2I] (gate first, as gate_up_proj stacks them) -> silu(gate) * up [T, I]."""
    gate, up = x.chunk(2, dim=-1)  # [T, I] each
    return F.silu(gate) * up
