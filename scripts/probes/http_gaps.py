"""Where a served workload's time went, from the client's side: `bench compare`'s results.json holds every
request's start, TTFT and every gap between its streamed tokens. Per endpoint: the fastest, median and P95
TTFT (with the prompt lengths of the slowest), and the gaps between tokens longer than a decode step (the steps
that also computed prompts, as the decoding requests saw them): how many, and their deciles (percentiles by
nearest rank: they may differ from the report's by a request). With --first N, the gaps of the N earliest
requests one by one (a multi-turn opening's chunk steps, for example).

    python3 scripts/probes/http_gaps.py benchmarks/results/2026-12-02_f876099_http_piecewise0/random/results.json.xz

(The committed results.json files over 100 KB are compressed, xz since the nineteenth session: the device copies
the tree with a 64 MiB cap.)
"""

from __future__ import annotations

import argparse
import json

from longserve.bench.records import open_record


def _at(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a results.json (or .json.gz / .json.xz) of `longserve bench compare`")
    ap.add_argument("--long-gap-ms", type=float, default=12.0, help="gaps longer than this count as long")
    ap.add_argument("--first", type=int, default=0, help="print the long gaps of the N earliest requests")
    args = ap.parse_args()
    with open_record(args.results) as f:
        data = json.load(f)
    for run in data["runs"]:
        reqs = [r for r in run["requests"] if r.get("success")]
        ttft = sorted(r["ttft"] * 1e3 for r in reqs)
        slow = sorted(reqs, key=lambda r: -r["ttft"])[:5]
        gaps = [g * 1e3 for r in reqs for g in r["itl"]]
        long = sorted(g for g in gaps if g > args.long_gap_ms)
        print(f"{run['name']}: {len(reqs)} requests; TTFT ms fastest {_at(ttft, 0):.1f}, P50 {_at(ttft, 0.5):.1f}, "
              f"P95 {_at(ttft, 0.95):.1f} (slowest prompts: {[r['prompt_len'] for r in slow]})")  # fmt: skip
        deciles = ", ".join(f"{_at(long, i / 10):.0f}" for i in range(10))
        print(f"  gaps between tokens: {len(gaps)}, of them {len(long)} over {args.long_gap_ms:g} ms "
              f"(deciles {deciles}; sum {sum(long) / 1e3:.2f} s)")  # fmt: skip
        for r in sorted(reqs, key=lambda r: r["start"])[: args.first]:
            big = [round(g * 1e3) for g in r["itl"] if g * 1e3 > args.long_gap_ms]
            print(f"  request at {r['start']:.3f} s ({r['prompt_len']} tokens): TTFT {r['ttft'] * 1e3:.0f} ms, "
                  f"long gaps {big}")  # fmt: skip


if __name__ == "__main__":
    main()
