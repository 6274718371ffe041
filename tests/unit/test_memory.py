"""bound_kernel_caches: oneDNN's per-shape kernels no longer grow a process's RSS with every new matmul shape
(the server's RSS leak under steady traffic), and a capacity the user set wins."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from longserve.memory import KERNEL_CACHE_VARIABLES, bound_kernel_caches

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# bf16 linears with 300 row counts, as an engine's steps have with new token counts; prints the RSS growth in
# MiB. float32 work first, as a server does before its first bf16 matmul: the capacities are read lazily.
PROBE = """
import sys, torch
torch.set_num_threads(1)
torch.randn(8, 8) @ torch.randn(8, 8)
if sys.argv[1] == "bounded":
    from longserve.memory import bound_kernel_caches
    bound_kernel_caches()
def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
w = torch.randn(512, 256, dtype=torch.bfloat16)
x = torch.randn(400, 256, dtype=torch.bfloat16)
torch.nn.functional.linear(x[:1], w)
base = rss_mib()
for m in range(2, 302):
    torch.nn.functional.linear(x[:m], w)
print(rss_mib() - base)
"""


def run_probe(code: str, *args: str, timeout: float = 60, drop_env: tuple[str, ...] = ()) -> str:
    """The last line a probe prints, run as `python -c code *args` in a process of its own (the repository on
    its path; the environment's variables in `drop_env` unset)."""
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    env["PYTHONPATH"] = REPO
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def rss_growth(mode: str) -> float:
    return float(run_probe(PROBE, mode, timeout=300, drop_env=KERNEL_CACHE_VARIABLES))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_bounded_kernel_caches_stop_the_growth() -> None:
    unbounded = rss_growth("default")
    if unbounded < 60:  # ~0.65 MiB a shape where oneDNN compiles them (190 MiB on the CI machine's AVX-512)
        pytest.skip(f"this CPU does not run bf16 matmuls through oneDNN's JIT kernels (+{unbounded:.0f} MiB)")
    bounded = rss_growth("bounded")
    # 16 kernels of ~0.65-1.4 MiB at most, against ~300 without the bound (with 64: +59 against +191 MiB on the
    # EPYC CI machine, +69 against +199 on a Xeon)
    assert bounded < 40, (bounded, unbounded)
    assert bounded < unbounded / 2, (bounded, unbounded)


def test_a_capacity_set_by_the_user_wins(monkeypatch) -> None:
    for name in KERNEL_CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")
    bound_kernel_caches(32)
    assert os.environ["LRU_CACHE_CAPACITY"] == "512"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "32"
    with pytest.raises(ValueError, match="at least 1"):
        bound_kernel_caches(0)  # ideep crashes on a capacity of 0


# 100 MiB of 256 KiB blocks from the heap (after a freed 8 MiB mapping raised glibc's mmap threshold, as a CPU
# engine's steps do), all freed but the last, which keeps the heap's top from shrinking; prints how many MiB the
# RSS fell in the next half second.
TRIM_PROBE = """
import ctypes, sys, time
from longserve.memory import start_heap_trimmer
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
libc.free(libc.malloc(8 << 20))
blocks = [libc.malloc(256 << 10) for _ in range(400)]
for b in blocks:
    libc.memset(b, 1, 256 << 10)
for b in blocks[:-1]:
    libc.free(b)
before = rss_mib()
if sys.argv[1] == "on":
    assert start_heap_trimmer(0.05) and start_heap_trimmer(0.05)  # once per process: the second call a no-op
time.sleep(0.5)
print(before - rss_mib())
"""


def rss_fall_mib(mode: str) -> float:
    return float(run_probe(TRIM_PROBE, mode))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_the_heap_trimmer_gives_freed_heap_pages_back() -> None:
    assert rss_fall_mib("off") < 10  # free() alone keeps them: the top of the heap is in use
    assert rss_fall_mib("on") > 80


def test_a_forked_child_starts_a_trimmer_of_its_own() -> None:
    """A child forked after the parent started its trimmer (tensor-parallel workers may be) has no such thread:
    start_heap_trimmer must start one there rather than take the parent's record for it."""
    probe = (
        "import os, threading\n"
        "from longserve import memory\n"
        "assert memory.start_heap_trimmer(60)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    ok = not memory._trimmer and memory.start_heap_trimmer(60) and memory._trimmer[0].is_alive()\n"
        "    os._exit(0 if ok else 3)\n"
        "print(os.waitpid(pid, 0)[1] >> 8)\n"
    )
    assert run_probe(probe) == "0"
