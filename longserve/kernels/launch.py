"""Re-launch compiled Triton kernels without Triton's per-call dispatch.

`kernel[grid](*args, **meta)` on a `@triton.jit` function re-binds every argument, specializes it in C,
hashes the specialization with the options, reads knobs, checks globals and builds launch metadata for
(empty) launch hooks on every call: 25-70 us of host time per launch on the H200 machine
(`scripts/probes/probe_launch.py`), against the ~5 us of the launcher itself. An eager decoder layer launches
six of them; a short step (a 64-token suffix over a cached prefix, a decode batch past the CUDA graphs) is
bound by that host time, not by the GPU.

`fast_launch(fn)` wraps a `@triton.jit` function so that `kernel[grid](...)` keys each call on what Triton
specializes on (per tensor: dtype and 16-byte alignment; per int: whether it is 1, divisible by 16, and
its width; the constexprs and launch options by value), launches the first call of a key through Triton
(compiling it), keeps the compiled kernel, and afterwards calls its launcher directly. The key is at least
as fine as Triton's, so a kept kernel is never run with arguments it was not compiled for. Anything the
key does not know (an argument of another type, a missing keyword, launch hooks installed by a profiler
such as proton, the interpreter) goes through Triton as before.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = [
    "PDL",
    "PDL_EARLY_LOADS",
    "FastKernel",
    "early_loads",
    "fast_launch",
    "pdl_prologue",
    "prefetch_l2",
    "use_pdl",
]

logger = logging.getLogger(__name__)

# Programmatic dependent launch (sm_90 and later) for the kernels of a decode step that take USE_PDL (norms,
# rotary + K/V store, decode attention and its merge, SiLU-and-mul, the quantized GEMVs and their split-K sum,
# the activations' per-token-group quantization; the MoE router's top-k, alignment, grouped GEMMs, expert GEMVs
# and sum over k, these added after the measurement below and not yet timed with it):
# launched so, a kernel may be scheduled while the one before it in the stream (a CUDA graph keeps the edge)
# still drains, and waits in `pdl_prologue` (griddepcontrol.wait: the previous kernel complete, its writes
# visible) before it touches memory, so every result is unchanged. What it can save is the gap between two
# kernels, ~1-3 us each, ~10 a layer at decode. On: measured on one H200 at 4779ef1 (`gpu_check.sh pdl`, the 8B
# shape), FP8-block batch-1 decode 4.55 -> 4.32 ms and GPTQ int4 4.51 -> 4.31 ms; bf16 unchanged (5.77 / 5.75 ms
# at batch 1, 12.90 / 12.88 at 64: its GEMMs are cuBLAS, not PDL launches); tests/gpu/test_pdl_gpu.py's 11 pass
# (outputs equal on and off). Read at each launch (use_pdl), so scripts/probes/with_constants.py can switch it.
PDL = True
# Loads of what no kernel of the step writes issued before that wait (pdl_prologue's docstring) in the norms, RoPE +
# K/V store and the decode attention (the weight; the position, cos, sin and slot; the length): each was a round
# trip after the wait, in series with the kernel before (scripts/dev/pdl_early_loads.py lists them in sm90 SASS). They
# gain only after a kernel that lets them start early (ours; not cuBLAS's bf16 GEMMs). On since the thirty-first
# session (`gpu_check.sh early-loads` at 82a0989, H100, the PDL GPU tests passing with it): the 8B decode b1@32K int4
# 4.55 -> 4.52 ms, block FP8 5.32 -> 5.28, bf16 7.70 -> 7.68. Read at each launch (early_loads), so with_constants
# can switch it.
PDL_EARLY_LOADS = True

_I32 = (-(2**31), 2**31)
_I64 = (-(2**63), 2**63)
_SLOW = object()  # an argument the key cannot describe: launch through Triton


def _arg_key(a: Any) -> Any:
    """What Triton specializes a runtime argument on (or _SLOW)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    if a is None or isinstance(a, bool):
        return a  # bools and None become constants of the compiled kernel: keyed by value
    if isinstance(a, int):
        width = 32 if _I32[0] <= a < _I32[1] else 64 if _I64[0] <= a < _I64[1] else 65
        return (a == 1, a & 15 == 0, width)
    if isinstance(a, float):
        return float
    return _SLOW


try:  # triton >= 3.4: launch hooks are chains, empty unless a profiler installs one
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older triton: always through Triton
    _knobs = None


def _hooks_installed() -> bool:
    """Whether a launch hook (proton and similar profilers) wants the launch metadata."""
    if _knobs is None:
        return True
    hook = _knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


