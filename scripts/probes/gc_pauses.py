"""GPU probe (runs anywhere): the garbage collector's pauses inside each timed `bench latency` run.

Written when every cold 8K record since `c2dd2fd` had its second timed run 7-11% slower than its first, with a full
collection of the start-up heap as a candidate. On an H200 (RESULTS.md twentieth session) no collection inside a
timed run took over 3.2 ms, frozen heap or not, and the slow run was intermittent (the chip at its power limit).
This runs `longserve.bench.latency` with its arguments and prints, per
generate call, its wall time and the collections that ran inside it (count and ms per generation); with
`runner.warm_up.FREEZE_HEAP` set either way through scripts/probes/with_constants.py it compares the heap frozen
after the warm-up (the default) against not:
    python3 scripts/probes/with_constants.py longserve.runner.warm_up.FREEZE_HEAP=False -- scripts.probes.gc_pauses \
        --config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1 --repeat 6 --prompt-lens 8192
"""

from __future__ import annotations

import gc
import sys
import time
from collections import defaultdict

from longserve.bench import latency
from longserve.bench.latency_cases import EngineBench

_events: list[tuple[int, float]] = []  # (generation, ms) of every collection, in order
_started: list[float] = []


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _started.append(time.perf_counter())
    elif _started:
        _events.append((info["generation"], (time.perf_counter() - _started.pop()) * 1e3))


def _summary(events: list[tuple[int, float]]) -> str:
    by_gen: dict[int, list[float]] = defaultdict(list)
    for gen, ms in events:
        by_gen[gen].append(ms)
    return (
        ", ".join(f"gen{g} {len(v)}x {sum(v):.1f} ms (max {max(v):.1f})" for g, v in sorted(by_gen.items()))
        or "none"
    )


def main(argv: list[str]) -> None:
    gc.callbacks.append(_on_gc)
    generate = EngineBench.generate

    def timed(self: EngineBench, prompt: list[int]):  # noqa: ANN202
        first, t0 = len(_events), time.perf_counter()
        result = generate(self, prompt)
        wall = (time.perf_counter() - t0) * 1e3
        print(
            f"[gc] {len(prompt):>7} tokens {wall:9.2f} ms  collections: {_summary(_events[first:])}",
            flush=True,
        )
        return result

    EngineBench.generate = timed
    print(f"[gc] frozen objects before start-up: {gc.get_freeze_count()}", flush=True)
    latency.main(argv)
    print(f"[gc] whole run: {_summary(_events)}; frozen at the end: {gc.get_freeze_count()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
