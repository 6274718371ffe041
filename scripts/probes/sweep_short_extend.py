"""GPU sweep: tile shape, warps and split count of the Triton extend kernel for short chunks over a long
cached prefix (the prefix-hit case: 64..512 new tokens over 32K). Prints the fastest settings per case.
On a CUDA GPU: python3 scripts/probes/sweep_short_extend.py
"""

from __future__ import annotations

import itertools
import json
import os

import torch

from longserve.bench.kernels.attention import BenchCase, bench_attention

CASES = (BenchCase("suffix_64_over_32k", 32768, 64), BenchCase("suffix_256_over_32k", 32768, 256))
# what the triton backend launches for a short chunk (attention/triton_backend.py), splits of its choosing
BACKEND_SHORT = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


# Registers cap the programs an SM holds: 64x64 tiles (4 warps) compile to 252 registers, two programs an SM
# (sm90 compile, Triton 3.9); 64x32 tiles to 226 with 49 KB of shared memory, so capped at 168 (three) or 128
# (four, with spills) they may hide more of each program's QK -> softmax -> PV chain behind the others'.
# OCCUPANCY=1 sweeps these against the default instead of the tile grid.
OCCUPANCY = (
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "maxnreg": 168},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "maxnreg": 168},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "maxnreg": 128},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "maxnreg": 128},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "maxnreg": 168},
    {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 3},
)


def configs():
    if os.environ.get("OCCUPANCY") == "1":
        return [(c, s) for c in OCCUPANCY for s in (None, 16, 32)]
    return [
        ({"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": st}, s)
        for m, n, w, st, s in itertools.product((64,), (32, 64, 128), (4, 8), (2, 3, 4), (None, 32))
    ]


def main() -> None:
    rows = []
    for case in CASES:
        best = None
        for config, splits in configs():
            try:
                r = bench_attention([case], extend_config=config, extend_splits=splits, warmup=2, repeats=5)[
                    0
                ]
            except Exception as e:  # noqa: BLE001 - out of shared memory etc.: skip the setting
                print(case.name, config, splits, "failed:", type(e).__name__)
                continue
            r = {**r, **config, "splits": r["num_splits"]}
            rows.append(r)
            print(case.name, json.dumps(config), f"splits {r['splits']}: {r['ms']:.4f} ms", flush=True)
            if best is None or r["ms"] < best["ms"]:
                best = r
        default = bench_attention([case], extend_config=BACKEND_SHORT, warmup=2, repeats=5)[0]
        print(f"{case.name}: default {default['ms']:.4f} ms; best {best['ms']:.4f} ms with", json.dumps(best))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "sweep_short_extend.json"), "w") as f:
        json.dump(rows, f, indent=1)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
