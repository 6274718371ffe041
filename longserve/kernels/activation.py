"""SiLU-and-mul in Triton: x = gate|up [T, 2I] -> silu(gate) * up [T, I]; reference: `silu_and_mul_ref`.

Rounds where torch does: silu in float32 rounded to the input dtype, then the product rounded again, so
bf16 outputs match `F.silu(gate) * up` up to the exp approximation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels.activation_reference import silu_and_mul_ref
from longserve.kernels.launch import fast_launch, pdl_prologue, use_pdl

__all__ = ["silu_and_mul", "silu_and_mul_ref"]

BLOCK = 1024


@fast_launch
@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    inter,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter
    gate = tl.load(x_ptr + tok * stride_x + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    up = tl.load(x_ptr + tok * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)  # F.silu rounding
    tl.store(out_ptr + tok * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = gate|up [T, 2I] -> silu(gate) * up [T, I]; same signature and math as `silu_and_mul_ref`."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"expected [T, 2I], got {tuple(x.shape)}"
    if x.stride(1) != 1:
        x = x.contiguous()
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)  # [T, I]
    if num_tokens == 0:
        return out
    pdl = use_pdl(x)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, BLOCK))](
        x, out, inter, x.stride(0), out.stride(0), BLOCK=BLOCK, USE_PDL=pdl, num_warps=4, launch_pdl=pdl
    )
    return out
