"""What the Nsight Compute probes (gluon_ncu.py, int4_ncu.py) share: their calls warmed up off the profile, then one
each under it (ncu runs with --profile-from-start off), and the command line that runs them or summarizes a CSV."""

from __future__ import annotations

import csv
import io
import sys
from collections.abc import Callable

from longserve.bench.records import open_record  # a committed record is .xz over 4 KB


def table_rows(path: str) -> list[dict[str, str]] | None:
    """The rows of ncu's `--csv --page details` table in path (one a metric of a kernel: "ID", "Kernel Name",
    "Section Name", "Metric Name", "Metric Unit", "Metric Value", ...); None if it holds no table (ncu failed)."""
    with open_record(path, errors="replace") as f:
        text = f.read()
    start = text.find('"ID"')  # ncu prints its own lines (==PROF== ...) before the table
    return None if start < 0 else list(csv.DictReader(io.StringIO(text[start:])))


def profile_calls(calls: list[tuple[str, Callable[[], object]]], warmup: int = 3) -> None:
    """Each call `warmup` times (compiles, plans) off the profile, then once each between cudaProfilerStart and
    Stop, its name on stderr as it runs (the order of ncu's kernel IDs)."""
    import torch

    for _, fn in calls:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in calls:
        print(f"profiled: {name}", file=sys.stderr, flush=True)
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def run(main: Callable[[], None], summary: Callable[[str], str]) -> None:
    """`--summary CSV`: print summary(CSV) (any machine); else main() (under ncu, on the GPU)."""
    if "--summary" in sys.argv:
        print(summary(sys.argv[sys.argv.index("--summary") + 1]))
    else:
        main()
