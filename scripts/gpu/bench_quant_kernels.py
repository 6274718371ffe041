"""Time the quantized GEMMs at the Llama-3.1-8B projections against bf16 cuBLAS, per number of tokens M, to set
the constants the CPU session could not measure:

- quant_gemm.WNA16_DEQUANT_MIN_TOKENS: the M from which dequantize-then-cuBLAS beats the fused W4A16 kernel
  (printed as "crossover"); both paths are timed at every M.
- quant_fp8.FP8_BLOCK_USE_SCALED_MM: whether cuBLAS's block-scaled FP8 (F.scaled_mm) beats the Triton block GEMM.

    python scripts/gpu/bench_quant_kernels.py --output-json /tmp/kernels_quant.json
"""

from __future__ import annotations

import argparse
import json

import torch

from longserve.kernels.quant_fp8 import (
    _scaled_mm_blockwise_ok,
    fp8_block_linear,
    fp8_scaled_linear,
    int8_scaled_linear,
)
from longserve.kernels.quant_gemm import wna16_gemm
from longserve.kernels.quant_reference import pack_int_k
from longserve.platform import cuda_time_ms

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 8192]


def time_one(x: torch.Tensor, t: dict[str, torch.Tensor], blockwise: bool) -> dict[str, float]:
    """Milliseconds of each way to compute x @ W^T for one M."""
    row = {
        "bf16_ms": cuda_time_ms(lambda: torch.nn.functional.linear(x, t["bf16"])),
        "int4_fused_ms": cuda_time_ms(
            lambda: wna16_gemm(x, t["q"], t["scales"], None, None, 4, 128, path="fused")
        ),
        "int4_dequant_ms": cuda_time_ms(
            lambda: wna16_gemm(x, t["q"], t["scales"], None, None, 4, 128, path="dequant")
        ),
        "fp8_block_triton_ms": cuda_time_ms(
            lambda: fp8_block_linear(x, t["fp8"], t["fp8_scale"], (128, 128), use_scaled_mm=False)
        ),
        "fp8_channel_ms": cuda_time_ms(lambda: fp8_scaled_linear(x, t["fp8"], t["channel_scale"])),
        "int8_ms": cuda_time_ms(lambda: int8_scaled_linear(x, t["int8"], t["channel_scale"])),
    }
    if blockwise:
        row["fp8_block_cublas_ms"] = cuda_time_ms(
            lambda: fp8_block_linear(x, t["fp8"], t["fp8_scale"], (128, 128), use_scaled_mm=True)
        )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    blockwise = _scaled_mm_blockwise_ok(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        weights = {
            "bf16": w,
            "q": pack_int_k(torch.randint(0, 16, (n, k), device="cuda"), 4),
            "scales": torch.full((n, k // 128), 0.01, device="cuda", dtype=torch.float16),
            "fp8": w.to(torch.float8_e4m3fn),
            "fp8_scale": torch.ones(n // 128, k // 128, device="cuda"),
            "channel_scale": torch.ones(n, device="cuda"),
            "int8": torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8),
        }
        crossover = None
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "n": n, "k": k, "m": m, **time_one(x, weights, blockwise)}
            if crossover is None and row["int4_dequant_ms"] < row["int4_fused_ms"]:
                crossover = m
            rows.append(row)
            print(" ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                           for key, value in row.items()), flush=True)  # fmt: skip
        print(f"{name}: dequantize+cuBLAS beats the fused int4 kernel from M={crossover}", flush=True)
        rows.append({"shape": name, "crossover_m": crossover})
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
