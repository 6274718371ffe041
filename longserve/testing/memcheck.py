"""Bounds checks for Triton kernels run in the interpreter (TRITON_INTERPRET=1): every load and store a program
makes, where its mask lets it through, must fall inside one of the launch's tensor arguments (the span of each
view: its first element to its last). On a GPU an address past them is an illegal memory access, or worse, a
silent read of a neighbour's memory; the interpreter reads and writes host memory through raw pointers and
checks nothing, so a kernel whose masks miss a case passes its CPU tests. (compute-sanitizer does this on a
GPU; this is the CPU's.)

    with bounds_checked():
        kernel_wrapper(...)  # an AssertionError names the kernel, the address and the nearest argument

`LONGSERVE_MEMCHECK=1` turns it on for a whole pytest session (tests/conftest.py). Atomics are not checked.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

_state = threading.local()  # .ranges: (starts, ends, names) of the launch running on this thread


def _span(t: Any) -> tuple[int, int] | None:
    """[first byte, past the last byte] of a tensor view's elements; None for an empty one."""
    if t.numel() == 0:
        return None
    start = t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)
    return start, start + (last + 1) * t.element_size()


def _ranges(named: list[tuple[str, Any]]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    spans = []
    for name, arg in named:
        base = getattr(arg, "base", None)  # a TensorDescriptor: its tensor
        tensor = arg if hasattr(arg, "data_ptr") else base if hasattr(base, "data_ptr") else None
        if tensor is not None and (span := _span(tensor)) is not None:
            spans.append((*span, name))
    spans.sort()
    merged: list[list[Any]] = []  # views of one buffer overlap: their union
    for start, end, name in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
            merged[-1][2] += f"|{name}"
        else:
            merged.append([start, end, name])
    starts = np.array([m[0] for m in merged], dtype=np.uint64)
    ends = np.array([m[1] for m in merged], dtype=np.uint64)
    return starts, ends, [m[2] for m in merged]


def _check(kind: str, ptrs: Any, mask: Any) -> None:
    ranges = getattr(_state, "ranges", None)
    if ranges is None:
        return
    starts, ends, names, kernel = ranges
    addrs = np.asarray(ptrs.data, dtype=np.uint64)
    active = (
        addrs[np.broadcast_to(np.asarray(mask.data, dtype=bool), addrs.shape)] if mask is not None else addrs
    )
    active = active.reshape(-1)
    if active.size == 0:
        return
    from triton.runtime.interpreter import _get_np_dtype

    size = np.uint64(np.dtype(_get_np_dtype(ptrs.get_element_ty())).itemsize)
    idx = np.searchsorted(starts, active, side="right").astype(np.int64) - 1
    inside = (idx >= 0) & (active + size <= ends[np.maximum(idx, 0)])
    if inside.all():
        return
    bad = int(active[~inside][0])
    near = int(
        np.argmin(np.minimum(np.abs(starts.astype(np.int64) - bad), np.abs(ends.astype(np.int64) - bad)))
    )
    raise AssertionError(
        f"{kernel}: a {kind} at {bad:#x}, outside every tensor argument ({int((~inside).sum())} of {active.size} "
        f"addresses); nearest: {names[near]} [{int(starts[near]):#x}, {int(ends[near]):#x}) "
        f"({bad - int(ends[near]):+d} bytes from its end)"
    )


@contextlib.contextmanager
def bounds_checked() -> Iterator[None]:
    """Within it, every interpreted launch checks its loads and stores (module docstring)."""
    from triton.runtime import interpreter

    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    saved = executor.__call__, builder.create_masked_load, builder.create_masked_store

    @functools.wraps(saved[0])
    def call(self, *args, **kwargs):
        import inspect

        names = inspect.getfullargspec(self.fn).args
        named = list(zip(names, args)) + list(kwargs.items())
        outer = getattr(_state, "ranges", None)
        _state.ranges = (*_ranges(named), getattr(self.fn, "__name__", "kernel"))
        try:
            return saved[0](self, *args, **kwargs)
        finally:
            _state.ranges = outer

    def load(self, ptrs, mask, *args, **kwargs):
        _check("load", ptrs, mask)
        return saved[1](self, ptrs, mask, *args, **kwargs)

    def store(self, ptrs, value, mask, *args, **kwargs):
        _check("store", ptrs, mask)
        return saved[2](self, ptrs, value, mask, *args, **kwargs)

    executor.__call__, builder.create_masked_load, builder.create_masked_store = call, load, store
    try:
        yield
    finally:
        executor.__call__, builder.create_masked_load, builder.create_masked_store = saved
