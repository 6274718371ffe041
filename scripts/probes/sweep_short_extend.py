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


def main() -> None:
    rows = []
    for case in CASES:
        best = None
        for block_m, block_n, warps, stages, splits in itertools.product(
            (64,), (32, 64, 128), (4, 8), (2, 3, 4), (None, 32)
        ):
            config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
            try:
                r = bench_attention([case], extend_config=config, extend_splits=splits, warmup=2, repeats=5)[
                    0
                ]
            except Exception as e:  # noqa: BLE001 - out of shared memory etc.: skip the setting
                print(case.name, config, splits, "failed:", type(e).__name__)
                continue
            r = {**r, **config, "splits": r["num_splits"]}
            rows.append(r)
            if best is None or r["ms"] < best["ms"]:
                best = r
        default = bench_attention([case], extend_config=BACKEND_SHORT, warmup=2, repeats=5)[0]
        print(f"{case.name}: default {default['ms']:.4f} ms; best {best['ms']:.4f} ms with", json.dumps(best))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "sweep_short_extend.json"), "w") as f:
        json.dump(rows, f, indent=1)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
