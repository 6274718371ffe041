"""GPU probe: where the split cuDNN path (two SDPA calls merged) starts to beat the Triton extend kernel for
a chunk of new tokens over a cached prefix, the backend's SPLIT_SDPA_MIN_QUERY (Llama-3.1-8B heads, bf16).
On a CUDA GPU: python3 scripts/probes/probe_split_threshold.py
"""

from __future__ import annotations

from longserve.attention.triton_backend import SPLIT_SDPA_MIN_QUERY
from longserve.bench.kernels.attention import BenchCase, bench_attention


def main() -> None:
    cases = [
        BenchCase(f"{q}_over_{p // 1024}k", p, q) for p in (8192, 32768) for q in (128, 256, 512, 1024, 2048)
    ]
    rows = bench_attention(cases, warmup=3, repeats=10)
    print(f"SPLIT_SDPA_MIN_QUERY = {SPLIT_SDPA_MIN_QUERY}; ms per layer (TFLOP/s)")
    by_case: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["impl"]] = r
    for case, impls in by_case.items():
        t, s = impls["triton"], impls["split_sdpa"]
        print(
            f"  {case:<14} triton {t['ms']:7.3f} ({t['tflops']:5.0f})  split cuDNN {s['ms']:7.3f} ({s['tflops']:5.0f})"
            f"  {'cuDNN' if s['ms'] < t['ms'] else 'triton'} wins by {max(t['ms'], s['ms']) / min(t['ms'], s['ms']):.2f}x"
        )


if __name__ == "__main__":
    main()
