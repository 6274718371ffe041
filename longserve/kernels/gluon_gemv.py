"""Generic pieces of the Gluon decode GEMV on the tensor cores (int4_mma_gemv.py), apart from its mapping: aranges
along one axis of a 4D layout, programmatic dependent launch, L2 prefetches, the store of a split-K program's sums
(quant_tiles.store_gemv_out's contract, in Gluon), the split count that keeps one wave, and the weights' TMA
descriptors kept per weight tensor (fp8_wgmma_gemv.py too)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
from torch.utils.weak import WeakIdKeyDictionary
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from longserve.kernels.gluon_compat import barrier
from longserve.kernels.launch import zeroed_counters
from longserve.kernels.quant_tiles import sum_loads

__all__ = [
    "NORM_EPILOGUE",
    "RowNorm",
    "norm_launch_args",
    "one_wave_splits",
    "silu_times",
    "weight_descriptor",
]

# A one-row GEMV's last column tile to store adds the row into the residual stream and RMS-norms it (norm_row), where
# the next norm would be a launch of its own (the o projection's and down projection's at decode, batch 1: 64 of the
# 8B's 65 norms a step, 0.205 ms of the int4 b1 step's 3.71 on an H200, twenty-eighth session's profile). The
# int4 tensor-core GEMV's ring and the block-FP8 wgmma GEMV take it at one row (kernels/gemv_fused.py) with tensor
# parallelism off (models/layers.py's RowParallelLinear.then_norm). sm90 builds (Triton 3.6): the int4 ring's 96
# registers unchanged, the FP8 GEMV's 64 -> 80 at one row (shared memory holds 6 programs an SM either way). Off: it
# loses (`gpu_check.sh norm-epilogue`, thirty-first session, H100, its GPU tests passing): the 8B decode b1@32K int4
# 4.56 -> 4.66 ms and FP8 5.32 -> 5.37 at 82a0989; 4.42 -> 4.64 and 5.20 -> 5.26 at f4bba8e (GATED and the early
# loads on). Why is not measured yet (`gpu_check.sh norm-profile`). Read at each call.
NORM_EPILOGUE = False
_NORM_LOCKS: dict[torch.device, torch.Tensor] = {}  # one counter a device (launch.zeroed_counters)


class RowNorm(NamedTuple):
    """The residual add and RMSNorm (norm.fused_add_rms_norm's) a one-row GEMV applies to its product [1, N]."""

    residual: torch.Tensor  # [1, N], the product's dtype
    weight: torch.Tensor  # [N], the product's dtype
    eps: float
    out: torch.Tensor  # [2, N]: the normed row, then the new residual (product + residual)

    @staticmethod
    def fits(residual: torch.Tensor, weight: torch.Tensor, n: int, dtype: torch.dtype, warps: int) -> bool:
        """Whether norm_row takes a row of n: one residual row and a weight of n in the product's dtype, unit strides,
        n at least a value a lane."""
        return (
            residual.shape == (1, n)
            and residual.dtype == weight.dtype == dtype
            and weight.shape == (n,)
            and residual.stride(-1) == 1
            and weight.stride(0) == 1
            and n >= 32 * warps
        )

    @classmethod
    def of(cls, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> RowNorm:
        return cls(residual, weight, float(eps), torch.empty(2, weight.shape[0], dtype=weight.dtype,
                                                             device=weight.device))  # fmt: skip

    def results(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed [1, N], new residual [1, N])."""
        return self.out[:1], self.out[1:]


def norm_launch_args(norm: RowNorm | None, like: torch.Tensor) -> tuple[tuple, dict]:
    """A GEMV kernel's norm_row arguments (nres_ptr, nw_ptr, nout_ptr, nlock_ptr, eps) and constexprs (NORM,
    NORM_BLOCK) for `norm`, or placeholders (`like`) without one."""
    if norm is None:
        return (like, like, like, like, 0.0), {"NORM": False, "NORM_BLOCK": 1}
    n = norm.weight.shape[0]
    locks = zeroed_counters(_NORM_LOCKS, 1, like.device)
    constexprs = {"NORM": True, "NORM_BLOCK": triton.next_power_of_2(n)}
    return (norm.residual, norm.weight, norm.out, locks, norm.eps), constexprs


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
def norm_row(y_ptr, n, nres_ptr, nw_ptr, nout_ptr, nlock_ptr, eps, NORM_BLOCK: gl.constexpr):
    """The product's one row [N] at y_ptr added into the residual stream and RMS-normed (norm.fused_add_rms_norm,
    its rounding: the sum stored in the row's dtype, then normed in fp32, cast, times the weight) by the last of the
    launch's column tiles to store: each tile's program that stored its final values calls this once. nres_ptr: the
    residual [N]; nw_ptr: the norm's weight [N]; nout_ptr: [2, N], the normed row then the new residual; nlock_ptr:
    one int32 counter, zero between launches. Why here: at one row a norm launch of its own waited for the whole
    GEMV and was a kernel's hop in the decode's chain (the 8B int4 b1 profile: 65 norms 0.205 ms of 3.71)."""
    W: gl.constexpr = gl.num_warps()
    layout: gl.constexpr = gl.BlockedLayout([NORM_BLOCK // (32 * W)], [32], [W], [0])
    offs = gl.arange(0, NORM_BLOCK, layout=layout)
    mask = offs < n
    # the residual (the kernel before wrote it) and the weight asked for before the counter, so that the last tile
    # waits after it only for the row's sums: as written first (both after it, the weight after the reduction's
    # barrier) the norm lost, +0.22 ms at the 8B int4 b1 (thirty-first session; the main loop's SASS unchanged)
    r = gl.load(nres_ptr + offs, mask=mask, other=0.0)
    w = gl.load(nw_ptr + offs, mask=mask, other=0.0)
    barrier()  # the tile's stores before the counter's release
    if gl.atomic_add(nlock_ptr, 1, sem="acq_rel", scope="gpu") == gl.num_programs(0) - 1:
        ty: gl.constexpr = nout_ptr.dtype.element_ty
        y = gl.load(y_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")  # every tile's, from L2
        h = (y.to(gl.float32) + r.to(gl.float32)).to(ty)  # the sum stored in the row's dtype
        gl.store(nout_ptr + n + offs, h, mask=mask)
        h = h.to(gl.float32)
        rstd = gl.rsqrt(gl.sum(h * h, axis=0) / n + eps)
        gl.store(nout_ptr + offs, ((h * rstd).to(ty).to(gl.float32) * w.to(gl.float32)).to(ty), mask=mask)
        gl.atomic_xchg(nlock_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@gluon.jit
def store_sums(out_ptr, acc, out_off, out_mask, b_ptr, b_off, b_mask, pid_n, pid_k, stride_os, res_ptr, lock_ptr,
               HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr, SERIAL: gl.constexpr, n, nres_ptr, nw_ptr, nout_ptr,
               nlock_ptr, eps, NORM: gl.constexpr, NORM_BLOCK: gl.constexpr):  # fmt: skip
    """A split-K program's fp32 sums `acc` stored (quant_tiles.store_gemv_out's contract): with one split (+ bias)
    rounded once to out's dtype at out_off; with several, its partials in plane pid_k of [splits, M, N], and
    (SERIAL) the column tile's last program sums the planes in split order (+ bias) into res, loading
    quant_tiles.sum_loads planes at once, then zeroes its counter (lock_ptr[pid_n], zero between launches).
    NORM (one row of n, one split or SERIAL): then the residual add and norm of the row (norm_row)."""
    gl.static_assert(not NORM or SERIAL or not PARTIAL, "NORM: one split, or the serial sum")
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
                if NORM:
                    norm_row(res_ptr, n, nres_ptr, nw_ptr, nout_ptr, nlock_ptr, eps, NORM_BLOCK)
    else:
        if HAS_BIAS:
            acc += gl.load(b_ptr + b_off, mask=b_mask, other=0.0).to(gl.float32)
        gl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        if NORM:
            norm_row(out_ptr, n, nres_ptr, nw_ptr, nout_ptr, nlock_ptr, eps, NORM_BLOCK)


@gluon.jit
def silu_times(gate, up, ty: gl.constexpr):
    """silu(gate) * up in fp32 of gate and up (fp32 values of dtype ty), silu rounded to ty first as
    activation.silu_and_mul rounds it (F.silu's rounding); the caller rounds the product."""
    return (gate / (1.0 + gl.exp(-gate))).to(ty).to(gl.float32) * up
