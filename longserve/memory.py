"""Bounds on native caches that would otherwise grow a long-running process's memory with its traffic.

On the CPU, PyTorch runs bfloat16/float16 matmuls (every linear layer of a bf16 model) through oneDNN, which
JIT-compiles kernels for each new problem shape and keeps them in two LRU caches: oneDNN's primitive cache
(`ONEDNN_PRIMITIVE_CACHE_CAPACITY`) and ideep's cache in front of it (`LRU_CACHE_CAPACITY`), 1,024 entries
each by default. An engine step has a new shape whenever its number of tokens is new (anything from 1 to
chunked_prefill_size), and an entry holds 0.65-1.4 MiB (measured with torch 2.13 on the 2-core AMD EPYC CI
machine: 0.65 MiB for a 512x256 bf16 weight, 1.4 MiB for 4096x2048 with up to 2,000 rows), so the caches
fill with the kernels of step sizes that rarely come back: the demo model's server grew +51 KiB per request
of `scripts/dev/soak.py` traffic over requests 1,000-5,000 (917 -> 1,172 MiB; `benchmarks/RESULTS.md`),
toward ~1,024 kernels, 0.7-1.4 GiB. The attention runs in float32 (MKL, no per-shape kernels): nothing there.

64 entries each keep the kernels of the last dozen step sizes (about 5 weight shapes per size): a decode
step (the batch size changes slowly) still finds its kernels, and a miss costs ~0.2 ms of JIT per shape
(80 us per call with the kernel cached, 225-290 us without, one CPU thread). With 64 the soak's server stayed
flat over 20,000 requests (+0.075 KiB/request after the warm-up, within 503-537 MiB) at 49.9 ms of CPU per
request, against 53.6 ms before. A capacity already set in the environment is kept; 0 is not a valid value
(ideep crashes on it).
"""

from __future__ import annotations

import os

KERNEL_CACHE_ENTRIES = 64
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> None:
    """Cap oneDNN's and ideep's kernel caches at `entries` unless the environment already sets them.

    Both libraries read the variables once, at the process's first oneDNN matmul: the model runner calls
    this before it loads the model (afterwards it changes nothing). Processes started later (tensor-parallel
    workers) inherit the values."""
    if entries < 1:
        raise ValueError(f"kernel cache entries must be at least 1, got {entries}")
    for name in KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, str(entries))
