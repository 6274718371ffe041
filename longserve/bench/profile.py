"""Where a step's time goes: run a function under torch.profiler and sum device (or, on CPU, leaf-op) time
per category — MoE experts, GEMM, attention, collectives (all-reduce, all-gather), norm/RoPE/activation,
quantization (weights dequantized, activations quantized), KV store, other — against the wall time.
`bench latency --profile` records this per case; the collectives share is the tensor-parallel cost.
`bench latency --host-profile` runs the case once more under cProfile: the Python functions the host spends
its time in (what keeps a GPU idle between kernels when a step is host-bound).

The categories are matched on kernel names (CUDA: cuBLAS `nvjet`/`sm90_xmma`/`cutlass`, cuDNN attention,
our Triton kernels, NCCL) or aten op names (CPU); anything unmatched is "other", never dropped. "moe" is the
fused MoE kernel (`_moe_gemm_kernel`), its alignment and its router top-k on CUDA; on the CPU, every op run
inside the experts' profiler range (models/moe.PROFILE_RANGE: routing and the torch reference's expert
matmuls).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# first match wins: order matters ("nccl" before anything a collective kernel name might also contain)
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("collectives", ("nccl", "all_reduce", "allreduce", "all_gather", "allgather", "c10d")),
    # before gemm ("_moe_gemm_kernel" names both) and sampling (the router's "_route_topk_kernel" says topk)
    ("moe", ("_moe_gemm", "fused_moe", "moe_align", "_route_topk")),
    (
        "attention",
        ("cudnn", "flash", "fmha", "attn", "attention", "sdpa", "_extend", "_decode_split", "_merge_splits"),
    ),
    (
        "gemm",
        ("gemm", "nvjet", "xmma", "cutlass", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "matmul"),
    ),
    ("norm/rope/act", ("rms_norm", "_rms", "rope", "rotat", "silu", "layer_norm")),
    # weights dequantized (the int4 prefill's experts, 139 of the A3B's cold 32K ms on an H100, thirty-seventh
    # session, had counted as "other") and activations quantized; the fused SiLU + quantization stays above
    ("quant", ("dequant", "quant_kernel", "quantize")),
    ("kv store", ("index_put", "scatter", "store_kv", "kv_store", "index_copy")),
    ("sampling", ("argmax", "softmax", "sort", "topk", "multinomial", "exponential")),
)


def categorize(name: str) -> str:
    low = name.lower()
    for category, needles in CATEGORIES:
        if any(n in low for n in needles):
            return category
    return "other"


def _event_time_us(evt: Any, device: bool) -> float:
    if device:
        for attr in ("self_device_time_total", "self_cuda_time_total"):
            value = getattr(evt, attr, None)
            if value:
                return float(value)
        return 0.0
    return float(getattr(evt, "self_cpu_time_total", 0.0) or 0.0)


def profile_call(fn: Callable[[], Any], device_type: str, top: int = 12) -> tuple[Any, dict[str, Any]]:
    """Run `fn` once under the profiler; (its result, {wall_ms, busy_ms, by_category_ms, shares, top_ops}).

    On CUDA the sums are kernel time on the device (busy_ms < wall_ms means the GPU idled: launch gaps or
    host work); on CPU they are self times of leaf aten ops."""
    import torch.profiler
    from torch.profiler import ProfilerActivity

    cuda = device_type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        _sync()
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        result = fn()
        if cuda:
            _sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
    by_cat: dict[str, float] = {}
    ops: list[tuple[float, str, int]] = []
    timed = _device_kernels(prof) if cuda else _cpu_leaf_ops(prof)
    for key, cat, us, count in timed:
        by_cat[cat] = by_cat.get(cat, 0.0) + us / 1e3
        ops.append((us / 1e3, key, count))
    busy_ms = sum(by_cat.values())
    ops.sort(reverse=True)
    # on CUDA, each kernel's time once the ones before it are done: with programmatic dependent launch a kernel
    # starts while the one ahead drains and waits for it, so its span holds the other's tail (spans then sum past
    # the wall: the 8B int4 b1 decode, 223 ms of spans in a 134 ms wall)
    exclusive = exclusive_times(_kernel_intervals(prof)) if cuda else {}
    summary = dict(
        wall_ms=wall_ms,
        busy_ms=busy_ms,
        by_category_ms=dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        share_of_wall={k: v / wall_ms for k, v in by_cat.items()},
        top_ops=[dict(name=n[:120], ms=ms, calls=c) for ms, n, c in ops[:top]],
    )
    for op, (_, n, _) in zip(summary["top_ops"], ops):
        if n in exclusive:
            op["exclusive_ms"] = exclusive[n] / 1e3
    if exclusive:
        summary["exclusive_ms"] = sum(exclusive.values()) / 1e3
    return result, summary


def exclusive_times(intervals: list[tuple[str, float, float]]) -> dict[str, float]:
    """Per name, the time of its (name, start, end) intervals not covered by an interval that started before:
    the intervals in start order, each counted from the latest end so far (never below zero). Their sum is the
    union of the intervals: the device's busy time, each part given to the kernel that ran it first."""
    out: dict[str, float] = {}
    frontier = float("-inf")
    for name, start, end in sorted(intervals, key=lambda i: (i[1], i[2])):
        out[name] = out.get(name, 0.0) + max(0.0, end - max(start, frontier))
        frontier = max(frontier, end)
    return out


