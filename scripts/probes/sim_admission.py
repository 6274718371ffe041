"""Replays a served workload's arrivals through a model of the engine's overlapped loop, to compare how many new
prompts a step admits (issue 19: the random workload's P95 TTFT). The arrivals, prompt and output lengths come
from a `bench compare` results.json (both servers saw the same); the device time of a step from the 8B shape's
offline prefill times on an H200 (RESULTS.md fifth session: eager 1024 / 2048 / 4096 / 8192 tokens in 23.8 /
49.2 / 104.9 / ~213 ms; piecewise buckets pad a step to an eighth of a power of two) plus ~5 ms a decode step;
the host's part from the step log of the same call (prefill launch ~2 ms + 12 us a token; ~1.5 ms a decode step).
The loop is engine.Engine.step's: plan step N+1, and when it computes prompt tokens finish step N first (its
tokens go out before the long launch), launch N+1, then finish N. Policies:

- `all`: every waiting request into the step's 8,192-token budget (fcfs; the scheduler before `LIGHT_QUEUE_BUDGETS`);
- `one`: one new prompt a step while others decode; `cap:N`: beside decodes, new prompts until the step holds N
  prompt tokens (the first always); `light:N`: `cap:N` only while the waiting prompts hold at most
  LIGHT_QUEUE_BUDGETS budgets, else `all` (the scheduler's short-first rule, N = 1/8 of the budget);
- any of these with `+short`: the waiting ones in order of length instead of arrival.

    PYTHONPATH=. python3 scripts/probes/sim_admission.py \\
        benchmarks/results/2026-12-04_11fea55_http/random/results.json.xz --synthetic

Prints the measured figures of each server first, then per policy the simulated TTFT mean / P50 / P95, the P95
of the gaps between tokens and when the last token came. The model leaves out HTTP, tokenization and streaming
(~10 ms at P50 against the measured run) and a step's device time beyond its token count: compare policies
with it, not servers.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
from dataclasses import dataclass, field

from longserve.bench.records import open_record
from longserve.runner.piecewise_graph import piecewise_buckets
from longserve.sched.scheduler import LIGHT_QUEUE_BUDGETS

PREFILL_MS = [(0, 3.0), (64, 4.0), (512, 13.5), (1024, 23.8), (2048, 49.2), (4096, 104.9), (8192, 213.0)]
DECODE_MS = 4.0  # a decode step (plus DECODE_ROW_MS a request: ~5 ms at 10, as the step log shows; 13 ms at 64x4K offline)
DECODE_ROW_MS = 0.1
PIECEWISE_MAX = 4096
HOST_PREP_MS = 1.0
HOST_PREFILL_MS, HOST_PER_TOKEN_MS, HOST_DECODE_MS = 2.0, 0.012, 1.5
TOKENIZE_MS = 2.0  # arrival -> the engine's queue (text prompts)


BUCKETS = piecewise_buckets(PIECEWISE_MAX)


def bucket(n: int) -> int:
    """The tokens a step of n runs as: its piecewise graphs' bucket, or n past them (eager)."""
    return next((b for b in BUCKETS if b >= n), n)


def prefill_ms(tokens: int) -> float:
    xs = [x for x, _ in PREFILL_MS]
    i = min(max(bisect.bisect_left(xs, tokens), 1), len(xs) - 1)
    (x0, y0), (x1, y1) = PREFILL_MS[i - 1], PREFILL_MS[i]
    return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


@dataclass
class Req:
    arrival: float
    prompt: int
    output: int
    done_prompt: int = 0
    produced: int = 0
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)


def schedule(policy: str, waiting: list[Req], running: list[Req], budget: int) -> list[tuple[Req, int]]:
    """The step's prompt chunks: running prefills continue first, as the scheduler does, then the waiting ones
    by the policy (the module's docstring)."""
    chunks = []
    for r in running:
        if r.done_prompt < r.prompt and budget > 0:
            n = min(r.prompt - r.done_prompt, budget)
            chunks.append((r, n))
            budget -= n
    kind, _, arg = policy.partition(":")
    share = int(arg.split("+")[0]) if arg else 0
    if kind == "one":
        kind, share = "cap", 1
    if kind == "light":  # the scheduler's rule: the share only while the queue is short
        queued = sum(r.prompt for r in waiting)
        kind = "cap" if queued <= LIGHT_QUEUE_BUDGETS * (budget + sum(n for _, n in chunks)) else "all"
    order = sorted(waiting, key=lambda r: r.prompt) if policy.endswith("+short") else list(waiting)
    decoding = any(r.done_prompt == r.prompt for r in running)
    used = sum(n for _, n in chunks)
    for admitted, r in enumerate(order):
        if budget <= 0 or (kind == "cap" and decoding and admitted and used >= share):
            break
        n = min(r.prompt, budget)
        chunks.append((r, n))
        budget -= n
        used += n
    return chunks


