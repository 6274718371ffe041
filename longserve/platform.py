"""The one place that knows about hardware: device resolution, memory queries, GPU timing, and the attention
backend registry (names, other engines' aliases, the device-dependent `auto` rule) that LLM, `serve` and
`bench` all read. torch is imported inside the functions, so the names are importable for a CLI's --help."""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# canonical backend -> the spellings of it users bring from SGLang and vLLM (lower case)
_BACKEND_SPELLINGS: dict[str, tuple[str, ...]] = {
    "torch": ("torch", "torch_native", "sdpa"),
    "triton": ("triton", "flashinfer", "fa3", "fa4", "flash_attn", "flash-attn", "flashattn",
               "flash_attention"),
}  # fmt: skip
_BACKEND_BY_SPELLING = {s: name for name, spellings in _BACKEND_SPELLINGS.items() for s in spellings}
ATTENTION_BACKENDS: tuple[str, ...] = tuple(_BACKEND_SPELLINGS)  # the backends that exist
ATTENTION_BACKEND_CHOICES: tuple[str, ...] = ("auto", *_BACKEND_BY_SPELLING)  # every spelling accepted


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    """Whether the fused Triton kernels serve `x`: CUDA tensors when triton imports; never on the CPU."""
    return x.is_cuda and triton_available()


def attention_backend_help() -> str:
    """One line for a CLI's --help, built from the registry."""
    aliases = "; ".join(
        f"{'/'.join(s for s in spellings if s != name)} mean {name}"
        for name, spellings in _BACKEND_SPELLINGS.items()
    )
    backends = ", ".join(ATTENTION_BACKENDS)
    return f"auto (triton on CUDA, torch elsewhere), {backends}; {aliases}; on the CPU all are torch"


def normalize_attention_backend(name: str) -> str:
    """The canonical backend a spelling means (case-insensitive), or 'auto'; ValueError naming every spelling
    accepted otherwise."""
    key = name.strip().lower() if isinstance(name, str) else None
    if key == "auto":
        return "auto"
    backend = _BACKEND_BY_SPELLING.get(key)
    if backend is None:
        raise ValueError(
            f"unknown attention backend {name!r}; accepted: {', '.join(ATTENTION_BACKEND_CHOICES)}"
        )
    return backend


def _device_type(device: torch.device | str) -> str:
    if isinstance(device, str):
        if device == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return device.split(":")[0]
    return device.type


def resolve_attention_backend(name: str, device: torch.device | str) -> str:
    """The backend that runs on `device` for a spelling: every name is torch off CUDA (the Triton kernels need
    a GPU); on CUDA 'auto' is triton when triton is installed, else torch."""
    backend = normalize_attention_backend(name)
    if _device_type(device) != "cuda":
        return "torch"
    if backend == "auto":
        return "triton" if importlib.util.find_spec("triton") is not None else "torch"
    return backend


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when a GPU is visible, else the CPU; 'cuda' without a GPU is a clear error."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "device='cuda' was asked for but no CUDA GPU is visible; use device='cpu' or 'auto'"
            )
        device = torch.device(name)
        # an explicit index: torch.cuda.set_device and memory queries need one
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def to_device_async(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: to a GPU through pinned memory and a
    non-blocking copy, queued like a kernel (a pageable copy drains the stream first, torch's
    memcpy_and_sync, so a step queued behind a running one, the overlapped schedule, would wait for it; the
    pinned block is reused only once the copy is done)."""
    if _device_type(device) != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def host_to_device(data: object, dtype: torch.dtype | None, device: torch.device | str) -> torch.Tensor:
    """torch.tensor(data, dtype=dtype, device=device) that does not wait for the device (to_device_async)."""
    import torch

    return to_device_async(torch.tensor(data, dtype=dtype), device)


def available_memory_bytes(device: torch.device) -> tuple[int, int]:
    """(total, free) bytes of the memory that holds the KV pool on `device`."""
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return total, free
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
        return info["MemTotal"], info["MemAvailable"]
    except (OSError, KeyError):  # not Linux: assume half the RAM is free
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total // 2


def static_budget(device: torch.device, fraction: float) -> tuple[float, int, int]:
    """(bytes of `fraction` of the device's memory not yet in use, total, free): with the weights resident, what
    the KV pool and a hybrid model's states may take (mem_fraction_static bounds weights and those together)."""
    total, free = available_memory_bytes(device)
    return total * fraction - (total - free), total, free


def cuda_time_ms(fn: Callable[[], object], warmup: int = 5, iters: int = 20, repeats: int = 5) -> float:
    """Median milliseconds per call of `fn` on the current CUDA stream (events around `iters` calls, median
    over `repeats`, after `warmup` calls)."""
    import statistics

    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def capture_cuda_graph(fn: Callable[[], object], warmup: int = 1, iters: int = 1):
    """A torch.cuda.CUDAGraph of `iters` calls of `fn`, after `warmup` eager calls on a side stream (kernels
    compile and allocations settle outside the graph)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    return graph


def cuda_graph_time_ms(fn: Callable[[], object], warmup: int, iters: int, repeats: int) -> float:
    """Median device ms per call of `fn`: `iters` calls captured in one CUDA graph, replayed `repeats`
    times, so no host launch cost (a decode-sized call is shorter than its eager launches)."""
    graph = capture_cuda_graph(fn, warmup, iters)
    return cuda_time_ms(graph.replay, warmup=1, iters=1, repeats=repeats) / iters
