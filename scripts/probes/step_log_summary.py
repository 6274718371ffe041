"""Sum up a server's --step-log (longserve/server/step_log.py) per workload: steps by kind (prompt tokens
only, generated only, both), their count, tokens, mean and P95 step time, the share of step time spent
waiting for the device (the rest is host: scheduling, inputs, launches), idle time, and the loop's own
overhead (commands, hand-out).

    python3 scripts/probes/step_log_summary.py STEP_LOG [MARKS]

MARKS: lines "NAME UNIX_TIME" (scripts/gpu/compare_vllm_http.sh writes them before each workload); each
workload's lines are those from its mark to the next. Without marks, the whole log is one part.
"""

from __future__ import annotations

import json
import sys

from longserve.bench.records import open_record  # a committed record is .xz over 4 KB


def _p95(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.95 * len(values)))] if values else 0.0


def summarize(lines: list[dict]) -> list[str]:
    rows = []
    kinds = {
        "prompt only": lambda s: s["prefill"] and not s["decode"],
        "prompt + decode": lambda s: s["prefill"] and s["decode"],
        "decode only": lambda s: s["decode"] and not s["prefill"],
    }
    steps = [line for line in lines if "step_ms" in line]
    for name, pick in kinds.items():
        chosen = [s for s in steps if pick(s)]
        if not chosen:
            continue
        total = sum(s["step_ms"] for s in chosen)
        wait = sum(s["wait_ms"] for s in chosen)
        prompt = sum(s["prefill"] for s in chosen)
        rows.append(
            f"  {name:16s} {len(chosen):6d} steps  {prompt:9d} prompt tokens  step ms mean "
            f"{total / len(chosen):7.2f} P95 {_p95([s['step_ms'] for s in chosen]):7.2f}  "
            f"waiting for the device {100 * wait / max(total, 1e-9):5.1f}%"
        )
    idle = sum(line["idle_ms"] for line in lines)
    loop = sum(line["commands_ms"] + line["send_ms"] for line in lines)
    busy = sum(s["step_ms"] for s in steps)
    rows.append(f"  step time {busy / 1e3:.2f} s, loop overhead {loop / 1e3:.2f} s, idle {idle / 1e3:.2f} s")
    return rows


def main() -> None:
    with open_record(sys.argv[1]) as f:
        head, *lines = [json.loads(line) for line in f if line.strip()]
    marks: list[tuple[str, float]] = []
    if len(sys.argv) > 2:
        with open_record(sys.argv[2]) as f:
            for line in f:
                name, unix = line.split()
                marks.append((name, float(unix) - head["opened_unix"]))
    if not marks:
        marks = [("all", float("-inf"))]
    for i, (name, start) in enumerate(marks):
        end = marks[i + 1][1] if i + 1 < len(marks) else float("inf")
        part = [line for line in lines if start <= line["t"] < end]
        print(f"{name}: {len(part)} loop iterations")
        for row in summarize(part):
            print(row)


if __name__ == "__main__":
    main()
