"""Generic pieces of the Gluon decode GEMV on the tensor cores (int4_mma_gemv.py), apart from its mapping: aranges
along one axis of a 4D layout, programmatic dependent launch, L2 prefetches, the store of a split-K program's sums
(quant_tiles.store_gemv_out's contract, in Gluon), the split count that keeps one wave, and the weights' TMA
descriptors kept per weight tensor (fp8_wgmma_gemv.py too)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from longserve.kernels.gluon_compat import barrier
from longserve.kernels.quant_tiles import sum_loads

__all__ = ["one_wave_splits", "silu_times", "weight_descriptor"]

# weight tensor -> {its key: its TMA descriptor}; held weakly by the tensor (a descriptor holds a view of it): a freed
# weight's descriptors go with it (a table keyed by address kept every weight a test or a benchmark made alive)
_DESCRIPTORS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def weight_descriptor(weight: torch.Tensor, key: tuple, make: Callable[[], object]):
    """The TMA descriptor `make()` builds over `weight` for `key` (the view, box and layout it stands for), made once
    per weight tensor and key: a decode step's host time."""
    per_weight = _DESCRIPTORS.setdefault(weight, {})
    desc = per_weight.get(key)
    if desc is None:
        desc = per_weight[key] = make()
    return desc


def one_wave_splits(n_tiles: int, num_steps: int, resident: int, min_steps: int = 1) -> int:
    """K splits for n_tiles column tiles over num_steps steps: the most for which every program is resident at
    once (`resident` programs on the device), each split at least min_steps steps (one where num_steps is
    fewer), none empty."""
    want = max(1, min(resident // max(n_tiles, 1), num_steps // max(min_steps, 1)))
    return -(-num_steps // -(-num_steps // want))


@gluon.jit
def gdc_wait(USE_PDL: gl.constexpr):
    """Programmatic dependent launch (launch.pdl_prologue's two steps): wait for the kernel before, then let the
    next one be scheduled."""
    if USE_PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )


@gluon.jit
def prefetch_l2(ptrs):
    """launch.prefetch_l2 in Gluon, unmasked: one `prefetch.global.L2` an element."""
    gl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def axis(SIZE: gl.constexpr, AXIS: gl.constexpr, L: gl.constexpr):
    """arange(SIZE) along AXIS of the 4D layout L, with size-1 axes elsewhere."""
    if AXIS == 0:
        i = gl.arange(0, SIZE, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(i, 1), 2), 3)
    elif AXIS == 1:
        i = gl.arange(0, SIZE, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(i, 0), 2), 3)
    elif AXIS == 2:
        i = gl.arange(0, SIZE, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(i, 0), 1), 3)
    else:
        i = gl.arange(0, SIZE, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(i, 0), 1), 2)


@gluon.jit
def store_sums(out_ptr, acc, out_off, out_mask, b_ptr, b_off, b_mask, pid_n, pid_k, stride_os, res_ptr, lock_ptr,
               HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr, SERIAL: gl.constexpr):  # fmt: skip
    """A split-K program's fp32 sums `acc` stored (quant_tiles.store_gemv_out's contract): with one split (+ bias)
    rounded once to out's dtype at out_off; with several, its partials in plane pid_k of [splits, M, N], and
    (SERIAL) the column tile's last program sums the planes in split order (+ bias) into res, loading
    quant_tiles.sum_loads planes at once, then zeroes its counter (lock_ptr[pid_n], zero between launches)."""
    if PARTIAL:
        gl.store(out_ptr + pid_k * stride_os + out_off, acc, mask=out_mask)
        if SERIAL:
            barrier()
            num_splits = gl.num_programs(1)
            if gl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                total = gl.zeros_like(acc)
                # LOADS planes' loads in flight at once, added in split order (-0.0: the exact identity)
                LOADS: gl.constexpr = sum_loads(acc.numel)
                for first in range(0, num_splits, LOADS):
                    for u in gl.static_range(LOADS):
                        total += gl.load(out_ptr + (first + u) * stride_os + out_off,
                                         mask=out_mask & (first + u < num_splits), other=-0.0,
                                         cache_modifier=".cg")  # fmt: skip
                if HAS_BIAS:
                    total += gl.load(b_ptr + b_off, mask=b_mask, other=0.0).to(gl.float32)
                gl.store(res_ptr + out_off, total.to(res_ptr.dtype.element_ty), mask=out_mask)
                gl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next launch
    else:
        if HAS_BIAS:
            acc += gl.load(b_ptr + b_off, mask=b_mask, other=0.0).to(gl.float32)
        gl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@gluon.jit
def silu_times(gate, up, ty: gl.constexpr):
    """silu(gate) * up in fp32 of gate and up (fp32 values of dtype ty), silu rounded to ty first as
    activation.silu_and_mul rounds it (F.silu's rounding); the caller rounds the product."""
    return (gate / (1.0 + gl.exp(-gate))).to(ty).to(gl.float32) * up