def simulate(reqs: list[Req], policy: str, budget: int = 8192) -> list[Req]:
    pending = sorted(reqs, key=lambda r: r.arrival)
    waiting: list[Req] = []
    running: list[Req] = []
    host = dev_free = 0.0
    in_flight: tuple[float, list[Req]] | None = None  # (device end, the requests that get a token)

    def finish(step: tuple[float, list[Req]]) -> None:
        nonlocal host
        end, sampled = step
        host = max(host, end)
        for r in sampled:
            r.produced += 1
            r.token_times.append(end)
            if r.first_token is None:
                r.first_token = end
            if r.produced >= r.output and r in running:
                running.remove(r)

    while pending or waiting or running or in_flight:
        while pending and pending[0].arrival + TOKENIZE_MS / 1e3 <= host:
            waiting.append(pending.pop(0))
        chunks = schedule(policy, waiting, running, budget)  # prompt tokens: decodes ride on top
        decodes = [r for r in running if r.done_prompt == r.prompt and r.produced < r.output]
        if not chunks and not decodes:
            if in_flight:
                finish(in_flight)
                in_flight = None
                continue
            host = max(host, pending[0].arrival + TOKENIZE_MS / 1e3)
            continue
        prompt_tokens = sum(n for _, n in chunks)
        host += HOST_PREP_MS / 1e3
        if prompt_tokens and in_flight:  # the earlier step's tokens go out before the long launch
            finish(in_flight)
            in_flight = None
            decodes = [r for r in running if r.done_prompt == r.prompt and r.produced < r.output]
        for r, n in chunks:
            if r in waiting:
                waiting.remove(r)
                running.append(r)
            r.done_prompt += n
        sampled = decodes + [r for r, _ in chunks if r.done_prompt == r.prompt]
        if prompt_tokens:
            device = prefill_ms(bucket(prompt_tokens + len(decodes))) + DECODE_ROW_MS * len(decodes)
            launch = HOST_PREFILL_MS + HOST_PER_TOKEN_MS * prompt_tokens
        else:
            device, launch = DECODE_MS + DECODE_ROW_MS * len(decodes), HOST_DECODE_MS
        start = max(dev_free, host)
        end = max(start + device / 1e3, host + launch / 1e3)
        dev_free = end
        host += launch / 1e3
        if in_flight:
            finish(in_flight)
        in_flight = (end, sampled)
    return reqs


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def report(name: str, reqs: list[Req]) -> str:
    ttft = [1e3 * (r.first_token - r.arrival) for r in reqs]
    gaps = [1e3 * (b - a) for r in reqs for a, b in zip(r.token_times, r.token_times[1:])]
    mean = sum(ttft) / len(ttft)
    return (
        f"{name:14s} TTFT mean {mean:6.1f} P50 {pct(ttft, 0.5):6.1f} P95 {pct(ttft, 0.95):6.1f}  "
        f"ITL P95 {pct(gaps, 0.95):5.1f}"
    )


def synthetic() -> list[tuple[str, list[Req]]]:
    """400 prompts of 1,024-2,048 tokens at once (128 out each), then 400 Poisson arrivals at 12, 16 and 20 a second
    (64-128 out), from one seeded generator in that order."""
    rng = random.Random(0)
    cases = [("burst of 400", [Req(0.0, rng.randint(1024, 2048), 128) for _ in range(400)])]
    for rate in (12, 16, 20):
        t, reqs = 0.0, []
        for _ in range(400):
            t += rng.expovariate(rate)
            reqs.append(Req(t, rng.randint(1024, 2048), rng.randint(64, 128)))
        cases.append((f"Poisson {rate}/s", reqs))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--policies", default="all,one,cap:1024,cap:2048,light:1024,light:1024+short")
    ap.add_argument(
        "--synthetic", action="store_true", help="also a burst and Poisson arrivals (synthetic())"
    )
    args = ap.parse_args()
    with open_record(args.results) as f:
        runs = json.load(f)["runs"]
    for run in runs:
        s = run["summary"]
        print(
            f"{'measured ' + run['name']:14s} TTFT mean {1e3 * s['ttft']['mean']:6.1f} P50 "
            f"{1e3 * s['ttft']['median']:6.1f} P95 {1e3 * s['ttft']['p95']:6.1f}  ITL P95 {1e3 * s['itl']['p95']:5.1f}"
        )
    base = [
        Req(r["start"], r["prompt_len"], r["output_tokens"] or r["output_len"]) for r in runs[0]["requests"]
    ]
    cases = [("the results' arrivals", base)] + (synthetic() if args.synthetic else [])
    for name, reqs in cases:
        print(f"== {name}")
        for policy in args.policies.split(","):
            fresh = [Req(r.arrival, r.prompt, r.output) for r in reqs]
            done = simulate(fresh, policy)
            end = max(r.token_times[-1] for r in done)
            print(f"{report(policy, done)}  all done at {end:.2f} s")


if __name__ == "__main__":
    main()
