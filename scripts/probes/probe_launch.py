"""GPU probe: host cost of launching each op of an eager decoder layer at a short step (64 tokens, the
Llama-3.1-8B shape), through Triton's launch and through FastKernel, without a profiler. Each op runs
`REPS` times back to back with no sync in between; its GPU work is tiny, so the host time per call is its
launch cost. On a CUDA GPU: python3 scripts/probes/probe_launch.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from longserve.kernels.activation import silu_and_mul
from longserve.kernels.extend_attention import extend_attention
from longserve.kernels.launch import FastKernel
from longserve.kernels.norm import fused_add_rms_norm, rms_norm
from longserve.kernels.rope import rotary_embedding

REPS = 300
T, H, HQ, HKV, D, INTER = 64, 4096, 32, 8, 128, 14336
PREFIX, PAGE = 32768, 16


def host_us(fn, reps: int = REPS) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(T, H, device=dev, dtype=dt)
    res = torch.randn(T, H, device=dev, dtype=dt)
    w = torch.ones(H, device=dev, dtype=dt)
    w_qkv = torch.randn((HQ + 2 * HKV) * D, H, device=dev, dtype=dt) * 0.01
    w_up = torch.randn(2 * INTER, H, device=dev, dtype=dt) * 0.01
    gate_up = torch.randn(T, 2 * INTER, device=dev, dtype=dt)
    q = torch.randn(T, HQ, D, device=dev, dtype=dt)
    k = torch.randn(T, HKV, D, device=dev, dtype=dt)
    positions = torch.arange(PREFIX, PREFIX + T, device=dev)
    cos_sin_cache = torch.randn(PREFIX + T, D, device=dev, dtype=torch.float32)
    pages = (PREFIX + T) // PAGE + 1
    k_cache = torch.randn(pages, PAGE, HKV, D, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    kc = k_cache.view(-1, HKV, D)
    slots = torch.arange(PREFIX, PREFIX + T, device=dev)
    qsl = torch.tensor([0, T], device=dev, dtype=torch.int32)
    prefix = torch.tensor([PREFIX], device=dev, dtype=torch.int32)
    seq = torch.tensor([PREFIX + T], device=dev, dtype=torch.int32)
    table = torch.arange(pages, device=dev, dtype=torch.int32)[None]
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}

    ops = {
        "torch.empty [T,H]": lambda: torch.empty(T, H, device=dev, dtype=dt),
        "F.linear qkv (M=64)": lambda: F.linear(x, w_qkv),
        "F.linear gate_up (M=64)": lambda: F.linear(x, w_up),
        "rms_norm (triton)": lambda: rms_norm(x, w, 1e-5),
        "fused_add_rms_norm (triton)": lambda: fused_add_rms_norm(x, res, w, 1e-5),
        "silu_and_mul (triton)": lambda: silu_and_mul(gate_up),
        "rotary_embedding (triton)": lambda: rotary_embedding(positions, q, k, cos_sin_cache),
        "kv store index_copy_": lambda: kc.index_copy_(0, slots, k),
        "extend_attention splits=1": lambda: extend_attention(
            q, k_cache, v_cache, qsl, prefix, seq, table, PAGE, T, 0.088, config=cfg, num_splits=1
        ),
        "extend_attention splits=32 (+merge)": lambda: extend_attention(
            q, k_cache, v_cache, qsl, prefix, seq, table, PAGE, T, 0.088, config=cfg, num_splits=32
        ),
        "x + res (torch add)": lambda: x + res,
    }
    print(f"host launch cost per call, {REPS} calls back to back (us): Triton's launch | FastKernel")
    for name, fn in ops.items():
        try:
            cost = []
            for enabled in (False, True):
                FastKernel.enabled = enabled
                cost.append(host_us(fn))
            print(f"  {name:<38} {cost[0]:8.1f} {cost[1]:8.1f}", flush=True)
        except Exception as e:  # noqa: BLE001 - a probe: report and go on
            print(f"  {name:<38} failed: {type(e).__name__}: {e}", flush=True)
        finally:
            FastKernel.enabled = True


if __name__ == "__main__":
    main()
