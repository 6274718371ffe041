"""scripts/probes/sim_admission.py recalibrated on an HTTP call (issue 19, the random workload's TTFT tail; CPU).

Everything timed from the a521ae9 HTTP call's own step logs (benchmarks/results/2026-12-04_a521ae9_http/:
longserve_steps.jsonl.xz, longserve_ab_steps.jsonl.xz) and results.json (RESULTS.md nineteenth session; the
prompt step's terms are scripts/probes/prompt_step_fit.py's):
- a prompt step's device time, read to read: 4.64 ms a prompt + 22.0 ms per 1K prompt tokens + 20.6 ms per 1K
  tokens of piecewise-bucket padding + 0.247 ms a decode row, + 2.4 ms when the step before was a prompt step too
  (368 steps of both logs, rms 1.26 ms; end to end against both runs' per-request TTFTs 3.0 fits best, and 4.5 ms
  more for an eager step; 2- and 3-prompt steps fit 6.15 ms a prompt without a per-step intercept,
  and eager steps no device penalty);
- a decode step: 4.4 + 0.06 ms a row (the loop's decode iterations);
- the host: schedule + prepare 1.5 ms before the read of the step in flight, 0.3 ms to read and hand out its
  tokens, then the launch: 10 + 1.3 ms/1K + 0.5 ms a decode row with piecewise graphs (<= 4,096 tokens), 70 ms
  eager (the fcfs log's 4.5-5.2K steps: 68-73 ms);
- outside the engine (HTTP in, tokenization, delivery): 6.2 ms in all (IN 3.0 before the engine sees it, OUT 3.2).

The loop is engine.Engine.step's with the server's early hand-out: plan N+1; if it has prompt tokens, read N
first (its tokens go out), then launch N+1; else launch N+1 (a decode step, queued behind N) and read N.

Policies (comma-separated; modifiers joined with '+'):
  all            every waiting prompt into the 8,192-token budget (fcfs: vLLM's admission)
  light:N        beside decodes, prompts until the step holds N prompt tokens (the first always), while the
                 queue holds <= 2 budgets (the scheduler at a521ae9: light:1024); cap:N the same whatever the queue
  pw[:N]         all waiting prompts while the step's prompt tokens + decodes stay <= N (4,096: the piecewise
                 graphs' limit), the first always
  +dmax:N        the light/cap share only while at most N requests decode (else full steps)
  +short         the waiting queue in order of length (shortest first) instead of arrival
  +skip:N        shortest first, but a request already overtaken N times by later arrivals goes first
  +age:W         shortest first, except that requests that arrived more than W ms ago go first (in arrival order)
  +nodecodeahead after a step with prompt tokens, when nothing waits, read it before planning the next step
                 instead of launching a decode step behind it (arrivals meanwhile join the next step)
  +dev:X         X ms a prompt instead of 6.15 (what-if: vLLM's per-prompt cost)
vllm             a model of vLLM 0.24 (async scheduling: step N+1 planned and launched while N runs, all waiting
                 prompts up to 8,192 tokens with the decodes; PROMPT_MS_VLLM a prompt; OUT_VLLM after)

    python3 scripts/probes/sim_admission_calibrated.py \
        benchmarks/results/2026-12-04_a521ae9_http/random/results.json.xz --policies light:1024,light:1024+dmax:16,all \
        --synthetic
(the scheduler from 1e4f5f9 is light:1024+dmax:16; the constants describe a521ae9's steps, before the decode rows'
kernel, the padding in place and the early read changed them).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import dataclass, field

from longserve.bench.records import open_record

BUDGET = 8192
PIECEWISE_MAX = 4096
LIGHT_QUEUE_BUDGETS = 2
PROMPT_MS, TOKEN_MS, ROW_MS = 4.64, 0.0220, 0.247
PAD_TOKEN_MS = 0.0206  # a piecewise bucket's padding token
PAD = True  # steps padded up to their piecewise bucket (<= 4,096 tokens)
DECODE_MS, DECODE_ROW_MS = 4.4, 0.06
H1_MS, READ_MS = 1.0, 0.3
LAUNCH_MS, LAUNCH_TOKEN_MS, LAUNCH_ROW_MS, EAGER_LAUNCH_MS = 10.0, 0.0013, 0.5, 70.0
EAGER_DEV_MS = 4.5  # more device time for an eager step (past the piecewise graphs)
DECODE_HOST_MS = 1.0  # schedule + prepare + graph replay of a decode step
LOOP_MS = 0.2  # commands and hand-out of an iteration
IN_MS, OUT_MS = 1.8, 3.2
IN_TOKEN_MS = 0.0008  # tokenization a prompt token (arrival order at the engine)
B2B_MS = 3.0  # more device time for a prompt step launched behind another prompt step
# vLLM model
PROMPT_MS_VLLM = 2.5
STEP_MS_VLLM = 0.5
IN_VLLM, OUT_VLLM = 3.0, 5.5


def _buckets(limit):
    """longserve.runner.piecewise_graph.piecewise_buckets (copied: 64..512 by 64, ..1024 by 64, ..2048 by 128, ...)."""
    sizes, size = [], 64
    while size < limit:
        sizes.append(size)
        size += max(64, (1 << (size.bit_length() - 1)) // 8)
    return sizes + [limit]


BUCKETS = _buckets(PIECEWISE_MAX)


def bucket(n):
    return next((b for b in BUCKETS if b >= n), n)


@dataclass
class Req:
    arrival: float
    prompt: int
    output: int
    done_prompt: int = 0
    produced: int = 0
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    overtaken: int = 0


def parse(policy: str):
    parts = policy.split("+")
    kind, _, arg = parts[0].partition(":")
    mods = {}
    for m in parts[1:]:
        k, _, v = m.partition(":")
        mods[k] = v
    return kind, (int(arg) if arg else None), mods


def schedule(policy, waiting, running, budget=BUDGET, now=0.0):
    """The step's prompt chunks: running prefills first, then waiting prompts by the policy."""
    kind, arg, mods = parse(policy)
    chunks = []
    for r in running:
        if r.done_prompt < r.prompt and budget > 0:
            n = min(r.prompt - r.done_prompt, budget)
            chunks.append((r, n))
            budget -= n
    decodes = sum(1 for r in running if r.done_prompt == r.prompt and r.produced < r.output)
    order = sorted(waiting, key=lambda r: r.prompt) if "short" in mods else list(waiting)
    if (
        "age" in mods and waiting
    ):  # shortest first, but a request waiting longer than age ms goes first (FCFS)
        order = sorted(waiting, key=lambda r: r.prompt)
        old = [r for r in waiting if (now - r.arrival) * 1e3 > float(mods["age"])]
        order = old + [r for r in order if r not in old]
    if "skip" in mods and waiting:  # shortest first, but one overtaken `skip` times goes first
        limit_skips = int(mods["skip"])
        order = sorted(waiting, key=lambda r: (r.overtaken < limit_skips, r.prompt))
    cap = float("inf")
    if kind in ("light", "cap") and decodes and decodes <= int(mods.get("dmax", 10**9)):
        queued = sum(r.prompt - r.done_prompt for r in waiting)
        if kind == "cap" or queued <= LIGHT_QUEUE_BUDGETS * BUDGET:
            cap = arg
    limit = float("inf")
    if kind == "pw":
        limit = (arg or PIECEWISE_MAX) - decodes
    used = sum(n for _, n in chunks)
    for admitted, r in enumerate(order):
        if budget <= 0:
            break
        if admitted and (used >= cap or used + r.prompt > limit):
            break
        n = min(r.prompt - r.done_prompt, budget)
        chunks.append((r, n))
        budget -= n
        used += n
    if "skip" in mods:
        taken = {id(r) for r, _ in chunks}
        for r, _ in chunks:
            for o in waiting:
                if id(o) not in taken and o.arrival < r.arrival:
                    o.overtaken += 1
    return chunks


