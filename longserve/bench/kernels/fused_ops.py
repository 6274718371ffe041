"""GPU timing of the fused ops (RMSNorm, residual-add RMSNorm, SiLU-and-mul, RoPE) vs. their torch references.

`bench_fused_ops()` returns one dict per op and prints nothing; CUDA only. GB/s counts the bytes each op
must move once (inputs read, outputs written); timing is CUDA events around `iters` back-to-back calls,
median of `repeats`, after a warm-up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from longserve.kernels.activation import silu_and_mul, silu_and_mul_ref
from longserve.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from longserve.kernels.rope import rotary_embedding, rotary_embedding_ref
from longserve.models.rope import RotaryEmbedding
from longserve.platform import cuda_time_ms


def bench_fused_ops(
    num_tokens: int = 8192,
    hidden: int = 4096,
    inter: int = 14336,
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    max_positions: int = 131072,
) -> list[dict[str, object]]:
    """One dict per op: op, shape, dtype, bytes, triton_ms, triton_gbps, torch_ms, torch_gbps, speedup."""
    assert torch.cuda.is_available(), "bench_fused_ops needs a CUDA GPU"
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    size = torch.tensor([], dtype=dtype).element_size()
    t, h = num_tokens, hidden

    x = torch.randn(t, h, device=dev, dtype=dtype, generator=gen)  # [T, H]
    res = torch.randn(t, h, device=dev, dtype=dtype, generator=gen)  # [T, H]
    w = torch.randn(h, device=dev, dtype=dtype, generator=gen)  # [H]
    gate_up = torch.randn(t, 2 * inter, device=dev, dtype=dtype, generator=gen)  # [T, 2I]
    q = torch.randn(t, num_q_heads * head_dim, device=dev, dtype=dtype, generator=gen)  # [T, Hq*D]
    k = torch.randn(t, num_kv_heads * head_dim, device=dev, dtype=dtype, generator=gen)  # [T, Hkv*D]
    rope = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 500000.0}, max_positions).to(dev)
    cache = rope.cos_sin_cache()  # [P, D] float32
    positions = torch.randint(0, max_positions, (t,), device=dev, generator=gen)  # [T]
    qk_elems = t * (num_q_heads + num_kv_heads) * head_dim

    cases: list[tuple[str, str, int, Callable[[], object], Callable[[], object]]] = [
        (
            "rms_norm", f"T={t} H={h}", 2 * t * h * size + h * size,
            lambda: rms_norm(x, w, 1e-6), lambda: rms_norm_ref(x, w, 1e-6),
        ),
        (
            "fused_add_rms_norm", f"T={t} H={h}", 4 * t * h * size + h * size,
            lambda: fused_add_rms_norm(x, res, w, 1e-6), lambda: fused_add_rms_norm_ref(x, res, w, 1e-6),
        ),
        (
            "silu_and_mul", f"T={t} I={inter}", 3 * t * inter * size,
            lambda: silu_and_mul(gate_up), lambda: silu_and_mul_ref(gate_up),
        ),
        (
            "rotary_embedding", f"T={t} Hq={num_q_heads} Hkv={num_kv_heads} D={head_dim}",
            2 * qk_elems * size + t * head_dim * 4 + t * 8,
            lambda: rotary_embedding(positions, q, k, cache),
            lambda: rotary_embedding_ref(positions, q, k, cache),
        ),
    ]  # fmt: skip
    rows: list[dict[str, object]] = []
    with torch.inference_mode():
        for op, shape, nbytes, fused, ref in cases:
            fused_ms, ref_ms = cuda_time_ms(fused), cuda_time_ms(ref)
            rows.append(
                {
                    "op": op,
                    "shape": shape,
                    "dtype": str(dtype).removeprefix("torch."),
                    "bytes": nbytes,
                    "triton_ms": fused_ms,
                    "triton_gbps": nbytes / fused_ms / 1e6,
                    "torch_ms": ref_ms,
                    "torch_gbps": nbytes / ref_ms / 1e6,
                    "speedup": ref_ms / fused_ms,
                }
            )
    return rows
