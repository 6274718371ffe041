"""GPU sweep: key tile, warps, pipeline stages and split count of the Triton decode kernel at the latency
benchmark's decode shapes (1 x 32K, 64 x 4K, 16 x 8K; 1 x 128K for reference). Prints the default and the fastest
settings per case with GB/s. On a CUDA GPU: python3 scripts/probes/sweep_decode.py
"""

from __future__ import annotations

import itertools
import json
import os

from longserve.bench.kernels.attention import BenchCase, bench_attention

CASES = (
    (BenchCase("decode_1x32k", 32767, 1), (32, 64, 128, 256)),
    (BenchCase("decode_64x4k", 4095, 1, num_reqs=64), (1, 2, 4)),
    (BenchCase("decode_16x8k", 8191, 1, num_reqs=16), (2, 3, 4, 5, 6, 8, 12, 16)),
    (BenchCase("decode_1x128k", 131071, 1), (64, 128, 256)),
)


def main() -> None:
    rows = []
    for case, split_choices in CASES:
        default = {**bench_attention([case], warmup=3, repeats=10)[0], "cfg": None}
        best = default
        # stage 1: tile/warps/stages at the default split count; stage 2: split counts at the best tile
        tiles = list(itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)))
        for stage, candidates in (("tile", tiles), ("splits", split_choices)):
            for cand in candidates:
                if stage == "tile":
                    cfg = {"BLOCK_N": cand[0], "num_warps": cand[1], "num_stages": cand[2]}
                    splits = default["num_splits"]
                else:
                    cfg, splits = best.get("cfg") or None, cand
                try:
                    r = bench_attention([case], decode_config=cfg, num_splits=splits, warmup=2, repeats=7)[0]
                except Exception as e:  # noqa: BLE001 - out of shared memory etc.: skip the setting
                    print(case.name, cfg, splits, "failed:", type(e).__name__)
                    continue
                r = {**r, "cfg": cfg, "num_splits": splits}
                rows.append(r)
                if r["ms"] < best["ms"]:
                    best = r
        print(
            f"{case.name}: default {default['ms'] * 1e3:.1f} us ({default.get('gbps', 0):.0f} GB/s, "
            f"{default['num_splits']} splits); best {best['ms'] * 1e3:.1f} us ({best.get('gbps', 0):.0f} GB/s)",
            json.dumps({k: best[k] for k in ("cfg", "num_splits", "ms")}),
            flush=True,
        )
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "sweep_decode.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
