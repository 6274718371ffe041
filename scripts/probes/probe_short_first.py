"""GPU probe: time to first token of a conversation's next turn (32K cached + 64 new tokens) that arrives
while a cold 32K-token prompt is being prefilled in 8K chunks, with --schedule-policy fcfs and short-first,
in one process (Llama-3.1-8B shape, dummy weights). The turn is added right after the cold prompt's first
chunk; its TTFT counts from then. On a CUDA GPU: python3 scripts/probes/probe_short_first.py
(PROBE_CACHED / PROBE_COLD: smaller prompts for a CPU dry run with --config tiny).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

from longserve.bench import latency
from longserve.bench.latency_cases import EngineBench
from longserve.sched.scheduler import SchedulerConfig

CACHED = int(os.environ.get("PROBE_CACHED", "32768"))
COLD = int(os.environ.get("PROBE_COLD", "32768"))
REPEAT = 3


def probe(llm, args, skipped):
    from longserve.sampling_params import SamplingParams

    eng = llm.engine
    bench = EngineBench(llm, args)
    one = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    doc = bench.prompt(CACHED)
    llm.generate(doc + bench.prompt(8), one, use_tqdm=False)  # the conversation so far: cached
    base = eng.scheduler.config
    short_first = dataclasses.replace(eng.config, schedule_policy="short-first")
    short = SchedulerConfig.from_engine_config(short_first).short_prefill_tokens
    results: dict[str, list[tuple[float, float]]] = {}
    for policy, limit in [("fcfs", 0), ("short-first", short)] * (REPEAT + 1):
        eng.scheduler.config = dataclasses.replace(base, short_prefill_tokens=limit)
        t_cold = time.perf_counter()
        cold_id = eng.add_request(bench.prompt(COLD), one)
        eng.step()  # the cold prompt's first chunk
        t_turn = time.perf_counter()
        turn_id = eng.add_request(doc + bench.prompt(64), one)
        firsts: dict[str, float] = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.outputs[0].token_ids and out.request_id not in firsts:
                    firsts[out.request_id] = time.perf_counter()
        results.setdefault(policy, []).append((firsts[turn_id] - t_turn, firsts[cold_id] - t_cold))
    print(
        f"{CACHED:,} cached + 64 new, arriving during a cold {COLD:,}-token prefill in chunks of "
        f"{eng.config.chunked_prefill_size:,} (median of {REPEAT}, after 1 warm-up):"
    )
    for policy, runs in results.items():
        turn = statistics.median(r[0] for r in runs[1:])
        cold = statistics.median(r[1] for r in runs[1:])
        print(f"  {policy:<12} turn TTFT {turn * 1e3:8.1f} ms   cold prompt TTFT {cold * 1e3:8.1f} ms")
    sys.exit(0)


if __name__ == "__main__":
    extra = sys.argv[1:] or ["--config", "llama-3.1-8b", "--dtype", "bfloat16"]
    # the pool is sized for the longest --prompt-lens: room for the cached conversation, the cold prompt and
    # the turn, so that no policy evicts the conversation (fcfs would then recompute it)
    latency.run_latency(
        ["--load-format", "dummy", "--prompt-lens", str(COLD + 2 * CACHED + 256), *extra], measure=probe
    )
