"""GPU probe: Nsight Compute on one call each of the int4 decode GEMVs at one row, the Llama-3.1-8B projections: the
tensor-core GEMV by its TMA ring (int4_mma_gemv.ONE_ROW, the default since 9d7eb2c) and the CUDA-core one-row kernel
(int4_gemv.py). Why: by the ring the four projections take 57.2 us alone against 29 us of bytes at 4.2 TB/s (gate_up
24.3 against 14, qkv 8.5 against 3; RESULTS.md twenty-eighth session), and issue 18's int4 b1 decode (0.651x bf16)
needs ~46 us a layer for 0.6x: the counters say whether the ring's programs wait on HBM (long scoreboard on the
mbarrier), on the CTA barrier before each refill, or on issue, and how much of HBM's bandwidth the kernel holds.

    ncu --clock-control none --profile-from-start off --csv --page details --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats --metrics <STALLS, comma-joined> \\
        python3 scripts/probes/int4_ncu.py > ncu.csv
    python3 scripts/probes/int4_ncu.py --summary ncu.csv      # a few lines a kernel, on any machine

Each shape runs as VARIANTS: the ring as it stands, the ring with each step's x and scales asked for a step ahead
(int4_mma_gemv.AHEAD), the CUDA-core kernel. Where in the SASS one call's warps wait, by ncu's PC sampling:

    ncu --clock-control none --profile-from-start off --section SourceCounters --page source --csv \
        --print-source sass python3 scripts/probes/int4_ncu.py --only "gate_up mma ring" > source.csv
    python3 scripts/probes/int4_ncu.py --source-summary source.csv   # the instructions holding most samples

ncu flushes the caches before each profiled kernel (its default --cache-control all): the weights come from HBM, as
in a decode step. Warm-up calls (compiles) run before the profiler starts; then one call each, in the order printed.
"""

from __future__ import annotations

import csv
import io
import re
import sys
from collections import defaultdict

from ncu_calls import profile_calls, run, table_rows  # this folder (the script's own: first on sys.path)

from longserve.bench.records import open_record  # a committed record is .xz over 4 KB

# warp stall reasons, each the average number of warps stalled on it per issued instruction
STALLS = [
    f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"
    for reason in ("long_scoreboard", "barrier", "membar", "wait", "short_scoreboard", "mio_throttle",
                   "lg_throttle", "math_pipe_throttle", "no_instruction", "not_selected", "selected")
]  # fmt: skip
# the details page's metrics the summary prints (the raw CSV keeps them all)
SUMMARY = ("Duration", "Memory Throughput", "DRAM Throughput", "Achieved Occupancy", "Registers Per Thread",
           "Warp Cycles Per Issued Instruction")  # fmt: skip
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# (name, tensor cores, int4_mma_gemv.AHEAD): each shape's calls in this order
VARIANTS = [("mma ring", True, False), ("mma ring ahead", True, True), ("cuda cores", False, False)]


def summary(path: str) -> str:
    """Per profiled kernel, its short name, the SUMMARY metrics and the stalls (largest first), from ncu's CSV."""
    rows = table_rows(path)
    if rows is None:
        return f"{path}: no ncu table (see the log)"
    names: dict[str, str] = {}
    values: dict[str, dict[str, str]] = defaultdict(dict)
    for row in rows:
        names[row["ID"]] = row["Kernel Name"]
        metric = row.get("Metric Name") or ""
        if metric in SUMMARY or metric.startswith("smsp__average_warps_issue_stalled"):
            values[row["ID"]][metric] = f"{row['Metric Value']} {row.get('Metric Unit') or ''}".strip()
    out = []
    for kid, name in names.items():
        out.append(f"[{kid}] {name[:100]}")
        got = values[kid]
        out.extend(f"    {m}: {got[m]}" for m in SUMMARY if m in got)
        stalls = {m.split("stalled_")[1].split("_per_issue")[0]: got[m] for m in got if "stalled" in m}
        ranked = sorted(stalls.items(), key=lambda kv: -float(kv[1].split()[0].replace(",", "") or 0))
        if ranked:
            out.append("    stalls per issue: " + ", ".join(f"{k} {v}" for k, v in ranked))
    return "\n".join(out)


def source_summary(path: str, top: int = 30) -> str:
    """The SASS instructions holding the most warp-state samples in ncu's `--page source --csv --print-source sass`
    table (one profiled kernel: `--only`), with their share of all samples; the table's columns as ncu names them
    (those holding "Sampl"), printed first."""
    with open_record(path, errors="replace") as f:
        text = f.read()
    # ncu's own lines (==PROF== ...) and a "Kernel Name" row come before the table's header row
    header = re.search(r'^"#? ?Address",', text, re.M)
    start = header.start() if header else -1
    rows = list(csv.DictReader(io.StringIO(text[start:]))) if start >= 0 else []
    if not rows:
        return f"{path}: no source table (see the log)"
    columns = list(rows[0])
    sampled = [c for c in columns if "Sampl" in c]
    source = next(
        (c for c in columns if c.strip() in ("Source", "# Source")), columns[min(1, len(columns) - 1)]
    )
    key = next((c for c in sampled if "All" in c), sampled[0] if sampled else None)
    out = [f"columns: {columns}"]
    if key is None:
        return "\n".join(out + [str(r) for r in rows[:5]])

    def count(row: dict[str, str]) -> float:
        try:
            return float((row.get(key) or "0").replace(",", ""))
        except ValueError:
            return 0.0

    total = sum(count(r) for r in rows) or 1.0
    out.append(f"{len(rows)} instructions, {total:.0f} samples ({key})")
    for r in sorted(rows, key=count, reverse=True)[:top]:
        address = r.get("# Address") or r.get("Address") or ""
        extra = ", ".join(f"{c} {r[c]}" for c in sampled if c != key and r.get(c) not in (None, "", "0"))
        out.append(f"  {100 * count(r) / total:5.1f}% {address} {r.get(source, '')[:70]}  ({extra})")
    return "\n".join(out)


def main() -> None:
    import torch

    from longserve.kernels import int4_mma_gemv, quant_gemv
    from longserve.kernels.quant_reference import pack_int_k

    torch.manual_seed(0)
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    calls = []
    for shape, (n, k) in SHAPES.items():
        qweight = pack_int_k(torch.randint(0, 16, (n, k), device="cuda"), 4)
        scales = torch.full((n, k // 128), k**-0.5 / 4, device="cuda", dtype=torch.float16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for name, mma, ahead in VARIANTS:

            def call(x=x, w=(qweight, scales), mma=mma, ahead=ahead):
                quant_gemv.INT4_MMA_GEMV = mma
                int4_mma_gemv.AHEAD = ahead
                return quant_gemv.wna16_gemv(x, w[0], w[1], None, None, 4, 128)

            if only in (None, f"{shape} {name}"):
                calls.append((f"{shape} {name}", call))
    profile_calls(calls)


if __name__ == "__main__":
    if "--source-summary" in sys.argv:
        print(source_summary(sys.argv[sys.argv.index("--source-summary") + 1]))
    else:
        run(main, summary)