def simulate(reqs, policy):
    kind, arg, mods = parse(policy)
    if kind == "vllm":
        return simulate_vllm(reqs, mods)
    prompt_ms = float(mods.get("dev", PROMPT_MS))
    pending = sorted(reqs, key=lambda r: r.arrival + IN_TOKEN_MS * r.prompt / 1e3)
    waiting, running = [], []
    host = 0.0
    in_flight = None  # (device end, sampled requests, had prompt tokens)
    dev_free = 0.0

    def read(step):
        nonlocal host
        host = max(host, step[0]) + READ_MS / 1e3
        hand_out(step[1], host, running)

    while pending or waiting or running or in_flight:
        host += LOOP_MS / 1e3
        while pending and pending[0].arrival + (IN_MS + IN_TOKEN_MS * pending[0].prompt) / 1e3 <= host:
            waiting.append(pending.pop(0))
        chunks = schedule(policy, waiting, running, now=host)
        decodes = [r for r in running if r.done_prompt == r.prompt and r.produced < r.output]
        if not chunks and not decodes:
            if in_flight:
                read(in_flight)
                in_flight = None
                continue
            host = max(host, pending[0].arrival + (IN_MS + IN_TOKEN_MS * pending[0].prompt) / 1e3)
            continue
        if not chunks and in_flight and in_flight[2] and "nodecodeahead" in mods:
            read(in_flight)
            in_flight = None  # then plan again with what arrived meanwhile
            continue
        ptoks = sum(n for _, n in chunks)
        if ptoks:
            host += H1_MS / 1e3
            b2b = bool(in_flight and in_flight[2])
            if in_flight:
                read(in_flight)
                in_flight = None
                decodes = [r for r in running if r.done_prompt == r.prompt and r.produced < r.output]
            for r, n in chunks:
                if r in waiting:
                    waiting.remove(r)
                    running.append(r)
                r.done_prompt += n
            sampled = decodes + [r for r, _ in chunks if r.done_prompt == r.prompt]
            nprompts = len(chunks)
            eager = ptoks + len(decodes) > PIECEWISE_MAX
            pad = (bucket(ptoks + len(decodes)) - ptoks - len(decodes)) if PAD and not eager else 0
            dev = (
                prompt_ms * nprompts
                + TOKEN_MS * ptoks
                + PAD_TOKEN_MS * pad
                + ROW_MS * len(decodes)
                + (B2B_MS if b2b else 0.0)
            )
            dev += EAGER_DEV_MS if eager else 0.0
            launch = (
                EAGER_LAUNCH_MS
                if eager
                else LAUNCH_MS + LAUNCH_TOKEN_MS * ptoks + LAUNCH_ROW_MS * len(decodes)
            )
            start = max(host, dev_free)
            end = max(start + dev / 1e3, host + (launch + 2.0) / 1e3)
            host += launch / 1e3
            dev_free = end
            in_flight = (end, sampled, True)
        else:
            host += DECODE_HOST_MS / 1e3
            start = max(host, dev_free)
            end = start + (DECODE_MS + DECODE_ROW_MS * len(decodes)) / 1e3
            dev_free = end
            step = (end, decodes, False)
            if in_flight:
                read(in_flight)
            in_flight = step
    return delivered(reqs, OUT_MS)


