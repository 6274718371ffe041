"""GPU probe: the int4 weights' dequantization (quant_gemm.wna16_dequantize) by its two kernels, at the shapes the
prefill dequantizes every chunk: the Qwen3-30B-A3B experts flattened as moe_wna16.dequantize_experts hands them over
(w13 [128 * 1536, 2048], w2 [128 * 2048, 768]) and the Llama-3.1-8B gate_up and down. GPTQ int4, groups of 128,
bf16 out. The [BLOCK_K, BLOCK_N] kernel against DEQUANT_ROWS's [rows, BLOCK_K] one at several rows a program and
warps; GB/s of int4 read and bf16 written. On a CUDA GPU: python3 scripts/probes/sweep_dequant.py
"""

from __future__ import annotations

import functools
import itertools
import json
import os

import torch

from longserve.kernels import quant_gemm
from longserve.kernels.quant_reference import pack_int_k
from longserve.platform import cuda_time_ms

SHAPES = {
    "a3b_w13": (128 * 1536, 2048),
    "a3b_w2": (128 * 2048, 768),
    "8b_gate_up": (28672, 4096),
    "8b_down": (4096, 14336),
}
ROWS = (16, 32, 64, 128)
WARPS = (2, 4, 8)


def main() -> None:
    rows_out = []
    for name, (n, k) in SHAPES.items():
        q = pack_int_k(torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int32), 4)
        scales = torch.rand(n, k // 128, device="cuda", dtype=torch.float16) * 0.01
        args = (q, scales, None, None, 4, 128, torch.bfloat16)
        moved = q.numel() * q.element_size() + scales.numel() * 2 + n * k * 2
        settings = [("columns", None, None)] + [("rows", r, w) for r, w in itertools.product(ROWS, WARPS)]
        results = []
        for kind, r, w in settings:
            quant_gemm.DEQUANT_ROWS = kind == "rows"
            if r is not None:
                quant_gemm.DEQUANT_ROWS_BLOCK_N, quant_gemm.DEQUANT_ROWS_WARPS = r, w
            ms = cuda_time_ms(
                functools.partial(quant_gemm.wna16_dequantize, *args), warmup=3, iters=10, repeats=5
            )
            row = {"shape": name, "n": n, "k": k, "kernel": kind, "rows": r, "warps": w, "ms": ms,
                   "gbps": moved / ms / 1e6}  # fmt: skip
            results.append(row)
            print(json.dumps(row), flush=True)
        base = results[0]
        best = min(results, key=lambda x: x["ms"])
        print(f"{name}: columns kernel {base['ms'] * 1e3:.0f} us ({base['gbps']:.0f} GB/s); best {best['kernel']} "
              f"rows={best['rows']} warps={best['warps']} {best['ms'] * 1e3:.0f} us ({best['gbps']:.0f} GB/s)",
              flush=True)  # fmt: skip
        rows_out += results
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "sweep_dequant.json"), "w") as f:
        json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
