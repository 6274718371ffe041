"""The decode GEMVs on the tensor cores at one row with a neighbouring op inside them: an MLP's down projection making
its input silu(gate) * up from gate|up (wna16_gated_gemv; quant_gemv.INT4_MMA_GATED), and the next RMSNorm in the
epilogue (gluon_gemv.norm_row, NORM_EPILOGUE): the product's last column tile to store adds it into the residual
stream and norms it, so the norm after an o or down projection is no launch of its own. The int4 (GPTQ/AWQ) ring
GEMV (int4_mma_gemv.py) and the block-FP8 wgmma GEMV (fp8_wgmma_gemv.py); each returns None where its kernel does not
take the product (the caller, the linear method or models/layers.py's RowParallelLinear.then_norm, runs the product
and the op apart). References: the product's own (quant_reference), silu_and_mul_ref, fused_add_rms_norm_ref."""

from __future__ import annotations

import torch

from longserve.kernels import fp8_wgmma_gemv as wg
from longserve.kernels import gluon_gemv
from longserve.kernels import int4_mma_gemv as mma
from longserve.kernels import quant_fp8 as qf
from longserve.kernels import quant_gemv as qg
from longserve.kernels.activation import silu_and_mul

__all__ = ["fp8_block_linear_then_norm", "wna16_gated_gemv", "wna16_gemv_then_norm"]


def _one_row_ring(
    x: torch.Tensor, k: int, qweight: torch.Tensor, g_idx: torch.Tensor | None, bits: int, group_size: int
) -> bool:
    """Whether the int4 tensor-core GEMV takes one row x [1, K] (or the gate half of gate|up [1, 2K]: its dtype,
    strides, alignment; up lies K after it) by its ring (int4_mma_gemv.ONE_ROW), as quant_gemv routes one row."""
    if not (qg.INT4_MMA_GEMV and x.shape[0] == 1 and qg.INT4_MMA_MIN_ROWS <= 1 and x.is_cuda):
        return False
    return mma.supported() and bool(mma.tiling(1)[1]) and mma.fits(x[:, :k], qweight, g_idx, bits, group_size)


def wna16_gated_gemv(
    gate_up: torch.Tensor,  # [1, 2K]
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """`quant_gemv.wna16_gemv(silu_and_mul(gate_up), ...)` with silu(gate) * up made inside the tensor-core GEMV
    (quant_gemv.INT4_MMA_GATED: one row, by its ring); None where that kernel does not take it (the caller runs
    silu_and_mul first)."""
    k = gate_up.shape[1] // 2
    if not (qg.INT4_MMA_GATED and _one_row_ring(gate_up, k, qweight, g_idx, bits, group_size)):
        return None
    return qg.mma_gemv(gate_up, qweight, scales, zeros, bias, group_size, 1, qweight.shape[0], k, gated=True)


def wna16_gemv_then_norm(
    x: torch.Tensor,  # [1, K], or (gated) gate|up [1, 2K]
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None,
    residual: torch.Tensor,  # [1, N]
    norm_weight: torch.Tensor,  # [N]
    eps: float,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`fused_add_rms_norm(quant_gemv.wna16_gemv(x, ...), residual, norm_weight, eps)` (gated: of
    silu_and_mul(x), made inside as quant_gemv.INT4_MMA_GATED says, else first) with the residual add and norm done
    by the tensor-core GEMV's last tile (one row, by its ring): (normed [1, N], new residual [1, N]), or None where
    that kernel does not take it (the caller runs the product and the norm)."""
    k, n = x.shape[1] // 2 if gated else x.shape[1], qweight.shape[0]
    if not (gluon_gemv.NORM_EPILOGUE and _one_row_ring(x, k, qweight, g_idx, bits, group_size)):
        return None
    if not gluon_gemv.RowNorm.fits(residual, norm_weight, n, x.dtype, mma.WARPS):
        return None
    if gated and not qg.INT4_MMA_GATED:  # silu(gate) * up made first, the norm still here
        x, gated = silu_and_mul(x), False
    norm = gluon_gemv.RowNorm.of(residual, norm_weight, eps)
    return qg.mma_gemv(x, qweight, scales, zeros, bias, group_size, 1, n, k, gated=gated, norm=norm)


def fp8_block_linear_then_norm(
    x: torch.Tensor,  # [1, K], or (gated) gate|up [1, 2K]
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    residual: torch.Tensor,  # [1, N]
    norm_weight: torch.Tensor,  # [N]
    eps: float,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`fused_add_rms_norm(quant_fp8.fp8_block_linear(x, ...), residual, norm_weight, eps)` with the residual add
    and norm done by the wgmma GEMV's last tile (one row; gated: silu(gate) * up made inside as
    quant_fp8.FP8_WGMMA_GATED says, else first): (normed [1, N], new residual [1, N]), or None where that kernel
    does not take it (the caller runs both)."""
    n = w.shape[0]
    if not (gluon_gemv.NORM_EPILOGUE and x.shape[0] == 1 and qf.wgmma_takes(x, w, w_scale, block, gated)):
        return None
    if not gluon_gemv.RowNorm.fits(residual, norm_weight, n, x.dtype, wg.WARPS):
        return None
    if gated and not qf.FP8_WGMMA_GATED:  # silu(gate) * up made first, the norm still here
        x, gated = silu_and_mul(x), False
    norm = gluon_gemv.RowNorm.of(residual, norm_weight, eps)
    return wg.gemv(
        x, None, w, w_scale, bias, x.dtype, qf.wgmma_imprecise_acc(wg.BLOCK[1]), gated=gated, norm=norm
    )
