"""Benchmarks: `latency` (offline TTFT, cached-prefix TTFT, decode inter-token latency)."""

from __future__ import annotations

__all__ = ["run_latency"]


def __getattr__(name: str):
    # lazy, so `python -m longserve.bench.latency` does not import the module twice
    if name == "run_latency":
        from longserve.bench.latency import run_latency

        return run_latency
    raise AttributeError(f"module 'longserve.bench' has no attribute {name!r}")
