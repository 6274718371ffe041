"""GPU probe: does a long prompt's prefill slow down when requests decode beside it? (Issue 19's multi-turn P95: in
the seventeenth session's HTTP call, RESULTS.md, the first 16K opening's two 8K chunks took ~477 ms alone and
every later pair 492-530 ms with 1-7 conversations decoding beside them, and each opening after the first
waited one more 8K step for its first token: the decodes cut its chunks to 8192 - d, which left 2d tokens for
a third step. The step budget now counts prompt tokens, the decodes riding on top.)

In one engine (Llama-3.1-8B shape, dummy weights): d requests are decoding (short prompts, long outputs), then a
PROMPT-token prompt is added and stepped to its first token; its TTFT, and its steps' prompt-token counts, for
d = 0, 1, 4, 8; for d > 0 once more with the budget lowered by d, which gives the chunks the decodes used to cut
(8192 - d, the former behaviour), so that the same call tells what whole chunks save. Each case REPEAT times after
a warm-up; the engine's own loop (`Engine.step`, overlapped as it serves), timed on the host with the device
synchronized before the prompt is added.

On a CUDA GPU: python3 scripts/probes/probe_chunk_beside_decodes.py
(PROBE_PROMPT=2048 with --config tiny --device cpu --chunked-prefill-size 512: a CPU dry run.)
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

from longserve.bench import latency
from longserve.bench.latency_cases import EngineBench

PROMPT = int(os.environ.get("PROBE_PROMPT", "16384"))
DECODERS = (0, 1, 4, 8)
REPEAT = 3


def one_case(eng, bench, decoders: int, budget: int, one, long) -> tuple[float, list[int]]:
    """TTFT (s) of a PROMPT-token prompt with `decoders` requests decoding beside it, and its steps' prompt tokens."""
    base = eng.scheduler.config
    eng.scheduler.config = dataclasses.replace(base, token_budget=budget)
    try:
        ids = [eng.add_request(bench.prompt(32), long) for _ in range(decoders)]
        while any(eng.scheduler.requests[i].num_computed_tokens < 32 for i in ids):
            eng.step()
        for _ in range(4):  # every decoder past its prompt and decoding
            eng.step()
        bench.timer.sync()
        start = time.perf_counter()
        rid = eng.add_request(bench.prompt(PROMPT), one)
        chunks: list[int] = []
        first = None
        while first is None:
            outs = eng.step()
            stats = eng.last_step_stats
            if stats.num_prefill_tokens:
                chunks.append(stats.num_prefill_tokens)
            if any(o.request_id == rid and o.outputs[0].token_ids for o in outs):
                first = time.perf_counter()
        for i in ids:
            eng.abort(i)
        while eng.has_unfinished():
            eng.step()
        eng.check_integrity()  # every page back
        return first - start, chunks
    finally:
        eng.scheduler.config = base


def probe(llm, args, skipped):
    from longserve.sampling_params import SamplingParams

    eng = llm.engine
    bench = EngineBench(llm, args)
    one = bench.one
    long = SamplingParams(max_new_tokens=1 << 20, temperature=0, ignore_eos=True)
    budget = eng.scheduler.config.token_budget
    cases = [(0, budget)] + [(d, b) for d in DECODERS[1:] for b in (budget, budget - d)]
    print(
        f"a {PROMPT:,}-token prompt in steps of {budget:,} prompt tokens (budget - d: the decodes' cut, as before), "
        f"beside d decoding requests (median of {REPEAT}):"
    )
    for d, b in cases:
        one_case(eng, bench, d, b, one, long)  # warm-up (new shapes, graphs)
        runs = [one_case(eng, bench, d, b, one, long) for _ in range(REPEAT)]
        ttft = statistics.median(r[0] for r in runs)
        print(
            f"  d={d} budget {b:,}: TTFT {ttft * 1e3:8.1f} ms (runs "
            + " ".join(f"{r[0] * 1e3:.1f}" for r in runs)
            + f"), steps' prompt tokens {runs[-1][1]}",
            flush=True,
        )
    sys.exit(0)


if __name__ == "__main__":
    extra = sys.argv[1:] or ["--config", "llama-3.1-8b", "--dtype", "bfloat16"]
    # the engine's budget as served (8192) and a pool with room for the prompt and the decoders
    latency.run_latency(
        ["--load-format", "dummy", "--prompt-lens", str(PROMPT + 8192), *extra], measure=probe
    )
