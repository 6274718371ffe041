"""Benchmarks: `latency` (offline TTFT, cached-prefix TTFT, decode inter-token latency; its cases in
latency_cases, pool sizing in latency_plan, HF comparison in hf_compare), `serve` and `compare` (online,
against running servers), `kernels` (GPU microbenchmarks of the kernels); `report` formats the records."""

from __future__ import annotations

__all__ = ["run_latency"]


def __getattr__(name: str):
    # lazy, so `python -m longserve.bench.latency` does not import the module twice
    if name == "run_latency":
        from longserve.bench.latency import run_latency

        return run_latency
    raise AttributeError(f"module 'longserve.bench' has no attribute {name!r}")
