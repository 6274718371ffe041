"""RMSNorm and fused residual-add + RMSNorm in Triton; references: `rms_norm_ref`, `fused_add_rms_norm_ref`.

Each program normalizes BLOCK_R whole rows (BLOCK_H = next pow2 of H) in float32 and rounds exactly where
HF does: the normalized row is cast to the input dtype before the weight multiply (LlamaRMSNorm), or with
ZERO_CENTERED (Qwen3.5, Qwen3-Next, Gemma: the weight is an offset from 1) scaled by (1 + w) in float32 and cast
once after; the residual sum is stored in the input dtype before it is normalized. Rows only need a unit stride
along H.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels.launch import early_loads, fast_launch, pdl_prologue, use_pdl
from longserve.kernels.norm_reference import fused_add_rms_norm_ref, rms_norm_ref

__all__ = ["fused_add_rms_norm", "fused_add_rms_norm_ref", "rms_norm", "rms_norm_ref"]


@fast_launch
@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,  # unused unless HAS_RESIDUAL
    w_ptr,
    y_ptr,
    res_out_ptr,  # unused unless HAS_RESIDUAL
    num_rows,
    hidden,
    stride_x,
    stride_r,
    stride_y,
    stride_ro,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
    EARLY: tl.constexpr = False,
    ZERO_CENTERED: tl.constexpr = False,
):
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    # EARLY: the weight before the wait on the kernel before (no kernel writes it); after it, its load was issued
    # past the reduction's two CTA barriers (sm90 SASS, Triton 3.6), a second round trip in series at one row
    pdl_prologue(USE_PDL and not EARLY)
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)  # [BLOCK_H]
    pdl_prologue(USE_PDL and EARLY)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    mask = (rows[:, None] < num_rows) & (cols[None, :] < hidden)  # [BLOCK_R, BLOCK_H]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)  # sum stored in x dtype
        tl.store(res_out_ptr + rows[:, None] * stride_ro + cols[None, :], s, mask=mask)
        h = s.to(tl.float32)  # [BLOCK_R, BLOCK_H]
    else:
        h = x.to(tl.float32)  # [BLOCK_R, BLOCK_H]
    variance = tl.sum(h * h, axis=1) / hidden  # [BLOCK_R]
    rstd = tl.math.rsqrt(variance + eps)  # [BLOCK_R]
    if ZERO_CENTERED:  # HF: `norm(x.float()) * (1.0 + w.float())`, one cast (the store's)
        y = h * rstd[:, None] * (1.0 + w[None, :])  # [BLOCK_R, BLOCK_H]
    else:
        normed = (h * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)  # HF: cast back, then scale
        y = normed * w[None, :]  # [BLOCK_R, BLOCK_H]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _launch_config(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_H, num_warps): ~2K+ elements per program; several rows when H is small (q/k norm)."""
    block_h = triton.next_power_of_2(hidden)
    block_r = max(1, 2048 // block_h)
    elems = block_r * block_h
    num_warps = 1 if elems <= 256 else 4 if elems <= 2048 else 8 if elems <= 8192 else 16
    return block_r, block_h, num_warps


def _as_rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """[..., H] -> [N, H] with unit stride along H (a view when possible, else a copy)."""
    rows = t.reshape(-1, hidden)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _run(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), f"weight {tuple(weight.shape)} does not match hidden size {hidden}"
    x2 = _as_rows(x, hidden)  # [N, H]
    num_rows = x2.shape[0]
    # Llama's product `weight * normed` promotes; the zero-centered norm casts to x's dtype (`type_as(x)`)
    y_dtype = x.dtype if zero_centered else torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty(x.shape, dtype=y_dtype, device=x.device)
    y2 = y.view(-1, hidden)  # [N, H]
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "x and residual must match"
        r2 = _as_rows(residual, hidden)  # [N, H]
        new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ro2 = new_residual.view(-1, hidden)  # [N, H]
    else:
        r2, new_residual, ro2 = x2, None, x2  # placeholders, never read or written
    if num_rows == 0:
        return y, new_residual
    block_r, block_h, num_warps = _launch_config(hidden)
    pdl = use_pdl(x)
    _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
        x2, r2, weight, y2, ro2, num_rows, hidden,
        x2.stride(0), r2.stride(0), y2.stride(0), ro2.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK_R=block_r, BLOCK_H=block_h, USE_PDL=pdl, EARLY=early_loads(),
        ZERO_CENTERED=zero_centered, num_warps=num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return y, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """x [..., H], weight [H] -> y [..., H] in promote(x.dtype, weight.dtype) (zero_centered: the weight is an
    offset from 1, y in x's dtype); same math as `rms_norm_ref`."""
    return _run(x, None, weight, eps, zero_centered)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [..., H], residual [..., H]) -> (rms_norm(x + residual), x + residual); out of place, one pass."""
    y, new_residual = _run(x, residual, weight, eps, zero_centered)
    assert new_residual is not None
    return y, new_residual
