"""The fused W4A16 kernel by rows (quant_gemm.WNA16_INT_ROWS) against dequantize + cuBLAS past the GEMV's sizes.

quant_gemm routes M > WNA16_GEMV_MAX_TOKENS (64) rows of an int4 product to dequantize + cuBLAS: a fixed
dequantization a step (the 8B's four projections ~0.25 ms a layer on an H100, from gate_up's and down's measured
times) plus cuBLAS reading the bf16 weight it wrote. The fused kernel reads the packed weights (4x fewer bytes) but was timed only by columns, which loaded
every byte twice, a byte a lane (and lost at every M, 2026-12-01). By rows it loads each row's bytes once. This
probe times both at the Llama-3.1-8B projections (GPTQ int4 g128, bf16, weights rotated through HBM, CUDA graphs)
for M from 65 up, over a few tiles, and prints the largest M up to which the best fused tile beats dequantize +
cuBLAS summed over the four projections: the value for quant_gemm.WNA16_FUSED_MAX_TOKENS.

    python3 scripts/probes/sweep_int4_fused.py [--tokens 65,128,256,512,1024,2048,4096]
"""

from __future__ import annotations

import argparse

import torch

from longserve.kernels.quant_gemm import wna16_config, wna16_gemm
from longserve.kernels.quant_reference import pack_int_k
from longserve.platform import cuda_graph_time_ms

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); None: wna16_config's default
    None,
    (64, 128, 64, 4, 3),
    (64, 128, 128, 4, 3),
    (128, 128, 64, 8, 4),
    (128, 64, 64, 4, 3),
    (128, 256, 64, 8, 3),
]
COPIES = (
    4  # weight sets rotated so that each call reads its weights from HBM (the 8B's gate_up is 59 MB packed)
)


def weights(n: int, k: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(COPIES):
        q = pack_int_k(torch.randint(0, 16, (n, k), generator=g), 4).cuda()
        s = (torch.rand(n, k // 128, generator=g) * 0.02 + 0.001).to(torch.bfloat16).cuda()
        out.append({"q": q, "s": s})
    return out


def timed(fn) -> float:
    """ms a call, as a CUDA graph of COPIES calls (one per weight set)."""
    return cuda_graph_time_ms(fn, 2, 10, 3) / COPIES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="65,128,256,512,1024,2048,4096")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    print(
        f"{torch.cuda.get_device_name()}: int4 g128, bf16 activations; ms a call (weights rotated over {COPIES})"
    )
    totals: dict[int, dict[str, float]] = {m: {} for m in tokens}
    for name, (n, k) in SHAPES.items():
        ws = weights(n, k, seed=n + k)
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def run(path: str, cfg: dict | None = None, x=x, ws=ws) -> None:
                for w in ws:
                    wna16_gemm(x, w["q"], w["s"], None, None, 4, 128, path=path, config=cfg)

            want = wna16_gemm(x, ws[0]["q"], ws[0]["s"], None, None, 4, 128, path="dequant").float()
            row = {"dequant": timed(lambda run=run: run("dequant"))}
            for tile in TILES:
                if tile is None:
                    cfg, label = wna16_config(m, n, k, 128, False, x.device), "default"
                else:
                    bm, bn, bk, warps, stages = tile
                    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "num_warps": warps,
                           "num_stages": stages}  # fmt: skip
                    label = f"{bm}x{bn}x{bk} w{warps} s{stages}"
                try:
                    got = wna16_gemm(x, ws[0]["q"], ws[0]["s"], None, None, 4, 128, path="fused", config=cfg)
                    err = ((got.float() - want).norm() / want.norm()).item()
                    assert err < 1e-2, f"{label}: relative error {err:.3g}"
                    row[label] = timed(lambda run=run, cfg=cfg: run("fused", cfg))
                except Exception as exc:  # out of resources: the next tile
                    print(f"  {name} M={m} {label}: {type(exc).__name__}: {str(exc)[:80]}")
            best = min((v, t) for t, v in row.items() if t != "dequant")
            for label, ms in row.items():
                totals[m][label] = totals[m].get(label, 0.0) + ms
            print(f"  {name:<8} M={m:>5} dequant+cuBLAS {row['dequant']:.4f}  fused best {best[0]:.4f} ({best[1]})"
                  f"  default {row.get('default', float('nan')):.4f}", flush=True)  # fmt: skip
    up_to, unbroken = 0, True
    for m in tokens:
        fused = {t: v for t, v in totals[m].items() if t != "dequant"}
        label = min(fused, key=fused.get)
        wins = fused[label] < totals[m]["dequant"]
        print(f"all four M={m:>5}: dequant+cuBLAS {totals[m]['dequant']:.4f} ms, fused {fused[label]:.4f} ({label}), "
              f"default tile {fused.get('default', float('nan')):.4f}{'  <- fused' if wins else ''}")  # fmt: skip
        unbroken = unbroken and wins
        up_to = m if unbroken else up_to
    print(
        f"WNA16_FUSED_MAX_TOKENS: {up_to} (the largest M of an unbroken run of fused wins from {tokens[0]})"
    )


if __name__ == "__main__":
    main()
