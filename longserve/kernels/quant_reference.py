"""Quantized linear algebra in pure torch (no triton): the references whose signatures and arithmetic the
Triton kernels (`quant_gemm.py`, `quant_fp8.py`) share, and the CPU path of the quantized linear layers.

Integer weights (W4A16 / W8A16: GPTQ, AWQ, compressed-tensors pack-quantized) in longserve's one layout,
whatever the checkpoint wrote (models/quant/wna16.py repacks): `qweight` uint8 [N, K * bits / 8] packed along
K (4 bits: element 2j in the low nibble of byte j, 2j + 1 in the high one), `scales` [N, G] in the
checkpoint's float dtype, `zeros` uint8 [N, G] or None (then 2^(bits-1): symmetric), `g_idx` int32 [K] or
None (act order: the group of each input column; else column k is in group k // group_size). The weight is
w[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)], computed in float32 and rounded once to the activations'
dtype, as GPTQ's, AWQ's and compressed-tensors' own dequantizations compute it.

FP8 (e4m3) and INT8 W8A8: activations are quantized at run time per token (or per token-group of 128, the
DeepSeek/Qwen3 FP8 block recipe) with scale = amax / 448 (INT8: amax / 127.5, compressed-tensors' own
convention), q = clamp(x / scale) rounded to the type; the product of the quantized values is accumulated in
float32 (int32 for INT8) and scaled once per block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
INT8_QDIV = 127.5  # compressed-tensors' symmetric int8: amax / ((127 - (-128)) / 2)
# a zero group (all-zero activations) gets this scale instead of 0, so that x / scale stays finite (vLLM's)
SCALE_EPS = 1e-10

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "dequantize_fp8_block",
    "dequantize_wna16",
    "fp8_block_gemm_ref",
    "pack_int_k",
    "per_token_group_quant_fp8_ref",
    "per_token_quant_int8_ref",
    "scaled_gemm_ref",
    "unpack_int_k",
    "wna16_gemm_ref",
]


def pack_int_k(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned integers [..., K] (0 <= v < 2^bits) -> uint8 [..., K * bits / 8] packed along K."""
    v = values.to(torch.uint8)
    if bits == 8:
        return v.contiguous()
    if bits != 4:
        raise ValueError(f"{bits}-bit integer weights are not supported; supported: 4, 8")
    if v.shape[-1] % 2:
        raise ValueError(f"4-bit weights need an even number of input features; got {v.shape[-1]}")
    return (v[..., 0::2] | (v[..., 1::2] << 4)).contiguous()


def unpack_int_k(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., K * bits / 8] -> the unsigned values [..., K] as int16 (the inverse of `pack_int_k`)."""
    p = packed.to(torch.int16)
    if bits == 8:
        return p
    return torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)


def _group_index(k: int, group_size: int, g_idx: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if g_idx is not None:
        return g_idx.long()
    return torch.arange(k, device=device) // (group_size if group_size > 0 else k)


def dequantize_wna16(
    qweight: torch.Tensor,  # [..., N, K * bits / 8] uint8
    scales: torch.Tensor,  # [..., N, G]
    zeros: torch.Tensor | None,  # [..., N, G] uint8, or None: 2^(bits-1)
    g_idx: torch.Tensor | None,  # [K] int32 (or [..., K]), or None
    bits: int,
    group_size: int,  # <= 0: one group of all K (per channel)
) -> torch.Tensor:
    """The float32 weight [..., N, K] of the module docstring's layout."""
    q = unpack_int_k(qweight, bits).float()  # [..., N, K]
    k = q.shape[-1]
    if g_idx is not None and g_idx.dim() > 1:  # stacked experts: one act-order permutation each
        groups = g_idx.long().unsqueeze(-2).expand(*q.shape)  # [..., N, K]
        s = torch.gather(scales.float(), -1, groups)
        z = 2.0 ** (bits - 1) if zeros is None else torch.gather(zeros.float(), -1, groups)
        return (q - z) * s
    groups = _group_index(k, group_size, g_idx, q.device)  # [K]
    s = scales.float()[..., groups]  # [..., N, K]
    z = 2.0 ** (bits - 1) if zeros is None else zeros.float()[..., groups]
    return (q - z) * s


def wna16_gemm_ref(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ dequantize(w)^T (+ bias): [M, N] in x's dtype; the weight is rounded to x's dtype first."""
    w = dequantize_wna16(qweight, scales, zeros, g_idx, bits, group_size).to(x.dtype)  # [N, K]
    return F.linear(x, w, bias)


def round_half_even(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties to even (torch.round's; the Triton INT8 quantization kernel's by hand)."""
    return torch.round(x)


def per_token_group_quant_fp8_ref(
    x: torch.Tensor, group_size: int, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K / group)]): each token's groups of `group_size`
    columns get scale = amax / 448. `static_scale` (a per-tensor scale [1] from the checkpoint) replaces the
    computed ones (then scales are [M, 1], all equal)."""
    m, k = x.shape
    xf = x.float()
    if static_scale is not None:
        scale = static_scale.float().reshape(1, 1).expand(m, 1)
        return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.contiguous()
    groups = -(-k // group_size)
    padded = F.pad(xf, (0, groups * group_size - k)).view(m, groups, group_size)  # [M, G, group]
    amax = padded.abs().amax(dim=-1).clamp(min=SCALE_EPS)  # [M, G]
    scale = amax / FP8_MAX
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * group_size)[:, :k], scale


def per_token_quant_int8_ref(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scales [M, 1]): compressed-tensors' symmetric INT8 (the format of
    every INT8 W8A8 checkpoint here): scale = amax / 127.5 per token (its calculate_qparams: the range
    [-128, 127] halved), or the checkpoint's per-tensor `static_scale`; q = x / scale rounded half to even,
    clamped to [-128, 127]."""
    xf = x.float()
    if static_scale is None:
        scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=SCALE_EPS) / INT8_QDIV  # [M, 1]
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    q = round_half_even(xf / scale).clamp(-128, 127).to(torch.int8)
    return q, scale


def dequantize_fp8_block(w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """e4m3 [..., N, K] with scales [..., ceil(N / bn), ceil(K / bk)] -> float32 [..., N, K]."""
    n, k = w.shape[-2:]
    bn, bk = block
    s = w_scale.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return w.float() * s


def fp8_block_gemm_ref(
    x: torch.Tensor,  # [M, K]
    w: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32 (the checkpoint's weight_scale_inv)
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block FP8: x quantized per token-group of bk, times the block-scaled weight, accumulated in float32,
    -> [M, N] in x's dtype."""
    xq, xs = per_token_group_quant_fp8_ref(x, block[1])
    k = x.shape[1]
    xd = xq.float() * xs.repeat_interleave(block[1], dim=1)[:, :k]  # [M, K]
    out = xd @ dequantize_fp8_block(w, w_scale, block).T  # [M, N] float32
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def scaled_gemm_ref(
    xq: torch.Tensor,  # [M, K] e4m3 or int8
    x_scale: torch.Tensor,  # [M, 1] float32
    wq: torch.Tensor,  # [N, K] e4m3 or int8
    w_scale: torch.Tensor,  # [N] float32 (per output channel)
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """(xq @ wq^T) * x_scale * w_scale (+ bias): the product exact (float64 holds every int8 sum and every
    e4m3 product), scaled in float32 as torch._scaled_mm / the INT8 epilogue do, -> [M, N] out_dtype."""
    acc = (xq.double() @ wq.double().T).float()  # [M, N]
    out = acc * x_scale.float() * w_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
