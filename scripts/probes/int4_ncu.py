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

ncu flushes the caches before each profiled kernel (its default --cache-control all): the weights come from HBM, as
in a decode step. Warm-up calls (compiles) run before the profiler starts; then one call each, in the order printed.
"""

from __future__ import annotations

from collections import defaultdict

from ncu_calls import profile_calls, run, table_rows  # this folder (the script's own: first on sys.path)

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


def main() -> None:
    import torch

    from longserve.kernels import quant_gemv
    from longserve.kernels.quant_reference import pack_int_k

    torch.manual_seed(0)
    calls = []
    for shape, (n, k) in SHAPES.items():
        qweight = pack_int_k(torch.randint(0, 16, (n, k), device="cuda"), 4)
        scales = torch.full((n, k // 128), k**-0.5 / 4, device="cuda", dtype=torch.float16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for mma in (True, False):

            def call(x=x, w=(qweight, scales), mma=mma):
                quant_gemv.INT4_MMA_GEMV = mma
                return quant_gemv.wna16_gemv(x, w[0], w[1], None, None, 4, 128)

            calls.append((f"{shape} {'mma ring' if mma else 'cuda cores'}", call))
    profile_calls(calls)


if __name__ == "__main__":
    run(main, summary)
