"""The decode step's unquantized linears at batch 1-128: cuBLAS (F.linear) against kernels/dense_gemm.py's Triton
GEMM, per projection of the Llama-3.1-8B or the seed's Qwen3.5-35B-A3B, weights rotated over 256 MB of copies
(read from HBM as in a decode step, not from L2), CUDA-graph timed. Each Triton setting is checked against
F.linear first. One line per (projection, M): cuBLAS us and TB/s, the default tiles', the best tiles' (a small
sweep) and which. (`python -m longserve.kernels.tune_gemv --kernels dense` sweeps wider and writes the table the
engine reads.)

    python3 scripts/gpu/bench_dense_gemm.py [--tokens 16,32,64,128] [--model llama-3.1-8b] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from longserve.kernels import dense_gemm
from longserve.kernels.tune_gemv import PROJECTIONS as TUNED_SHAPES
from longserve.kernels.tune_gemv import rotating_weights
from longserve.platform import cuda_graph_time_ms

# (N, K): the tuner's shapes (the seed's bf16 products among them), the 8B's lm_head too
PROJECTIONS = {
    "llama-3.1-8b": {**TUNED_SHAPES["llama-3.1-8b"], "lm_head": (128256, 4096)},
    "qwen3.5-35b-a3b": TUNED_SHAPES["qwen3.5-35b-a3b"],
}
SWEEP = {"BLOCK_N": [64, 128], "num_stages": [3, 4], "split": [0.5, 1, 2]}  # split: x the default count


def time_us(run, cfg) -> float:
    return cuda_graph_time_ms(lambda: run(cfg), 3, 20, 5) * 1e3


def bench(m: int, n: int, k: int, device: torch.device) -> dict:
    g = torch.Generator(device=device).manual_seed(m + n)
    x = torch.randn(m, k, device=device, generator=g).bfloat16()
    w = (torch.randn(n, k, device=device, generator=g) * k**-0.5).bfloat16()
    cublas = rotating_weights(lambda cfg, w: F.linear(x, w), (w,), device)
    default = dense_gemm.dense_gemm_config(m, n, k, device)  # (not a tuned table's tiles)
    triton = rotating_weights(lambda cfg, w: dense_gemm.dense_gemm(x, w, config=cfg or default), (w,), device)
    want = F.linear(x.float(), w.float())
    rows = {"cublas": (time_us(cublas, None), None), "default": (time_us(triton, None), default)}
    best = (float("inf"), None)
    for bn, stages, split in itertools.product(SWEEP["BLOCK_N"], SWEEP["num_stages"], SWEEP["split"]):
        cfg = {"BLOCK_N": bn, "num_stages": stages, "SPLIT_K": max(1, round(default["SPLIT_K"] * split))}
        try:
            got = dense_gemm.dense_gemm(x, w, config=cfg).float()
        except OutOfResources:  # 128 rows, BLOCK_N 128, 4 stages: 256 KB of smem (H200: 227)
            continue
        err = ((got - want).norm() / want.norm()).item()
        if not err < 1e-2:
            raise RuntimeError(f"{cfg}: relative error {err:.2e} against F.linear")
        us = time_us(triton, cfg)
        best = min(best, (us, cfg), key=lambda t: t[0])
    rows["best"] = best
    gb = n * k * 2 / 1e9
    return {
        name: {"us": round(us, 1), "TB/s": round(gb / us * 1e3, 2), "config": cfg}
        for name, (us, cfg) in rows.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="16,32,64,128")
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(PROJECTIONS))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    out = []
    for m in (int(t) for t in args.tokens.split(",")):
        for name, (n, k) in PROJECTIONS[args.model].items():
            r = bench(m, n, k, device)
            out.append({"projection": name, "M": m, **r})
            best_cfg = {key: r["best"]["config"][key] for key in ("BLOCK_N", "num_stages", "SPLIT_K")}
            print(f"M={m:<4} {name:<14} cuBLAS {r['cublas']['us']:8.1f} us ({r['cublas']['TB/s']:.2f} TB/s)  "
                  f"triton {r['default']['us']:8.1f} ({r['default']['TB/s']:.2f})  best {r['best']['us']:8.1f} "
                  f"({r['best']['TB/s']:.2f}) {best_cfg}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
