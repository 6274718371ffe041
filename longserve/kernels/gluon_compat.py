"""What differs between the Triton releases our Gluon kernels build with (gluon_attention.py, gluon_extend.py,
int4_mma_gemv.py): 3.6 (the H200 machine's) to 3.9 (the CPU machine's). Older ones lack pieces of the API the kernels
use, newer ones are untried (Gluon's API moves between releases): there the library paths answer."""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

__all__ = ["barrier", "cp_async", "reinterpret", "supported", "tma_load"]

# the CTA's (a partition's) warps meet: gl.thread_barrier in Triton 3.6, gl.barrier from 3.7 on
barrier = getattr(gl, "thread_barrier", None) or gl.barrier
# the TMA load: async_copy_global_to_shared in 3.6, async_load (same arguments) from 3.7 on (3.9 raises on the old)
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# cp.async into shared memory: likewise renamed
cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# a shared memory view as another dtype, shape or layout: `_reinterpret` in 3.6, `reinterpret` from 3.7 on
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def reinterpret(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """`smem` viewed as `dtype` [shape] in `layout` (the same bytes)."""
    if _PUBLIC_REINTERPRET:
        return smem.reinterpret(dtype, shape, layout)
    else:
        return smem._reinterpret(dtype, shape, layout)


def supported() -> bool:
    """Whether this Triton's Gluon is one the kernels are known to build with (3.6 to 3.9)."""
    return (3, 6) <= tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 10)
