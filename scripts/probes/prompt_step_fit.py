"""What a prompt step beside decodes costs the device, from one HTTP call's step log (CPU only).

Fits each prompt step's device time, read to read (when the loop read its tokens minus when it read the step
before's, for steps launched while that one still ran; the step log's `read_ms` stamps where the log has them), by least squares over: the prompts in it, their tokens,
the piecewise-bucket padding tokens, the decode rows beside them, and whether the step before also held prompt
tokens; prints the terms and the rms. Steps are matched to the workload's requests by prompt tokens (the log has
no request ids; arrivals are admitted in order, so a step's prompt tokens are the sum of the next few waiting
requests' lengths). Used on the random workload of `compare_vllm_http.sh` (RESULTS.md nineteenth session):
    python3 scripts/probes/prompt_step_fit.py benchmarks/results/2026-12-04_150f44c_http [random] [steps log] [marks]
(the fcfs A/B of the a521ae9 call: ... 2026-12-04_a521ae9_http random_ab longserve_ab_steps.jsonl
workload_marks_ab.txt; a record is found plain, .xz or .gz).
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import numpy as np

from longserve.bench.records import find_record, open_record
from longserve.runner.piecewise_graph import piecewise_buckets

PIECEWISE_MAX = 4096  # the served --piecewise-cuda-graph-max-tokens: longer steps ran eager
# schedule + prepare before an early read, in logs without the `read_ms` stamp (before the twentieth session; a
# guess). From `f5438e9` the early read comes after the step's first piecewise layers are launched too
# (engine.Engine.step): about 1 ms more, which only the stamp gives.
EARLY_PREP_MS = 1.0


def load(call: Path, workload: str, steps_name: str, marks_name: str) -> tuple[list[dict], list[dict]]:
    """The step log's loop iterations from the workload's start to the next workload's, and its requests in
    arrival order."""
    marks = {
        name: float(t) for name, t in (line.split() for line in (call / marks_name).read_text().splitlines())
    }
    with open_record(find_record(call, steps_name)) as f:
        rows = [json.loads(line) for line in f]
    began = marks[workload.removesuffix("_ab")]
    start = began - rows[0]["opened_unix"]
    end = min((t for t in marks.values() if t > began), default=float("inf")) - rows[0]["opened_unix"]
    log = [r for r in rows[1:] if start <= r["t"] < end]
    with open_record(find_record(call / workload, "results.json")) as f:
        results = json.load(f)
    reqs = sorted(results["runs"][0]["requests"], key=lambda r: r["start"])
    return log, reqs


def prompt_steps(log: list[dict], reqs: list[dict], window: int = 8) -> dict[int, tuple[int, ...]]:
    """Loop iteration -> the requests whose prompts it launched (the smallest subset of the next few
    unmatched requests whose lengths sum to the step's prompt tokens; the warm-up's 16-token steps skipped)."""
    steps = [(i, r) for i, r in enumerate(log) if r.get("prefill", 0) > 0]
    while steps and steps[0][1]["prefill"] == 16:
        steps.pop(0)
    lens = [r["prompt_len"] for r in reqs]
    left = list(range(len(reqs)))
    members: dict[int, tuple[int, ...]] = {}
    for i, r in steps:
        found = next(
            (c for n in range(1, 6) for c in itertools.combinations(left[:window], n)
             if sum(lens[u] for u in c) == r["prefill"]),
            None,
        )  # fmt: skip
        if found is None:
            raise SystemExit(f"iteration {i}: {r['prefill']} prompt tokens match no set of waiting requests")
        for u in found:
            left.remove(u)
        members[i] = found
    return members


def read_at(row: dict) -> float | None:
    """When the iteration's step had read the step in flight (loop seconds): its `read_ms` stamp, logged since
    the twentieth session; None in older logs."""
    if row.get("read_ms", -1) < 0:
        return None
    return row["t"] + (row["commands_ms"] + row["read_ms"]) / 1e3


def early_read_guess(row: dict) -> float:
    """When a prompt step's early read of the step in flight ended, in a log without `read_ms` (loop seconds):
    after the step's schedule and prepare (EARLY_PREP_MS) and its wait."""
    return row["t"] + (row["commands_ms"] + EARLY_PREP_MS + row["wait_ms"]) / 1e3


def tokens_read(log: list[dict], k: int) -> float:
    """When the loop read the tokens of the step launched at iteration k (loop seconds)."""
    nxt = log[k + 1] if k + 1 < len(log) else None
    if nxt is None or "step_ms" not in nxt:
        return log[k]["t"] + (log[k]["commands_ms"] + log[k]["step_ms"]) / 1e3
    stamped = read_at(nxt)
    if stamped is not None:
        return stamped
    if nxt.get("prefill", 0) and nxt.get("early", 0):
        return early_read_guess(nxt)
    return nxt["t"] + (nxt["commands_ms"] + nxt["step_ms"]) / 1e3


def main(argv: list[str]) -> None:
    call = Path(argv[0])
    workload = argv[1] if len(argv) > 1 else "random"
    steps_name = argv[2] if len(argv) > 2 else "longserve_steps.jsonl"
    log, reqs = load(call, workload, steps_name, argv[3] if len(argv) > 3 else "workload_marks.txt")
    members = prompt_steps(log, reqs)
    buckets = piecewise_buckets(PIECEWISE_MAX)
    rows = []
    for k in range(1, len(log) - 1):
        r = log[k]
        if k not in members or r["wait_ms"] <= 2:  # launched while the step before ran
            continue
        before = read_at(r)
        if before is None:
            before = early_read_guess(r)
        tokens = r["prefill"] + r["decode"]
        eager = tokens > PIECEWISE_MAX
        pad = 0 if eager else next(b for b in buckets if b >= tokens) - tokens
        behind = float(log[k - 1].get("prefill", 0) > 0)
        ms = 1e3 * (tokens_read(log, k) - before)
        rows.append((len(members[k]), r["prefill"] / 1e3, pad / 1e3, r["decode"], behind, float(eager), ms))
    a = np.array(rows)
    x, y = a[:, :6], a[:, 6]
    keep = x.any(axis=0)  # a term no step has (no eager step) is left out
    c = np.zeros(6)
    c[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
    rms = float(np.sqrt(((y - x @ c) ** 2).mean()))
    print(f"{call.name} {workload}: {len(a)} prompt steps ({int((a[:, 0] > 1).sum())} with several prompts, "
          f"{int(a[:, 5].sum())} eager), rms {rms:.2f} ms; device ms =")  # fmt: skip
    terms = ("a prompt", "per 1K prompt tokens", "per 1K padding tokens", "a decode row", "behind a prompt step",
             "eager")  # fmt: skip
    for term, coef, used in zip(terms, c, keep):
        print(f"  {coef:8.3f}  {term}" + ("" if used else " (no such step)"))


if __name__ == "__main__":
    main(sys.argv[1:])
