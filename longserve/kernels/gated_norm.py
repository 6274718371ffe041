"""Gated RMSNorm of the Gated DeltaNet layers in Triton; reference: `gated_rms_norm_ref`.

HF's `Qwen3_5MoeRMSNormGated`: y = (weight * rmsnorm(x).to(x.dtype)) * silu(gate.float()), cast to x's dtype.
Each program normalizes BLOCK_R whole rows (BLOCK_V = next pow2 of V, one value head's output, 128 on Qwen3.5)
in float32 and rounds where HF does: the normalized row to x's dtype, the weight product to promote(weight, x)
(PROD_TY), the gated result to x's dtype. Rows are addressed by (token, head) strides and need only a unit
stride along V, so x and gate may be head views of wider tensors: the layer's gate z is a column range of its
input projection's output ([T, Hv, V] with a token stride past Hv * V), read in place where flattening it to
[T*Hv, V] took a copy (a launch and 2 x T x Hv x V values moved, each linear-attention layer and step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels.gated_norm_reference import gated_rms_norm_ref
from longserve.kernels.launch import fast_launch, pdl_prologue, use_pdl

__all__ = ["gated_rms_norm", "gated_rms_norm_ref"]

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@fast_launch
@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    gate_ptr,
    w_ptr,
    y_ptr,
    num_rows,
    heads,  # rows a token: row r is head r % heads of token r // heads
    hidden,
    stride_xt,
    stride_xh,
    stride_gt,
    stride_gh,
    stride_y,
    eps,
    PROD_TY: tl.constexpr,  # promote(weight, x): the dtype HF's weight product is rounded to
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_V)  # [BLOCK_V]
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)  # weights: no kernel writes them
    pdl_prologue(USE_PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    mask = (rows[:, None] < num_rows) & (cols[None, :] < hidden)  # [BLOCK_R, BLOCK_V]
    tok, head = rows // heads, rows % heads
    x_rows = tok * stride_xt + head * stride_xh
    g_rows = tok * stride_gt + head * stride_gh
    x = tl.load(x_ptr + x_rows[:, None] + cols[None, :], mask=mask, other=0.0)
    z = tl.load(gate_ptr + g_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = x.to(tl.float32)  # [BLOCK_R, BLOCK_V]
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=1) / hidden + eps)  # [BLOCK_R]
    normed = (h * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)  # HF: cast back, then scale
    scaled = (normed * w[None, :]).to(PROD_TY).to(tl.float32)
    y = scaled * (z * tl.sigmoid(z))  # silu of the gate in float32
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _heads(t: torch.Tensor, heads: int, hidden: int) -> torch.Tensor:
    """[..., V] -> [N, heads, V] with unit stride along V (a view when possible, else a copy)."""
    rows = t.reshape(-1, heads, hidden)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., V], gate [..., V], weight [V] -> y [..., V] in x's dtype; same math as `gated_rms_norm_ref`. With
    3 or more dims the rows of each token (the second-to-last dim) are addressed by their own stride: a gate
    [T, Hv, V] split from a wider tensor is read where it lies."""
    hidden = x.shape[-1]
    assert gate.shape == x.shape and weight.shape == (hidden,), "x, gate and weight shapes disagree"
    heads = x.shape[-2] if x.dim() >= 3 else 1
    x3, g3 = _heads(x, heads, hidden), _heads(gate, heads, hidden)  # [N, heads, V]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = x3.shape[0] * heads
    if num_rows == 0:
        return y
    block_v = triton.next_power_of_2(hidden)
    block_r = max(1, 2048 // block_v)  # ~2K elements a program: 16 rows of 128
    num_warps = 1 if block_r * block_v <= 256 else 4
    pdl = use_pdl(x)
    _gated_rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
        x3, g3, weight, y, num_rows, heads, hidden, x3.stride(0), x3.stride(1), g3.stride(0), g3.stride(1), hidden,
        eps, PROD_TY=_TL[torch.promote_types(weight.dtype, x.dtype)], BLOCK_R=block_r, BLOCK_V=block_v,
        USE_PDL=pdl, num_warps=num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return y