def _kernel_intervals(prof: Any) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every device kernel the profiler saw (CUDA-graph replays' kernels too)."""
    out = []
    for evt in prof.events() if hasattr(prof, "events") else ():
        kernel = str(getattr(evt, "device_type", "")).endswith("CUDA")
        if not kernel or getattr(evt, "is_user_annotation", False) or evt.name.startswith("nccl:"):
            continue  # user annotations on the device's timeline span kernels counted already
        span = getattr(evt, "time_range", None)
        if span is not None and span.end > span.start:
            out.append((evt.name, float(span.start), float(span.end)))
    return out


def _device_kernels(prof: Any) -> list[tuple[str, str, float, int]]:
    """(kernel name, category, device us, calls) of every kernel, by name; the time a kernel spent launched
    from inside the MoE profiler range (routing, alignment: torch kernels in eager steps) counts as "moe"."""
    in_moe = _moe_range_kernel_us(prof)
    out = []
    for evt in prof.key_averages():
        is_kernel = str(getattr(evt, "device_type", "")).endswith("CUDA")
        # user annotations on the GPU timeline (e.g. "nccl:all_reduce") span kernels counted already
        if not is_kernel or getattr(evt, "is_user_annotation", False) or evt.key.startswith("nccl:"):
            continue
        us = _event_time_us(evt, True)
        if us <= 0:
            continue
        moe_us = min(in_moe.get(evt.key, 0.0), us)
        if moe_us > 0:
            out.append((evt.key, "moe", moe_us, int(evt.count)))
        if us - moe_us > 0:
            out.append((evt.key, categorize(evt.key), us - moe_us, int(evt.count)))
    return out


def _moe_range_kernel_us(prof: Any) -> dict[str, float]:
    """Device us per kernel name of the kernels launched by an op inside the MoE profiler range (the
    profiler links each kernel to the op that launched it). A replayed CUDA graph's kernels have no launching
    op: they keep their name's category (the fused MoE kernel is "moe" by name)."""
    from longserve.models.moe import PROFILE_RANGE

    out: dict[str, float] = {}
    for evt in prof.events() if hasattr(prof, "events") else ():
        kernels = getattr(evt, "kernels", None)
        if not kernels:
            continue
        node = evt
        while node is not None and node.name != PROFILE_RANGE:
            node = node.cpu_parent
        if node is None:
            continue
        for kernel in kernels:
            out[kernel.name] = out.get(kernel.name, 0.0) + float(kernel.duration)
    return out


def _cpu_leaf_ops(prof: Any) -> list[tuple[str, str, float, int]]:
    """(op name, category, self us, calls) of the leaf aten/collective ops, by op and category: an op run
    inside the MoE profiler range counts as "moe" (the reference experts' matmuls are aten::mm)."""
    from longserve.models.moe import PROFILE_RANGE

    sums: dict[tuple[str, str], list[float]] = {}
    for evt in prof.events():
        key = evt.name
        if not key.startswith(("aten::", "c10d::", "gloo:")) or key in _CPU_WRAPPERS:
            continue
        us = float(getattr(evt, "self_cpu_time_total", 0.0) or 0.0)
        if us <= 0:
            continue
        cat = categorize(key)
        parent = evt.cpu_parent
        while parent is not None and cat != "collectives":
            if parent.name == PROFILE_RANGE:
                cat = "moe"
                break
            parent = parent.cpu_parent
        acc = sums.setdefault((key, cat), [0.0, 0])
        acc[0] += us
        acc[1] += 1
    return [(key, cat, us, int(n)) for (key, cat), (us, n) in sums.items()]


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


# aten ops whose self time is only dispatch around a child op (counted in the child)
_CPU_WRAPPERS = frozenset({"aten::linear", "aten::matmul", "aten::scaled_dot_product_attention"})


def format_profile(name: str, summary: dict[str, Any]) -> str:
    """One line per category: 'cold-8192: wall 214.0 ms, device busy 205.1 ms | gemm 150.2 (70%) ...'."""
    parts = [
        f"{k} {v:.1f} ({100 * summary['share_of_wall'][k]:.0f}%)"
        for k, v in summary["by_category_ms"].items()
    ]
    head = f"{name}: wall {summary['wall_ms']:.1f} ms, busy {summary['busy_ms']:.1f} ms"
    if "exclusive_ms" in summary:
        head += f" (kernels past their waits: {summary['exclusive_ms']:.1f} ms)"
    return head + " | " + ", ".join(parts)


def host_profile_call(fn: Callable[[], Any], top: int = 15) -> tuple[Any, dict[str, Any]]:
    """Run `fn` once under cProfile (after a device sync); (its result, {wall_ms, top_functions}) with the
    functions that spent the most time themselves (self ms, cumulative ms, calls), longserve's and torch's."""
    import cProfile
    import pstats

    _maybe_sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    try:
        result = fn()
        _maybe_sync()
    finally:
        prof.disable()
    wall_ms = (time.perf_counter() - t0) * 1e3
    stats = pstats.Stats(prof).stats  # {(file, line, func): (prim calls, calls, self s, cum s, callers)}
    rows = []
    for (path, line, func), (_, calls, self_s, cum_s, _) in stats.items():
        where = func if path == "~" else f"{_short_path(path)}:{line}({func})"
        rows.append(dict(function=where, self_ms=self_s * 1e3, cum_ms=cum_s * 1e3, calls=calls))
    rows.sort(key=lambda r: -r["self_ms"])
    return result, dict(wall_ms=wall_ms, top_functions=rows[:top])


def format_host_profile(name: str, summary: dict[str, Any]) -> str:
    lines = [f"{name}: host profile, wall {summary['wall_ms']:.1f} ms (self ms / cumulative ms / calls)"]
    for r in summary["top_functions"]:
        lines.append(f"  {r['self_ms']:8.2f} {r['cum_ms']:8.2f} {r['calls']:7d}  {r['function']}")
    return "\n".join(lines)


def _short_path(path: str) -> str:
    for marker in ("/longserve/", "/torch/", "/triton/", "/transformers/"):
        if marker in path:
            return marker.strip("/") + "/" + path.split(marker, 1)[1]
    return path.rsplit("/", 1)[-1]


def _maybe_sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
