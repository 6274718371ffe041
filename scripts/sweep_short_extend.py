"""GPU sweep: tile shape, warps and split count of the Triton extend kernel for short chunks over a long
cached prefix (the prefix-hit case: 64..512 new tokens over 32K). Prints the fastest settings per case.
Run on the GPU machine: python3 scripts/sweep_short_extend.py
"""

from __future__ import annotations

import itertools
import json
import os

import torch

from longserve.kernels.bench_attention import BenchCase, bench_attention

CASES = (BenchCase("suffix_64_over_32k", 32768, 64), BenchCase("suffix_512_over_32k", 32768, 512))


def main() -> None:
    rows = []
    for case in CASES:
        best = None
        for block_m, block_n, warps, stages, splits in itertools.product(
            (64, 128), (64,), (4, 8), (3,), (8, 16, 32, 64, 128)
        ):
            config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
            try:
                r = bench_attention([case], extend_config=config, extend_splits=splits, warmup=2, repeats=5)[
                    0
                ]
            except Exception as e:  # noqa: BLE001 - out of shared memory etc.: skip the setting
                print(case.name, config, splits, "failed:", type(e).__name__)
                continue
            r = {**r, **config, "splits": splits}
            rows.append(r)
            if best is None or r["ms"] < best["ms"]:
                best = r
        default = bench_attention([case], warmup=2, repeats=5)[0]
        print(f"{case.name}: default {default['ms']:.4f} ms; best {best['ms']:.4f} ms with", json.dumps(best))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "sweep_short_extend.json"), "w") as f:
        json.dump(rows, f, indent=1)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
