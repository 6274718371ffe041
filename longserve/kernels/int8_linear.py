"""INT8 W8A8 linear layers: activations quantized per token (kernels/quant_fp8.py's Triton kernel) or by a static
per-tensor scale, `torch._int_mm` (int32 accumulation), a float32 epilogue; reference:
quant_reference.scaled_gemm_ref (the CPU's route). No host syncs (CUDA graphs capture it)."""

from __future__ import annotations

import torch

from longserve.kernels.quant_fp8 import per_token_group_quant
from longserve.kernels.quant_reference import scaled_gemm_ref

_INT_MM_MIN_M = 17  # torch._int_mm needs more than 16 rows


def int8_scaled_linear(
    x: torch.Tensor,  # [M, K]
    w: torch.Tensor,  # [N, K] int8
    w_scale: torch.Tensor,  # [N] float32
    input_scale: torch.Tensor | None = None,  # [1]: static per-tensor; None: per token
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """INT8 W8A8: x quantized per token (Triton), torch._int_mm (int32 accumulation), scaled in float32."""
    xq, xs = per_token_group_quant(x, 0, torch.int8, static_scale=input_scale)
    if xs.shape[1] != 1:
        xs = xs[:, :1]
    if not x.is_cuda:
        return scaled_gemm_ref(xq, xs, w, w_scale, x.dtype, bias)
    m = x.shape[0]
    if m < _INT_MM_MIN_M:  # pad the rows (static shapes: no sync), dropped after
        xq = torch.nn.functional.pad(xq, (0, 0, 0, _INT_MM_MIN_M - m))
    acc = torch._int_mm(xq, w.t())[:m]  # [M, N] int32
    out = acc.float() * xs * w_scale.view(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
