"""Aggregate per-request results of a serving run: counts, throughput, and mean/median/P90/P95/P99 of TTFT,
inter-token latency, time per output token and end-to-end latency (seconds)."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from longserve.bench.backends import RequestResult

PERCENTILES = (90, 95, 99)
MAX_ERRORS = 5


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "std": None, **{f"p{q}": None for q in PERCENTILES}}
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "std": statistics.pstdev(values),
        **{f"p{q}": percentile(values, q) for q in PERCENTILES},
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    cached = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    errors = Counter(r.error for r in results if not r.success)
    duration = max(duration, 1e-9)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": [f"{msg} (x{n})" if n > 1 else str(msg) for msg, n in errors.most_common(MAX_ERRORS)],
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_cached_tokens": sum(r.cached_tokens or 0 for r in cached) if cached else None,
        # the server's own per-response counts: sum(cached) / sum(prompt) of the responses that report them
        "cache_hit_rate": (
            sum(r.cached_tokens or 0 for r in cached) / sum(r.prompt_tokens or 0 for r in cached)
            if cached
            else None
        ),
        "request_throughput": len(ok) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
        "ttft": distribution([r.ttft for r in ok if r.ttft is not None]),
        "itl": distribution([gap for r in ok for gap in r.itl]),
        "tpot": distribution(
            [
                (r.latency - r.ttft) / (r.output_tokens - 1)
                for r in ok
                if r.output_tokens > 1 and r.latency is not None and r.ttft is not None
            ]
        ),
        "e2e": distribution([r.latency for r in ok if r.latency is not None]),
    }