class FastKernel:
    """A `@triton.jit` function whose compiled variants are launched directly (see the module docstring).

    Use it as the function itself: `kernel[grid](*runtime_args, CONST=..., num_warps=...)`: the runtime
    arguments by position, the constexprs and launch options by keyword, as every kernel here does.
    Another calling style is launched through Triton every time. LONGSERVE_TRITON_FAST_LAUNCH=0 (or
    `FastKernel.enabled = False`) sends every launch through Triton."""

    enabled = os.environ.get("LONGSERVE_TRITON_FAST_LAUNCH", "1") != "0"

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        names = [p.name for p in fn.params]
        runtime = [p.name for p in fn.params if not p.is_constexpr]
        # the runtime parameters must all come first for the positional/keyword split above
        self.num_runtime = len(runtime) if names[: len(runtime)] == runtime else -1
        self.constexpr_names = names[len(runtime) :] if self.num_runtime >= 0 else []
        self._compiled: dict[tuple, Any] = {}
        self.enabled_here = True  # off for good if this triton's launcher rejects a direct launch
        self.fast_launches = 0  # tests and probes read these
        self.slow_launches = 0

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launch(grid, args, kwargs)

        return launch

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        key = self._key(args, kwargs) if self.enabled and self.enabled_here else None
        kernel = self._compiled.get(key) if key is not None else None
        if kernel is None or _hooks_installed():
            self.slow_launches += 1
            compiled = self.fn[grid](*args, **kwargs)
            if key is not None and compiled is not None and hasattr(compiled, "packed_metadata"):
                self._compiled[key] = compiled
            return
        bound = [*args, *(kwargs[n] for n in self.constexpr_names)]  # Triton's parameter order
        stream = self._raw_stream(key[0])
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        try:
            kernel.run(
                grid[0],
                grid_1,
                grid_2,
                stream,
                kernel.function,
                kernel.packed_metadata,
                None,
                None,
                None,
                *bound,
            )
        except TypeError:  # a triton whose launcher takes other arguments: it rejects them before launching
            if self.fast_launches:
                raise
            logger.warning("direct launch of %s failed; launching through Triton from now on", self.fn)
            self.enabled_here = False
            self.slow_launches += 1
            self.fn[grid](*args, **kwargs)
            return
        self.fast_launches += 1

    def _key(self, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        if len(args) != self.num_runtime or any(n not in kwargs for n in self.constexpr_names):
            return None  # a runtime argument by keyword, a defaulted constexpr: Triton binds them
        keys = tuple(map(_arg_key, args))
        if _SLOW in keys:
            return None
        meta = tuple(kwargs.items())  # constexprs and options by value (same call site: same order)
        try:
            hash(meta)
        except TypeError:
            return None
        return (self._current_device(), keys, meta)

    @staticmethod
    def _current_device() -> int:
        return torch.cuda.current_device()

    @staticmethod
    def _raw_stream(device: int) -> int:
        return torch._C._cuda_getCurrentRawStream(device)  # what Triton launches on


def fast_launch(fn: Any) -> Any:
    """Wrap a `@triton.jit` function in a FastKernel; the interpreter's functions are returned as they are."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return fn
    return FastKernel(fn) if isinstance(fn, JITFunction) else fn


def zeroed_counters(table: dict[torch.device, torch.Tensor], size: int, device: torch.device) -> torch.Tensor:
    """`table`'s int32 counters for `device`, `size` of them, made zero on first use: the counters by which a
    kernel's last program of a group finds it is last (quant_tiles.store_gemv_out, decode_attention's merge).
    Each launch leaves them at zero, so one set serves every launch of the device: they run one at a time (one
    compute stream, graph replays on it; a PDL launch waits for the kernel before it first)."""
    counters = table.get(device)
    if counters is None:
        counters = table[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return counters


@functools.cache
def _sm90_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.cache
def is_hopper(device_index: int) -> bool:
    """Whether the CUDA device is sm_90 (read once): what a kernel timed on Hopper alone checks per call."""
    return torch.cuda.get_device_capability(device_index)[0] == 9


def use_pdl(t: torch.Tensor) -> bool:
    """Whether a kernel on t's device launches with programmatic dependent launch (PDL on, a CUDA device of
    sm_90 or later): the value of its USE_PDL and of its `launch_pdl` option."""
    return PDL and t.is_cuda and _sm90_or_later(t.device.index if t.device.index is not None else 0)


def early_loads() -> bool:
    """Whether the kernels with loads before their wait issue them so (PDL_EARLY_LOADS): their EARLY."""
    return PDL_EARLY_LOADS


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """In a kernel that takes USE_PDL, before its first store and before any load of what a kernel of the step may
    have written: wait for the kernel before it to complete (its writes visible), then let the next kernel be
    scheduled (it waits likewise), which it is once every program of this one has come here. Nothing without PDL.
    Loads of what no kernel writes during the step (weights, the host's positions, lengths and slots) may come
    first: a kernel starts only once the one before has passed this wait, so every kernel two back has completed.
    Such a kernel takes EARLY (early_loads) and calls this twice, `pdl_prologue(USE_PDL and not EARLY)` before
    those loads and `pdl_prologue(USE_PDL and EARLY)` after them: one of the two waits."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, mask):
    """`prefetch.global.L2` of each address where mask: the line comes into L2 and nothing waits for it (no register
    is written, so a later load of it finds it there without the SM holding the bytes in flight). The int4 decode
    GEMVs ask so for their first weight tiles before pdl_prologue (weights never depend on the kernel before, whose
    tail would leave HBM idle). CUDA only (inline PTX)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
