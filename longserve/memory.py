"""Bounds on native caches and the heap, which would otherwise grow a long-running process's memory.

On the CPU, PyTorch runs bfloat16/float16 matmuls (every linear layer of a bf16 model) through oneDNN, which
JIT-compiles kernels for each new problem shape and keeps them in two LRU caches: oneDNN's primitive cache
(`ONEDNN_PRIMITIVE_CACHE_CAPACITY`) and ideep's cache in front of it (`LRU_CACHE_CAPACITY`), 1,024 entries
each by default. An engine step has a new shape whenever its number of tokens is new (anything from 1 to
chunked_prefill_size), and an entry holds 0.65-1.4 MiB (measured with torch 2.13 on the 2-core AMD EPYC CI
machine: 0.65 MiB for a 512x256 bf16 weight, 1.4 MiB for 4096x2048 with up to 2,000 rows), so the caches
fill with the kernels of step sizes that rarely come back: the demo model's server grew +51 KiB per request
of `scripts/dev/soak.py` traffic over requests 1,000-5,000 (917 -> 1,172 MiB; `benchmarks/RESULTS.md`),
toward ~1,024 kernels, 0.7-1.4 GiB. The attention runs in float32 (MKL, no per-shape kernels): nothing there.

16 entries each keep the kernels of the last three step sizes (about 5 weight shapes per size): a decode
step (the batch size changes slowly) still finds its kernels, and a miss costs ~0.2 ms of JIT per shape
(80 us per call with the kernel cached, 225-290 us without, one CPU thread). With 64 entries the soak's server
stayed flat over 20,000 requests on the EPYC machine (+0.075 KiB/request after the warm-up, within 503-537 MiB),
but on a 2-core Xeon with AMX (2026-12-03) the 64 kernels of the demo model's shapes were still filling after
780 requests of the one-minute soak: RSS 633 MiB there and +142 KiB/request over requests 260-780 (CI's gate is
100), against 541 MiB and +65 KiB/request with 16 entries and 521 MiB / +60 with 8, at the same CPU time per
request (58.8 ms with 16, 61.0 with 64). A capacity already set in the environment is kept; 0 is not a valid
value (ideep crashes on it).
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import time

KERNEL_CACHE_ENTRIES = 16
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


# What grows a CPU server's RSS once the kernel caches are full is its heap: glibc serves an allocation of at
# least its mmap threshold with a mapping of its own, given back when freed, but each such free raises the
# threshold (up to 32 MiB), so the steps' tensors soon come from the heap, whose free pages the process keeps.
# On the 2-core Xeon (2026-12-03, one-minute soak, requests 260-800): +60-70 KiB/request and 534-541 MiB at the
# end with 16 kernel entries; with malloc_trim(0) every 2 s, +28-31 KiB/request and 485-492 MiB, at 53.5-56.4 ms
# of CPU per request against 56.6-58.8 (a call took ~1 ms). Fixing the threshold at 128 KiB instead grew as little but made the
# CPU prefill of a 16K prompt 10% slower (every large tensor a fresh mapping); MALLOC_ARENA_MAX=2 changed nothing.
HEAP_TRIM_SECONDS = 2.0
_trimmer: list[threading.Thread] = []
os.register_at_fork(after_in_child=_trimmer.clear)  # a forked child has no thread of its parent's: its own


def start_heap_trimmer(interval_s: float = HEAP_TRIM_SECONDS) -> bool:
    """Give the heap's free pages back to the system every `interval_s` seconds (glibc's malloc_trim, from a
    daemon thread: ctypes releases the GIL for the call), once per process. Whether a trimmer runs (not on
    another C library). The CPU model runner starts it; a GPU engine's host allocations are few."""
    if _trimmer:
        return True
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int

    def trim_forever() -> None:
        while True:
            time.sleep(interval_s)
            malloc_trim(0)

    _trimmer.append(threading.Thread(target=trim_forever, name="longserve-heap-trim", daemon=True))
    _trimmer[0].start()
    return True
