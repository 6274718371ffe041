"""The fp8 KV cache's format: float8_e4m3fn values with one float32 scale per layer for K and one for V.

Scaling, as vLLM and SGLang do by default: per-tensor (one scalar per layer and K/V), stored = x / scale
saturated to e4m3's +-448, read = stored * scale. The scale is 1.0 unless the checkpoint carries calibrated
ones (`self_attn.k_scale` / `v_scale`, llm-compressor's `k_proj.output_scale` / `v_proj.output_scale`, the
older single `kv_scale`): vLLM's default without `--calculate-kv-scales` (docs: "No calibration (default
scales): all quantization scales are set to 1.0"); SGLang's `--kv-cache-dtype fp8_e4m3` the same. Finer
scales (vLLM's per-head mode, per-token schemes) need calibration data or a scale tensor beside every page;
per-tensor scales cost nothing at read time: K's folds into the softmax scale (q.k * k_scale) and V's into
the output (the attention output is linear in V), so the kernels only widen each loaded e4m3 value to the
query's dtype. Post-RoPE K and V of real models stay far inside +-448 (|x| is a few units to a few tens),
where e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 per element (6.25%), 2^-5 on average.

Every attention path reads the dequantized values, the new tokens' included (they are rounded through e4m3
before a cold prompt attends over them), so a prompt's answer does not depend on whether its prefix came
from the cache, a chunk boundary or a recomputation after preemption.
"""

from __future__ import annotations

import re

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448

# checkpoint tensor names of calibrated KV scales (vLLM's `maybe_remap_kv_scale_name` reads the same ones)
_KV_SCALE_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?(?:(k|v)_proj\.output_scale|(k|v)_scale|(kv)_scale)$"
)


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the pages hold for config.kv_cache_dtype ("auto": the model's)."""
    return FP8_KV_DTYPE if kv_cache_dtype in ("fp8", "fp8_e4m3") else model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in e4m3, saturated (a plain cast of a value past 448 gives NaN in e4m3fn)."""
    y = x.float() if scale == 1.0 else x.float() / scale
    return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored e4m3 values back in `dtype` (every e4m3 value is exact in bf16/fp16/fp32; the scale
    multiplies in float32)."""
    y = x.to(torch.float32)
    if scale != 1.0:
        y = y * scale
    return y.to(dtype)


def kv_scale_name(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") for a checkpoint tensor holding a calibrated KV scale, else None."""
    m = _KV_SCALE_NAME.search(name)
    if m is None:
        return None
    return int(m.group(1)), m.group(2) or m.group(3) or m.group(4)


def read_kv_scale(tensor: torch.Tensor, name: str) -> float:
    """One per-tensor scale from a checkpoint tensor; a per-head one (vLLM's calibrated per-head mode) is
    refused rather than silently reduced."""
    t = tensor.materialize() if hasattr(tensor, "materialize") else tensor
    if t.numel() != 1:
        raise ValueError(
            f"checkpoint tensor {name!r} holds {t.numel()} KV scales; longserve's fp8 KV cache takes one "
            "per-tensor scale per layer (per-head scales are not supported)"
        )
    value = float(t.float().reshape(()))
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"checkpoint tensor {name!r} holds an invalid KV scale {value}")
    return value


def layer_kv_scales(found: dict[tuple[int, str], float], num_layers: int) -> tuple[list[float], list[float]]:
    """Per-layer (k_scales, v_scales) from the checkpoint's scales by (layer, "k" | "v" | "kv"); 1.0 where
    a layer has none (vLLM's default)."""
    k = [found.get((i, "k"), found.get((i, "kv"), 1.0)) for i in range(num_layers)]
    v = [found.get((i, "v"), found.get((i, "kv"), 1.0)) for i in range(num_layers)]
    return k, v