def hand_out(sampled, t, running):
    """A step's tokens reach its sampled requests at t; those done leave `running`."""
    for r in sampled:
        r.produced += 1
        r.token_times.append(t)
        if r.first_token is None:
            r.first_token = t
        if r.produced >= r.output and r in running:
            running.remove(r)


def delivered(reqs, out_ms):
    """Every token's time as the client sees it: out_ms after the engine handed it out."""
    for r in reqs:
        r.first_token += out_ms / 1e3
        r.token_times = [t + out_ms / 1e3 for t in r.token_times]
    return reqs


def simulate_vllm(reqs, mods):
    """vLLM 0.24 with async scheduling, as a model: the device runs steps back to back; step N+1 is planned when N
    is launched, from the requests that arrived by then (all waiting prompts, 8,192 tokens with the decodes);
    a step's tokens reach clients OUT_VLLM after it ends."""
    prompt_ms = float(mods.get("dev", PROMPT_MS_VLLM))
    pending = sorted(reqs, key=lambda r: r.arrival)
    waiting, running = [], []
    t = 0.0  # when the next step is planned (= the device start of the step before)
    dev_free = 0.0
    inflight = []  # (end, sampled)
    while pending or waiting or running or inflight:
        # tokens of steps ended by now
        for end, sampled in [s for s in inflight if s[0] <= t]:
            inflight.remove((end, sampled))
            hand_out(sampled, end, running)
        while pending and pending[0].arrival + IN_VLLM / 1e3 <= t:
            waiting.append(pending.pop(0))
        # a decode row is planned only once its previous token is known or in flight (async: one step ahead)
        ahead = {}
        for _, s in inflight:
            for r in s:
                ahead[id(r)] = ahead.get(id(r), 0) + 1
        running[:] = [r for r in running if r.produced < r.output]
        decodes = [
            r for r in running if r.done_prompt == r.prompt and r.produced + ahead.get(id(r), 0) < r.output
        ]
        # with async scheduling a request may have one step in flight and be planned again
        budget = BUDGET - len(decodes)
        chunks = []
        for r in running:
            if r.done_prompt < r.prompt and budget > 0:
                n = min(r.prompt - r.done_prompt, budget)
                chunks.append((r, n))
                budget -= n
        for r in list(waiting):
            if budget <= 0:
                break
            n = min(r.prompt, budget)
            chunks.append((r, n))
            budget -= n
        if not chunks and not decodes:
            if not inflight and not pending:
                break
            nxt = [s[0] for s in inflight] + ([pending[0].arrival + IN_VLLM / 1e3] if pending else [])
            t = max(t, min(nxt))
            continue
        for r, n in chunks:
            if r in waiting:
                waiting.remove(r)
                running.append(r)
            r.done_prompt += n
        sampled = decodes + [r for r, _ in chunks if r.done_prompt == r.prompt]
        ptoks = sum(n for _, n in chunks)
        if ptoks:
            dev = prompt_ms * len(chunks) + TOKEN_MS * ptoks + ROW_MS * len(decodes) + STEP_MS_VLLM
        else:
            dev = DECODE_MS + DECODE_ROW_MS * len(decodes)
        start = max(t, dev_free)
        end = start + dev / 1e3
        dev_free = end
        inflight.append((end, sampled))
        # the next step is planned once this one is launched, i.e. as the device starts it; with one step in
        # flight ahead at most: wait for the one before this to end
        t = start + 0.0005
        if len(inflight) > 1:
            t = max(t, min(s[0] for s in inflight))
    return delivered(reqs, OUT_VLLM)


