"""Time the quantized GEMMs at the Llama-3.1-8B projections against bf16 cuBLAS, per number of tokens M, to set
the constants that only a GPU can measure:

- quant_gemm.WNA16_DEQUANT_MIN_TOKENS: the M from which dequantize-then-cuBLAS beats the fused W4A16 kernel
  (printed as "crossover"); both paths are timed at every M.
- quant_gemm.WNA16_GEMV_MAX_TOKENS: the M up to which the decode GEMV (kernels/quant_gemv.py) beats both
  (printed as "gemv beats ... up to M="; set the switch to the smallest over the shapes). Its column carries its
  achieved bandwidth (GB/s of the packed weights, scales, activations and output) and the % of 4.2 TB/s (the
  H200's measured copy bandwidth: the floor), as does the fused kernel's.
- quant_gemv.WNA16_GEMV_FMA_MAX_TOKENS and the GEMV's tiles: --sweep-gemv times candidate configs per shape and M
  and prints the best ("gemv best"), and the block-FP8 GEMV's ("fp8 gemv best").
- quant_fp8.FP8_BLOCK_USE_SCALED_MM: whether cuBLAS's block-scaled FP8 (F.scaled_mm) beats the Triton block GEMM.
- quant_fp8.FP8_GEMV_MAX_TOKENS: the M up to which the FP8 decode GEMVs (kernels/fp8_gemv.py) beat the Triton
  block GEMM with its quantization launch (block) and torch._scaled_mm (per channel), printed as "fp8 gemv
  beats ... up to M="; the block GEMV's GB/s too.

    python scripts/gpu/bench_quant_kernels.py --output-json /tmp/kernels_quant.json
    python scripts/gpu/bench_quant_kernels.py --tokens 1,2,4,8,16 --sweep-gemv --output-json /tmp/gemv_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from longserve.kernels.fp8_gemv import (
    FP8_GEMV_MAX_BLOCK_M,
    fp8_block_gemv,
    fp8_block_gemv_supported,
    fp8_channel_gemv,
)
from longserve.kernels.int8_linear import int8_scaled_linear
from longserve.kernels.quant_fp8 import (
    _scaled_mm_blockwise_ok,
    fp8_block_linear,
    fp8_scaled_linear,
    per_token_group_quant,
)
from longserve.kernels.quant_gemm import wna16_gemm
from longserve.kernels.quant_gemv import wna16_gemv_config, wna16_gemv_supported
from longserve.kernels.quant_reference import pack_int_k
from longserve.platform import cuda_graph_time_ms

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 8192]
HBM_GBPS = 4200.0  # H200: the copy bandwidth a memory-bound kernel can reach (of 4.8 TB/s peak)


def int4_bytes(m: int, n: int, k: int) -> int:
    """Bytes an int4 g128 product must move: packed weights, fp16 scales, bf16 activations and output."""
    return n * k // 2 + n * (k // 128) * 2 + m * k * 2 + m * n * 2


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def graph_ms(fn) -> float:
    """Device ms per call, from a CUDA graph of 20 calls: decode steps replay graphs, and timing eager calls
    measured host launch time instead (at M <= 32 every int4 path read ~0.1 ms; run at d7b54d5, 2026-12-02)."""
    try:
        return cuda_graph_time_ms(fn, warmup=3, iters=20, repeats=5)
    except Exception as e:  # noqa: BLE001  (a path that cannot be captured is reported, not timed eagerly)
        print(f"not capturable: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return float("nan")


def time_one(x: torch.Tensor, t: dict[str, torch.Tensor], blockwise: bool) -> dict[str, float]:
    """Milliseconds of each way to compute x @ W^T for one M."""
    row = {
        "bf16_ms": graph_ms(lambda: torch.nn.functional.linear(x, t["bf16"])),
        "int4_fused_ms": graph_ms(
            lambda: wna16_gemm(x, t["q"], t["scales"], None, None, 4, 128, path="fused")
        ),
        "int4_dequant_ms": graph_ms(
            lambda: wna16_gemm(x, t["q"], t["scales"], None, None, 4, 128, path="dequant")
        ),
        "int4_gemv_ms": (
            graph_ms(lambda: wna16_gemm(x, t["q"], t["scales"], None, None, 4, 128, path="gemv"))
            if wna16_gemv_supported(x.shape[0], x.shape[1], 4)
            else float("nan")
        ),
        "fp8_block_triton_ms": graph_ms(
            lambda: fp8_block_linear(x, t["fp8"], t["fp8_scale"], (128, 128), use_scaled_mm=False)
        ),
        "fp8_block_gemv_ms": (
            graph_ms(lambda: fp8_block_gemv(x, t["fp8"], t["fp8_scale"], (128, 128)))
            if fp8_block_gemv_supported(x.shape[0], (128, 128))
            else float("nan")
        ),
        "fp8_channel_ms": graph_ms(lambda: fp8_scaled_linear(x, t["fp8"], t["channel_scale"])),
        "fp8_channel_gemv_ms": (
            graph_ms(
                lambda: fp8_channel_gemv(*per_token_group_quant(x, 0), t["fp8"], t["channel_scale"], x.dtype)
            )
            if x.shape[0] <= FP8_GEMV_MAX_BLOCK_M
            else float("nan")
        ),
        "int8_ms": graph_ms(lambda: int8_scaled_linear(x, t["int8"], t["channel_scale"])),
    }
    nbytes = int4_bytes(x.shape[0], t["q"].shape[0], x.shape[1])
    for path in ("gemv", "fused"):
        row[f"int4_{path}_gbps"] = gbps(nbytes, row[f"int4_{path}_ms"])
        row[f"int4_{path}_pct_hbm"] = 100.0 * row[f"int4_{path}_gbps"] / HBM_GBPS
    m, n, k = x.shape[0], t["fp8"].shape[0], x.shape[1]
    row["fp8_block_gemv_gbps"] = gbps(
        n * k + n * (k // 128) * 4 // 128 + m * k * 2 + m * n * 2, row["fp8_block_gemv_ms"]
    )
    if blockwise:
        row["fp8_block_cublas_ms"] = graph_ms(
            lambda: fp8_block_linear(x, t["fp8"], t["fp8_scale"], (128, 128), use_scaled_mm=True)
        )
    return row


def sweep_gemv(name: str, x: torch.Tensor, t: dict[str, torch.Tensor]) -> dict:
    """Time candidate GEMV configs for one shape and M; the fastest, with the default's time."""
    m, k = x.shape
    n = t["q"].shape[0]
    default = wna16_gemv_config(m, n, k, 128, 4, False, x.dtype, x.device)
    n_blocks = lambda bn: -(-n // bn)  # noqa: E731
    results = []
    dots = (0, 1) if m >= 2 else (0,)
    for bn, bk, warps, dot in itertools.product((32, 64, 128), (64, 128), (4, 8), dots):
        bm = max(16, triton_pow2(m)) if dot else triton_pow2(m)
        for split in sorted({1, max(1, default["SPLIT_K"] // 2), default["SPLIT_K"], default["SPLIT_K"] * 2,
                             max(1, -(-8 * 132 // n_blocks(bn)))}):  # fmt: skip
            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "USE_DOT": dot,
                   "SCALE_PER_COL": 0, "num_warps": warps, "num_stages": 2}  # fmt: skip
            try:
                ms = graph_ms(lambda cfg=cfg: wna16_gemm(x, t["q"], t["scales"], None, None, 4, 128,
                                                             config=cfg, path="gemv"))  # fmt: skip
            except Exception as e:  # noqa: BLE001  (a config the compiler or the GPU refuses)
                print(f"gemv config {cfg} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            results.append((ms, cfg))
    results.sort(key=lambda r: r[0])
    best_ms, best = results[0]
    default_ms = graph_ms(lambda: wna16_gemm(x, t["q"], t["scales"], None, None, 4, 128, path="gemv"))
    nbytes = int4_bytes(m, n, k)
    row = {"shape": name, "m": m, "gemv_best_ms": best_ms, "gemv_best_pct_hbm": 100 * gbps(nbytes, best_ms) / HBM_GBPS,
           "gemv_default_ms": default_ms, "best": best, "default": default,
           "top5": [{"ms": ms, **cfg} for ms, cfg in results[:5]]}  # fmt: skip
    print(f"{name} M={m}: gemv best {best_ms:.4f} ms ({row['gemv_best_pct_hbm']:.0f}% of {HBM_GBPS / 1000} TB/s) "
          f"with {best}; default {default_ms:.4f} ms with {default}", flush=True)  # fmt: skip
    return row


def sweep_fp8_gemv(name: str, x: torch.Tensor, t: dict[str, torch.Tensor]) -> dict:
    """Time candidate block-FP8 GEMV tiles (kernels/fp8_gemv.py) for one shape and M; the fastest, with the
    default's time. At M=1 its loop issues 5.2 sm90 instructions a weight at 64 rows, 4.3 at 128, 3.9 at 256
    (SASS, Triton 3.6): whether that or the grid's size matters is what this measures."""
    m, k = x.shape
    n = t["fp8"].shape[0]
    results = []
    for bn, warps in itertools.product((64, 128, 256), (4, 8)):
        for split in (1, 2, 4, 8, 16):
            cfg = {"BLOCK_N": bn, "SPLIT_K": split, "num_warps": warps}
            ms = graph_ms(lambda cfg=cfg: fp8_block_gemv(x, t["fp8"], t["fp8_scale"], (128, 128), config=cfg))
            if ms == ms:  # not nan
                results.append((ms, cfg))
    results.sort(key=lambda r: r[0])
    best_ms, best = results[0]
    default_ms = graph_ms(lambda: fp8_block_gemv(x, t["fp8"], t["fp8_scale"], (128, 128)))
    nbytes = n * k + m * k * 2 + m * n * 2
    pct = 100 * gbps(nbytes, best_ms) / HBM_GBPS
    print(f"{name} M={m}: fp8 gemv best {best_ms:.4f} ms ({pct:.0f}% of {HBM_GBPS / 1000} TB/s) with {best}; "
          f"default {default_ms:.4f} ms", flush=True)  # fmt: skip
    return {"shape": name, "m": m, "fp8_gemv_best_ms": best_ms, "fp8_gemv_default_ms": default_ms, "best": best,
            "top5": [{"ms": ms, **cfg} for ms, cfg in results[:5]]}  # fmt: skip


def triton_pow2(v: int) -> int:
    return 1 << (v - 1).bit_length()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--output-json", default=None)
    p.add_argument("--sweep-gemv", action="store_true", help="time candidate GEMV configs at --sweep-tokens")
    p.add_argument(
        "--sweep-tokens", default="1,4,16", help="the M values the sweep covers (each compiles ~90)"
    )
    p.add_argument("--sweep-shapes", default="gate_up,down", help="shapes the sweep covers")
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
        crossover, gemv_up_to, gemv_losing = None, 0, False
        fp8_up_to, fp8_losing = 0, False
        channel_up_to, channel_losing = 0, False
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "n": n, "k": k, "m": m, **time_one(x, weights, blockwise)}
            if crossover is None and row["int4_dequant_ms"] < row["int4_fused_ms"]:
                crossover = m
            others = min(row["int4_fused_ms"], row["int4_dequant_ms"])
            if not gemv_losing and row["int4_gemv_ms"] < others:  # nan (not supported) compares False
                gemv_up_to = m
            else:
                gemv_losing = True
            if not fp8_losing and row["fp8_block_gemv_ms"] < row["fp8_block_triton_ms"]:
                fp8_up_to = m
            else:
                fp8_losing = True
            if not channel_losing and row["fp8_channel_gemv_ms"] < row["fp8_channel_ms"]:
                channel_up_to = m
            else:
                channel_losing = True
            # the best int4 path over bf16 cuBLAS (the target at decode: <= 0.6); a nan gemv is skipped
            row["int4_best_vs_bf16"] = min(others, row["int4_gemv_ms"]) / row["bf16_ms"]
            rows.append(row)
            print(" ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                           for key, value in row.items()), flush=True)  # fmt: skip
            if (
                args.sweep_gemv
                and str(m) in args.sweep_tokens.split(",")
                and name in args.sweep_shapes.split(",")
            ):
                rows.append(sweep_gemv(name, x, weights))
                if fp8_block_gemv_supported(m, (128, 128)):
                    rows.append(sweep_fp8_gemv(name, x, weights))
        print(f"{name}: dequantize+cuBLAS beats the fused int4 kernel from M={crossover}", flush=True)
        print(f"{name}: the int4 gemv beats the fused kernel and dequantize+cuBLAS up to M={gemv_up_to} "
              f"(quant_gemm.WNA16_GEMV_MAX_TOKENS; 0: never)", flush=True)  # fmt: skip
        print(f"{name}: the fp8 gemv beats the Triton block GEMM up to M={fp8_up_to}, the per-channel fp8 gemv "
              f"beats torch._scaled_mm up to M={channel_up_to} (quant_fp8.FP8_GEMV_MAX_TOKENS: the smaller; 0: "
              "never)", flush=True)  # fmt: skip
        rows.append({"shape": name, "crossover_m": crossover, "gemv_max_tokens": gemv_up_to,
                     "fp8_gemv_max_tokens": fp8_up_to, "fp8_channel_gemv_max_tokens": channel_up_to})  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
