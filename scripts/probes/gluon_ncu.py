"""GPU probe: Nsight Compute on one call each of the Gluon attention draft (the variant the GLUON_* variables pick),
torch's cuDNN call and vLLM's FA3 (when its build is on PYTHONPATH), on the shapes where the engine spends its long
prompts: 8K new rows over 32K keys with no mask (a chunk's prefix call) and a causal 8K square. Why: the draft runs at
cuDNN's rate and 10-16% below FA3's (RESULTS.md, twenty-second session) and its SASS shows P V's wait placed before
the softmax it was to overlap; the counters say whether the tensor pipe idles on that wait, on the loads, or on the
issue of the softmax itself. The machine runs Firecracker, where ncu reads the counters (device tool's KINDS.md).

    ncu --clock-control none --profile-from-start off --csv --page details --section SpeedOfLight \\
        --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \\
        --section MemoryWorkloadAnalysis --section Occupancy python3 scripts/probes/gluon_ncu.py > ncu.csv
    python3 scripts/probes/gluon_ncu.py --summary ncu.csv      # a few lines a kernel, on any machine

Warm-up calls (compiles, cuDNN's plans) run before the profiler starts; then one call each, in the order printed.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict

from ncu_calls import profile_calls, run, table_rows  # this folder (the script's own: first on sys.path)

# the metrics the summary prints, by ncu's section and metric names (the raw CSV keeps them all)
SUMMARY = {
    "GPU Speed Of Light Throughput": (
        "Duration",
        "Compute (SM) Throughput",
        "Memory Throughput",
        "L2 Cache Throughput",
        "SM Frequency",
    ),  # fmt: skip
    "Compute Workload Analysis": ("Executed Ipc Active", "Issue Slots Busy", "SM Busy"),
    "Scheduler Statistics": (
        "One or More Eligible",
        "No Eligible",
        "Active Warps Per Scheduler",
        "Eligible Warps Per Scheduler",
    ),  # fmt: skip
    "Warp State Statistics": ("Warp Cycles Per Issued Instruction", "Warp Cycles Per Executed Instruction"),
    "Occupancy": ("Achieved Occupancy", "Registers Per Thread"),
}


def summary(path: str) -> str:
    """Per profiled kernel, its short name and the SUMMARY metrics, from ncu's `--csv --page details` output."""
    rows = table_rows(path)
    if rows is None:
        return f"{path}: no ncu table (see the log)"
    kernels: dict[str, dict] = defaultdict(dict)
    names: dict[str, str] = {}
    for row in rows:
        names[row["ID"]] = row["Kernel Name"]
        if row.get("Metric Name") in SUMMARY.get(row.get("Section Name", ""), ()):
            unit = row.get("Metric Unit") or ""
            kernels[row["ID"]][row["Metric Name"]] = f"{row['Metric Value']} {unit}".strip()
    out = []
    for kid, name in names.items():
        out.append(f"[{kid}] {name[:110]}")
        out.extend(f"    {metric}: {value}" for metric, value in kernels[kid].items())
    return "\n".join(out)


def main() -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gluon_attention_check import HKV, HQ, D, ga, heads  # the variant from GLUON_*

    from longserve.attention import sdpa

    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    torch.manual_seed(0)
    scale = D**-0.5
    calls = []
    for new, keys, causal in ((8192, 32768, False), (8192, 8192, True)):
        q = torch.randn(new, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(keys, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(keys, HKV, D, device="cuda", dtype=torch.bfloat16)
        tag = f"{new}x{keys}{' causal' if causal else ''}"
        calls.append((f"gluon {tag}", lambda q=q, k=k, v=v, c=causal: ga.attention(q, k, v, c, scale)))
        calls.append((f"cudnn {tag}", lambda q=q, k=k, v=v, c=causal: sdpa.library_attention_with_lse(heads(q), heads(k),
                                                                                                heads(v), c, scale)))  # fmt: skip
        if flash_attn_varlen_func is not None:
            cu_q = torch.tensor([0, new], dtype=torch.int32, device="cuda")
            cu_k = torch.tensor([0, keys], dtype=torch.int32, device="cuda")
            calls.append((f"fa3 {tag}", lambda q=q, k=k, v=v, c=causal, cu_q=cu_q, cu_k=cu_k, n=new, s=keys:
                          flash_attn_varlen_func(q, k, v, n, cu_q, s, cu_seqlens_k=cu_k, softmax_scale=scale, causal=c,
                                                 fa_version=3)))  # fmt: skip
    profile_calls(calls)


if __name__ == "__main__":
    run(main, summary)