MODEL_A = dict(
    PROMPT_MS=6.15, TOKEN_MS=0.0221, ROW_MS=0.26, PAD=False, B2B_MS=3.0, EAGER_DEV_MS=0.0
)  # no padding term


def set_params(**kw):
    """Override the module's timing constants (calibration)."""
    for k, v in kw.items():
        assert k in globals(), k
        globals()[k] = v


def pct(values, q):
    """numpy's linear interpolation (the report's)."""
    v = sorted(values)
    x = q * (len(v) - 1)
    i = int(x)
    return v[i] + (v[min(i + 1, len(v) - 1)] - v[i]) * (x - i)


def stats(reqs):
    ttft = [1e3 * (r.first_token - r.arrival) for r in reqs]
    gaps = [1e3 * (b - a) for r in reqs for a, b in zip(r.token_times, r.token_times[1:])]
    return dict(
        mean=statistics.mean(ttft),
        p50=pct(ttft, 0.5),
        p90=pct(ttft, 0.9),
        p95=pct(ttft, 0.95),
        p99=pct(ttft, 0.99),
        itl95=pct(gaps, 0.95),
        itl_mean=statistics.mean(gaps),
        end=max(r.token_times[-1] for r in reqs),
        ttft=ttft,
    )


def load(path, run=0):
    with open_record(path) as f:
        runs = json.load(f)["runs"]
    reqs = sorted(runs[run]["requests"], key=lambda r: r["start"])
    return runs, [Req(r["start"], r["prompt_len"], r["output_tokens"] or r["output_len"]) for r in reqs]


def synthetic():
    rng = random.Random(0)
    cases = []
    for rate in (8, 12, 16):
        for seed in range(3):
            rng = random.Random(100 * rate + seed)
            t, reqs = 0.0, []
            for _ in range(400):
                t += rng.expovariate(rate)
                reqs.append(Req(t, rng.randint(1024, 2048), rng.randint(64, 128)))
            cases.append((f"Poisson {rate}/s seed {seed}", reqs))
    rng = random.Random(0)
    cases.append(("burst of 400", [Req(0.0, rng.randint(1024, 2048), 128) for _ in range(400)]))
    return cases


def fmt(name, s):
    return (
        f"{name:28s} TTFT mean {s['mean']:6.1f} P50 {s['p50']:6.1f} P90 {s['p90']:6.1f} P95 {s['p95']:6.1f} "
        f"P99 {s['p99']:6.1f}  ITL mean {s['itl_mean']:4.1f} P95 {s['itl95']:5.1f}  end {s['end']:.2f} s"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--policies", default="light:1024,all,vllm")
    ap.add_argument("--synthetic", action="store_true")
    args = ap.parse_args()
    runs, base = load(args.results)
    for run in runs:
        t = sorted(1e3 * r["ttft"] for r in run["requests"])
        print(
            f"{'measured ' + run['name']:28s} TTFT mean {statistics.mean(t):6.1f} P50 {pct(t, 0.5):6.1f} "
            f"P90 {pct(t, 0.9):6.1f} P95 {pct(t, 0.95):6.1f} P99 {pct(t, 0.99):6.1f}"
        )
    cases = [("the call's arrivals", base)] + (synthetic() if args.synthetic else [])
    for name, reqs in cases:
        print(f"== {name}")
        for policy in args.policies.split(","):
            fresh = [Req(r.arrival, r.prompt, r.output) for r in reqs]
            print(fmt(policy, stats(simulate(fresh, policy))))


if __name__ == "__main__":
    main()
