"""GPTQ's round-to-nearest grid and AutoGPTQ's packing (QuantLinear.pack), for the GPTQ checkpoints that
quant_checkpoints.write_gptq writes (GPTQModel needs CUDA packages): the format, not GPTQ's error feedback;
tests/model/test_quantized_models.py checks the packing against AutoGPTQ's unpacking code, quoted there."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def gptq_quantize(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor) -> dict[str, Any]:
    """Round-to-nearest of w [N, K] in GPTQ's grid (GPTQ's Quantizer: sym scale = 2 max|w| / maxq with zero
    (maxq + 1) / 2; asym scale = (max - min) / maxq, zero = round(-min / scale)); scales in fp16, as AutoGPTQ
    stores them, and the integers computed with those. Returns q [N, K], scales [G, N] fp16, zeros [G, N]."""
    maxq = 2**bits - 1
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        wg = w[:, g_idx == g]
        if sym:
            amax = wg.abs().amax(dim=1).clamp(min=1e-8)
            scale, zero = 2 * amax / maxq, torch.full((n,), (maxq + 1) // 2)
        else:
            lo, hi = wg.amin(dim=1).clamp(max=0), wg.amax(dim=1).clamp(min=0)
            scale = ((hi - lo) / maxq).clamp(min=1e-8)
            zero = torch.round(-lo / scale.half().float()).long().clamp(1, maxq)  # 0 overflows v1's zero - 1
        scales[g], zeros[g] = scale, zero
    scales = scales.half()
    s, z = scales.float()[g_idx.long()].T, zeros[g_idx.long()].T  # [N, K]
    q = torch.clamp(torch.round(w / s + z), 0, maxq).long()
    return {"q": q, "scales": scales, "zeros": zeros}


def gptq_pack(
    q: torch.Tensor, zeros: torch.Tensor, bits: int, v1: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ's QuantLinear.pack: qweight [K / pack, N] (row i holds K rows i*pack .. i*pack + pack - 1,
    low bits first) and qzeros [G, N / pack] of zero - 1 (v1), both int32."""
    pack = 32 // bits
    qt = q.T.numpy().astype(np.uint32)  # [K, N]
    qweight = np.zeros((qt.shape[0] // pack, qt.shape[1]), dtype=np.uint32)
    for j in range(pack):
        qweight |= qt[j::pack] << np.uint32(bits * j)
    z = ((zeros - (1 if v1 else 0)) & (2**bits - 1)).numpy().astype(np.uint32)  # [G, N]
    qzeros = np.zeros((z.shape[0], z.shape[1] // pack), dtype=np.uint32)
    for j in range(pack):
        qzeros |= z[:, j::pack] << np.uint32(bits * j)
    return torch.from_numpy(qweight.astype(np.int32)), torch.from_numpy(qzeros.astype(np.int32))
