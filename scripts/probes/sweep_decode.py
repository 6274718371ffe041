"""GPU sweep: key tile, warps, pipeline stages and split count of the Triton decode kernel at the latency
benchmark's decode shapes (1 x 32K, 64 x 4K, 16 x 8K; 1 x 128K for reference). Prints the default and the fastest
settings per case with GB/s, and writes every timing to $OUT/sweep_decode[_SHAPE].json. On a CUDA GPU:

    python3 scripts/probes/sweep_decode.py                    # the Llama-3.1-8B's heads (32 on 8, of 128)
    python3 scripts/probes/sweep_decode.py --shape qwen3.5    # the seed's attention layers (16 on 2, of 256)
"""

from __future__ import annotations

import argparse
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
# (query heads, KV heads, head_dim), the cases, the tiles swept (BLOCK_N, warps, stages)
SHAPES = {
    "llama": ((32, 8, 128), CASES, list(itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)))),
    # the seed's Qwen3.5-35B-A3B attention layers: 2 KV heads, so a lone request splits its keys over the chip
    "qwen3.5": (
        (16, 2, 256),
        (
            (BenchCase("decode_1x32k", 32767, 1), (16, 32, 64, 128)),
            (BenchCase("decode_8x8k", 8191, 1, num_reqs=8), (4, 8, 16, 32)),
            (BenchCase("decode_64x4k", 4095, 1, num_reqs=64), (1, 2, 4, 8)),
        ),
        list(itertools.product((16, 32, 64), (4, 8), (1, 2, 3))),
    ),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama", choices=sorted(SHAPES))
    args = p.parse_args()
    (num_q, num_kv, head_dim), cases, tiles = SHAPES[args.shape]
    shape = {"num_q_heads": num_q, "num_kv_heads": num_kv, "head_dim": head_dim}
    rows = []
    for case, split_choices in cases:
        default = {**bench_attention([case], warmup=3, repeats=10, **shape)[0], "cfg": None}
        best = default
        # stage 1: tile/warps/stages at the default split count; stage 2: split counts at the best tile
        for stage, candidates in (("tile", tiles), ("splits", split_choices)):
            for cand in candidates:
                if stage == "tile":
                    cfg = {"BLOCK_N": cand[0], "num_warps": cand[1], "num_stages": cand[2]}
                    splits = default["num_splits"]
                else:
                    cfg, splits = best.get("cfg") or None, cand
                try:
                    r = bench_attention(
                        [case], decode_config=cfg, num_splits=splits, warmup=2, repeats=7, **shape
                    )[0]
                except Exception as e:  # noqa: BLE001 - out of shared memory etc.: skip the setting
                    print(case.name, cfg, splits, "failed:", type(e).__name__)
                    continue
                r = {**r, "cfg": cfg, "num_splits": splits, "stage": stage}
                rows.append(r)
                if r["ms"] < best["ms"]:
                    best = r
        print(
            f"{case.name}: default {default['ms'] * 1e3:.1f} us ({default.get('gbps', 0):.0f} GB/s, "
            f"{default['num_splits']} splits); best {best['ms'] * 1e3:.1f} us ({best.get('gbps', 0):.0f} GB/s)",
            json.dumps({k: best[k] for k in ("cfg", "num_splits", "ms")}),
            flush=True,
        )
    name = "sweep_decode.json" if args.shape == "llama" else f"sweep_decode_{args.shape}.json"
    with open(os.path.join(os.environ.get("OUT", "/tmp"), name), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
