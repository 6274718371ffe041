"""fp8_wgmma_gemv.py's kernel (Gluon: TMA ring + wgmma) and its activation tiles: the module docstring and the switches
it is launched with are there."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from longserve.kernels.gluon_compat import barrier, tma_load
from longserve.kernels.gluon_gemv import gdc_wait, silu_times, store_sums
from longserve.kernels.quant_reference import FP8_MAX

__all__ = ["fp8_wgmma_gemv_kernel"]

_E4M3_MAX = gl.constexpr(FP8_MAX)


@gluon.jit
def _tile_load(x_ptr, M, kb, stride_xm, up_off, BLOCK_T: gl.constexpr, BLOCK_K: gl.constexpr,
               x_layout: gl.constexpr, GATED: gl.constexpr):  # fmt: skip
    """Block kb of the activations as stored (rows past M: zeros), and (GATED) of up from column up_off (else 0.0):
    loads whose values nothing waits for until _tile_store."""
    rows = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, x_layout))
    cols = kb * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_layout))
    ptrs = x_ptr + rows.to(gl.int64)[:, None] * stride_xm + cols[None, :]
    x = gl.load(ptrs, mask=(rows < M)[:, None], other=0.0)
    up = 0.0
    if GATED:
        up = gl.load(ptrs + up_off, mask=(rows < M)[:, None], other=0.0)
    return x, up


@gluon.jit
def _tile_store(x, up, slot, scale_layout: gl.constexpr, GATED: gl.constexpr):
    """A block's activations (_tile_load's) quantized per row into `slot` (e4m3 [BLOCK_T, BLOCK_K], shared); the
    rows' scales in scale_layout (rows of zeros: scale 1e-10 / 448). GATED: the activations are silu(gate) * up,
    rounded as activation.silu_and_mul rounds them."""
    if GATED:
        ty: gl.constexpr = x.dtype
        x = silu_times(x.to(gl.float32), up.to(gl.float32), ty).to(ty)
    x = x.to(gl.float32)
    scale = gl.maximum(gl.max(gl.abs(x), axis=1), 1e-10) / _E4M3_MAX  # per_token_group_quant's
    xq = gl.minimum(gl.maximum(x / scale[:, None], -_E4M3_MAX), _E4M3_MAX)
    slot.store(xq.to(gl.float8e4nv))
    fence_async_shared()
    return gl.convert_layout(scale, scale_layout)


@gluon.jit
def _stored_tile(x_ptr, slot, M, kb, stride_xm, BLOCK_T: gl.constexpr, BLOCK_K: gl.constexpr,
                 x_layout: gl.constexpr):  # fmt: skip
    """Block kb of activations quantized already (e4m3 bytes, per token) into `slot` (rows past M: zeros)."""
    rows = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, x_layout))
    cols = kb * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_layout))
    xq = gl.load(
        x_ptr + rows.to(gl.int64)[:, None] * stride_xm + cols[None, :], mask=(rows < M)[:, None], other=0
    )
    slot.store(xq.to(gl.float8e4nv, bitcast=True))
    fence_async_shared()


@gluon.jit
def _activation_block(x_ptr, slot, M, kb, stride_xm, up_off, PER_CHANNEL: gl.constexpr, BLOCK_T: gl.constexpr,
                      BLOCK_K: gl.constexpr, x_layout: gl.constexpr, scale_layout: gl.constexpr,
                      GATED: gl.constexpr):  # fmt: skip
    """Block kb of the activations into `slot` as wgmma's B: quantized here per row (block FP8: the rows' scales
    returned; GATED: of silu(gate) * up), or (PER_CHANNEL) as given (scales of 1: the tokens' multiply the sums at
    the end)."""
    if PER_CHANNEL:
        _stored_tile(x_ptr, slot, M, kb, stride_xm, BLOCK_T, BLOCK_K, x_layout)
        scale = gl.full([BLOCK_T], 1.0, gl.float32, scale_layout)
    else:
        x, up = _tile_load(x_ptr, M, kb, stride_xm, up_off, BLOCK_T, BLOCK_K, x_layout, GATED)
        scale = _tile_store(x, up, slot, scale_layout, GATED)
    return scale


@gluon.jit
def fp8_wgmma_gemv_kernel(
    w_desc,  # TMA over the weights [N, K] e4m3, boxes [BLOCK_N, BLOCK_K]
    x_ptr,  # [M, K] bf16 (GATED: gate|up [M, 2K]), or (PER_CHANNEL) e4m3 quantized per token, as uint8
    xs_ptr,  # PER_CHANNEL: [M] float32 activation scales (per token, or one per tensor repeated)
    s_ptr,  # float32 weight scales: [ceil(N / BLOCK_N), K / BLOCK_K] blocks, or (PER_CHANNEL) [N]
    b_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N] bf16, or (PARTIAL) [splits, M, N] float32
    res_ptr,  # SERIAL: [M, N] bf16, the partials' sum
    lock_ptr,  # SERIAL: int32 counters, one per column tile, zero
    ids_ptr,  # ROUTED: [P] int32, each output row's expert
    M, N, blocks_per_split, num_blocks, stride_xm, stride_sn, stride_os, stride_om, stride_se,
    nres_ptr, nw_ptr, nout_ptr, nlock_ptr, eps,  # NORM: gluon_gemv.norm_row's (else placeholders)
    HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr, SERIAL: gl.constexpr, BLOCK_T: gl.constexpr,
    STAGES: gl.constexpr, IMPRECISE_ACC: gl.constexpr, USE_PDL: gl.constexpr, PER_CHANNEL: gl.constexpr,
    num_warps: gl.constexpr, ROUTED: gl.constexpr = False, X_ROW_DIV: gl.constexpr = 1, GATED: gl.constexpr = False,
    AHEAD: gl.constexpr = False, NORM: gl.constexpr = False, NORM_BLOCK: gl.constexpr = 1,
):  # fmt: skip
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_T, 32]
    )
    x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])  # 16-byte loads
    x_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_T, BLOCK_K], gl.float8e4nv)
    token_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    pid_n, pid_k = gl.program_id(0), gl.program_id(1)
    n0 = pid_n * BLOCK_N
    w_row0 = n0  # the program's first weight row in the descriptor's rows
    # MoE decode: axis 2 over (token, k) pairs, one row each, the pair's expert's weights [E x N, K]
    if ROUTED:
        gdc_wait(USE_PDL)  # the expert id is the router's output: no weight read before it
        pair = gl.program_id(2).to(gl.int64)
        expert = gl.load(ids_ptr + pair)
        w_row0 = expert * N + n0
        s_ptr += expert.to(gl.int64) * stride_se
        x_ptr += (pair // X_ROW_DIV) * stride_xm
        out_ptr += pair * stride_om
    kb0 = pid_k * blocks_per_split
    n_blocks = gl.minimum(blocks_per_split, num_blocks - kb0)
    up_off = num_blocks * BLOCK_K  # GATED: up's first column in gate|up

    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    x_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_T, BLOCK_K], x_smem_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    # the first STAGES weight tiles asked for before waiting on the kernel before (the weights are not its output)
    for i in gl.static_range(STAGES):
        if i < n_blocks:
            mbarrier.expect(ready.index(i), w_desc.block_type.nbytes)
            tma_load(w_desc, [w_row0, (kb0 + i) * BLOCK_K], ready.index(i), w_bufs.index(i))
    gl.static_assert(not (AHEAD and PER_CHANNEL), "AHEAD: block FP8")
    # block FP8: the row block's weight scales of the split's blocks
    scales_row = s_ptr + pid_n * stride_sn + kb0
    if AHEAD and not ROUTED:  # the first block's weight scale, read by no kernel before
        ws_next = gl.load(scales_row)
    if not ROUTED:
        gdc_wait(USE_PDL)

    x_scale = _activation_block(x_ptr, x_bufs.index(0), M, kb0, stride_xm, up_off, PER_CHANNEL, BLOCK_T, BLOCK_K,
                                x_layout, token_layout, GATED)  # fmt: skip
    if AHEAD:  # the second block's activations in flight (the last one's when there is one block)
        x_next, up_next = _tile_load(x_ptr, M, kb0 + gl.minimum(1, n_blocks - 1), stride_xm, up_off, BLOCK_T,
                                     BLOCK_K, x_layout, GATED)  # fmt: skip
        if ROUTED:
            ws_next = gl.load(scales_row)
    barrier()  # every warp's activations in shared memory before the wgmma reads them
    zero = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, acc_layout)
    acc = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, acc_layout)
    for j in range(0, n_blocks):
        s = j % STAGES
        # AHEAD: block j + 1's activations and block j's weight scale from the turn before; the next ones asked for
        if AHEAD:
            x_cur, up_cur, w_scale = x_next, up_next, ws_next
            x_next, up_next = _tile_load(x_ptr, M, kb0 + gl.minimum(j + 2, n_blocks - 1), stride_xm, up_off,
                                         BLOCK_T, BLOCK_K, x_layout, GATED)  # fmt: skip
            ws_next = gl.load(scales_row + gl.minimum(j + 1, n_blocks - 1))
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        part = warpgroup_mma(w_bufs.index(s), x_bufs.index(j % 2).permute((1, 0)), zero, use_acc=False,
                             max_num_imprecise_acc=IMPRECISE_ACC, is_async=True)  # fmt: skip
        # the next block's activations into the other slot while this block's products run
        next_scale = x_scale
        if j + 1 < n_blocks:
            if AHEAD:
                next_scale = _tile_store(x_cur, up_cur, x_bufs.index((j + 1) % 2), token_layout, GATED)
            else:
                next_scale = _activation_block(x_ptr, x_bufs.index((j + 1) % 2), M, kb0 + j + 1, stride_xm, up_off,
                                               PER_CHANNEL, BLOCK_T, BLOCK_K, x_layout, token_layout,
                                               GATED)  # fmt: skip
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
        if PER_CHANNEL:  # both scales after the loop
            acc += part
        else:
            if not AHEAD:
                w_scale = gl.load(scales_row + j)
            acc += part * (w_scale * x_scale)[None, :]
        x_scale = next_scale
        barrier()  # every warp past its wait: stage s and slot j % 2 are read; the next slot is stored
        if j + STAGES < n_blocks:  # stage s refilled STAGES blocks ahead
            mbarrier.expect(ready.index(s), w_desc.block_type.nbytes)
            tma_load(w_desc, [w_row0, (kb0 + j + STAGES) * BLOCK_K], ready.index(s), w_bufs.index(s))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    tokens = gl.arange(0, BLOCK_T, layout=token_layout)
    if PER_CHANNEL:  # sum_k xq w * x_scale * w_scale, as scaled_gemm_ref
        xs = gl.load(xs_ptr + tokens, mask=tokens < M, other=0.0)
        ws = gl.load(s_ptr + rows, mask=rows < N, other=0.0)
        acc = acc * xs[None, :] * ws[:, None]
    out_off = tokens[None, :] * stride_om + rows[:, None]
    out_mask = (tokens < M)[None, :] & (rows < N)[:, None]
    # NORM (one row): then the row's residual add and norm by the last tile to store (gluon_gemv.norm_row)
    gl.static_assert(not NORM or not ROUTED, "NORM: not routed")
    store_sums(out_ptr, acc, out_off, out_mask, b_ptr, rows[:, None], (rows < N)[:, None], pid_n, pid_k,
               stride_os, res_ptr, lock_ptr, HAS_BIAS, PARTIAL, SERIAL, N, nres_ptr, nw_ptr, nout_ptr, nlock_ptr, eps,
               NORM, NORM_BLOCK)  # fmt: skip
