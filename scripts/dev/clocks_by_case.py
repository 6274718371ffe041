"""The GPU's SM clock and power while each `bench latency` case ran: a gpu_check.sh mode's folder holds
`clocks.csv` (nvidia-smi every 200 ms) and one `latency_*.log` a run, whose "[bench latency HH:MM:SS] CASE:
running" lines open each case's window (the next such line, or the floors' lines, close it; to the second, the
closing second left out). Samples under --min-watts (idle between processes) are left out.

At the 700 W limit the clock follows what the kernels draw, which depends on the data as well as the work: in
the forty-second session the 8B's int4 cold 128K held ~1,730 MHz where bf16 held ~1,470 (RESULTS.md), so a
ratio of two runs reads with their clocks beside it.

    python scripts/dev/clocks_by_case.py benchmarks/results/2026-12-06_a01eadb_lone_long_tests_vllm/lone-long
"""

from __future__ import annotations

import argparse
import glob
import os
import re

from longserve.bench.records import find_record, open_record

CASE = re.compile(r"\[bench latency (\d\d:\d\d:\d\d)\] (\S+): running")
CLOSE = re.compile(r"\[bench latency (\d\d:\d\d:\d\d)\] (wrote|\S+: floor)")


def read_clocks(path: str) -> list[tuple[str, int, float]]:
    """(HH:MM:SS, SM MHz, watts) of each sample."""
    samples = []
    with open_record(path) as f:
        for line in f:
            cells = [c.strip() for c in line.split(",")]
            if len(cells) < 4 or not cells[1].endswith("MHz"):
                continue  # the header, or a line nvidia-smi cut short
            samples.append((cells[0].split()[1][:8], int(cells[1].split()[0]), float(cells[3].split()[0])))
    return samples


def case_windows(path: str) -> list[tuple[str, str, str]]:
    """(case, first second, last second) of each case a latency log ran."""
    windows, open_case = [], None
    with open_record(path) as f:
        for line in f:
            if m := CASE.match(line):
                if open_case:
                    windows.append((open_case[1], open_case[0], m.group(1)))
                open_case = (m.group(1), m.group(2))
            elif (m := CLOSE.match(line)) and open_case:
                windows.append((open_case[1], open_case[0], m.group(1)))
                open_case = None
    return windows


def by_case(folder: str, min_watts: float = 250.0) -> list[dict[str, object]]:
    try:
        samples = read_clocks(str(find_record(folder, "clocks.csv")))
    except FileNotFoundError:
        return []
    rows = []
    for log in sorted(glob.glob(os.path.join(folder, "latency_*.log*"))):
        for case, first, last in case_windows(log):
            # [first, last): the last second is the next case's (a case within one second: that second)
            inside = [(t, mhz, w) for t, mhz, w in samples if first <= t < last or first == last == t]
            busy = [(mhz, w) for _, mhz, w in inside if w >= min_watts]
            if busy:
                rows.append(
                    dict(
                        run=os.path.basename(log).split(".log")[0].removeprefix("latency_"),
                        case=case,
                        samples=len(busy),
                        sm_mhz=sum(m for m, _ in busy) / len(busy),
                        watts=sum(w for _, w in busy) / len(busy),
                    )
                )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--min-watts", type=float, default=250.0)
    args = p.parse_args()
    for r in by_case(args.folder, args.min_watts):
        print(
            f"{r['run']:<24} {r['case']:<20} {r['samples']:>4} samples  SM {r['sm_mhz']:6.0f} MHz  {r['watts']:5.0f} W"
        )


if __name__ == "__main__":
    main()
