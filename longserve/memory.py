"""Bounds on native caches and heaps that would otherwise grow a long-running process's memory with its traffic.

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


# glibc serves an allocation of at least M_MMAP_THRESHOLD bytes (128 KiB at start) with its own mmap, returned to
# the system when freed; but each such free raises the threshold to the freed size (up to 32 MiB), so a CPU
# engine's step tensors (activations, logits: hundreds of KiB to MiBs) soon come from the heap instead, where
# they fragment it and the process keeps their pages. On the 2-core Xeon (2026-12-03) the demo model's server
# grew +65 KiB/request over requests 260-800 of the one-minute soak (545 MiB at the end) with the dynamic
# threshold, and +28 KiB/request (487 MiB) with it fixed at 128 KiB (MALLOC_MMAP_THRESHOLD_=131072), at the same
# CPU time per request (58.8 and 59.4 ms); MALLOC_ARENA_MAX=2 changed nothing (+66). Setting the threshold also
# switches the dynamic adjustment off (mallopt(3)).
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc's malloc.h)
MMAP_THRESHOLD_BYTES = 128 * 1024
MMAP_THRESHOLD_VARIABLE = "MALLOC_MMAP_THRESHOLD_"


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `nbytes` for this process (allocations that large get their own mapping,
    given back when freed), unless the environment sets it (the user's value wins) or the C library is not
    glibc. Whether it was set. The CPU model runner calls it: a GPU engine's host allocations are few."""
    if MMAP_THRESHOLD_VARIABLE in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, nbytes) == 1
