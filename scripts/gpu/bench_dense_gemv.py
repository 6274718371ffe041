"""Time the 16-bit decode GEMV (longserve/kernels/dense_gemv.py) against bf16 cuBLAS (F.linear) at the decode
shapes of the Qwen3-30B-A3B and Llama-3.1-8B models, per number of tokens M, to set what only a GPU can measure:

- dense_gemv.DENSE_GEMV_MAX_TOKENS: the M up to which the GEMV beats cuBLAS at every shape that decodes
  through it (printed last, "dense gemv beats cuBLAS up to M=");
- the GEMV's default tiles: --sweep times candidate configs at M=1 and prints the best per shape.

Each time is device ms per call from a CUDA graph of 20 calls (decode steps replay graphs), with the achieved
bandwidth of the weights + activations + output against 4.2 TB/s (the H200's measured copy bandwidth).

    python scripts/gpu/bench_dense_gemv.py --sweep --output-json /tmp/dense_gemv.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from longserve.kernels.dense_gemv import DENSE_GEMV_MAX_BLOCK_M, dense_gemv, dense_gemv_config
from longserve.platform import cuda_graph_time_ms

SHAPES = {  # name: (N, K)
    "a3b_qkv": (5120, 2048), "a3b_o": (2048, 4096), "a3b_router": (128, 2048), "a3b_lm_head": (151936, 2048),
    "8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (28672, 4096), "8b_down": (4096, 14336),
}  # fmt: skip
HBM_GBPS = 4200.0


def graph_ms(fn) -> float:
    try:
        return cuda_graph_time_ms(fn, warmup=3, iters=20, repeats=5)
    except Exception as e:  # noqa: BLE001  (a config the compiler or the GPU refuses is reported, not timed)
        print(f"failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return float("nan")


def pct_hbm(m: int, n: int, k: int, ms: float) -> float:
    return 100.0 * (n * k + m * k + m * n) * 2 / (ms * 1e-3) / 1e9 / HBM_GBPS


def sweep(name: str, x: torch.Tensor, w: torch.Tensor) -> dict:
    """Candidate tiles at this shape and M: the fastest five, and the default's time."""
    results = []
    for bn, bk, split, stages in itertools.product((4, 8, 16), (128, 256, 512), (1, 2), (2, 3, 4)):
        cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": 4, "num_stages": stages}
        ms = graph_ms(lambda cfg=cfg: dense_gemv(x, w, config=cfg))
        if ms == ms:  # not nan
            results.append((ms, cfg))
    results.sort(key=lambda r: r[0])
    m, k = x.shape
    n = w.shape[0]
    best_ms, best = results[0]
    print(f"{name} M={m}: best {best_ms * 1e3:.1f} us ({pct_hbm(m, n, k, best_ms):.0f}% of 4.2 TB/s) with {best}",
          flush=True)  # fmt: skip
    return {
        "shape": name,
        "m": m,
        "best_ms": best_ms,
        "best": best,
        "top5": [{"ms": t, **c} for t, c in results[:5]],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--sweep", action="store_true", help="time candidate tiles at M=1 (54 compiles)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",") if int(t) <= DENSE_GEMV_MAX_BLOCK_M]
    rows, up_to_all = [], None
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        up_to, losing = 0, False
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(dense_gemv(x, w), F.linear(x, w), atol=2e-2, rtol=2e-2)
            cublas = graph_ms(lambda: F.linear(x, w))  # noqa: B023
            gemv = graph_ms(lambda: dense_gemv(x, w))  # noqa: B023
            row = {"shape": name, "n": n, "k": k, "m": m, "cublas_ms": cublas, "gemv_ms": gemv,
                   "cublas_pct_hbm": pct_hbm(m, n, k, cublas), "gemv_pct_hbm": pct_hbm(m, n, k, gemv),
                   "config": dense_gemv_config(m, n, k, x.device)}  # fmt: skip
            rows.append(row)
            print(f"{name} M={m}: cuBLAS {cublas * 1e3:.1f} us ({row['cublas_pct_hbm']:.0f}%), gemv "
                  f"{gemv * 1e3:.1f} us ({row['gemv_pct_hbm']:.0f}%) with {row['config']}", flush=True)  # fmt: skip
            losing = losing or not gemv < cublas
            up_to = up_to if losing else m
            if args.sweep and m == 1:
                rows.append(sweep(name, x, w))
        print(f"{name}: the dense gemv beats cuBLAS up to M={up_to}", flush=True)
        up_to_all = up_to if up_to_all is None else min(up_to_all, up_to)
    print(f"dense gemv beats cuBLAS up to M={up_to_all} at every shape (dense_gemv.DENSE_GEMV_MAX_TOKENS)",
          flush=True)  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
