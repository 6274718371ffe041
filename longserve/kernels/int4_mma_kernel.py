"""int4_mma_gemv.py's kernel (Gluon, mma.sync): the module docstring and the switches it is launched with are there,
its steps' pieces in int4_mma_steps.py, the PTX and lane mapping in int4_mma_ptx.py."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from longserve.kernels.gluon_compat import barrier, reinterpret
from longserve.kernels.gluon_gemv import axis, gdc_wait, prefetch_l2, store_sums
from longserve.kernels.int4_mma_ptx import lane_layout
from longserve.kernels.int4_mma_steps import (
    gated_loads,
    gated_start,
    gated_steps,
    gated_store,
    group_scales,
    prefetch_pieces,
    ring_load,
    ring_start,
    ring_wait,
    ring_words,
    step_loads,
    step_sums,
)

__all__ = ["int4_mma_gemv_kernel"]


@gluon.jit
def int4_mma_gemv_kernel(
    w_desc,  # STAGES: TMA over the words as int32 [rows, K / 8] (routed: the experts' rows one after another),
    # boxes [BLOCK_N, 16 STAGE_STEPS]; else None
    x_ptr,  # [M, K] bf16 viewed as int32 [M, K / 2] (natural pairs); GATED: gate|up [1, 2K] as [1, K]
    w_ptr,  # [N, K / 8] int32: the packed uint8 [N, K / 2] as words
    s_ptr,  # [N, G]
    z_ptr,  # [N, G] uint8 (HAS_ZP)
    b_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N] bf16, or (PARTIAL) [splits, M, N] float32
    res_ptr,  # SERIAL: [M, N] bf16, the partials' sum
    lock_ptr,  # SERIAL: int32 counters, one per column tile, zero
    ids_ptr,  # ROUTED: [P] int32, each output row's expert
    M, N, steps_per_split, num_steps, stride_xm, stride_wn, stride_sn, stride_zn, stride_os, stride_om,
    stride_we, stride_se, stride_ze, row_blocks, up_off,
    nres_ptr, nw_ptr, nout_ptr, nlock_ptr, eps,  # NORM: gluon_gemv.norm_row's (else placeholders)
    HAS_ZP: gl.constexpr, HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr, SERIAL: gl.constexpr, EVEN_N: gl.constexpr,
    GROUP_SHIFT: gl.constexpr, REPS: gl.constexpr, STAGES: gl.constexpr, USE_PDL: gl.constexpr,
    ROUTED: gl.constexpr = False, X_ROW_DIV: gl.constexpr = 1, TOKEN_TILES: gl.constexpr = 1,
    PREFETCH: gl.constexpr = 0, UNROLL: gl.constexpr = 1, GATED: gl.constexpr = False, AHEAD: gl.constexpr = False,
    NORM: gl.constexpr = False, NORM_BLOCK: gl.constexpr = 1,
):  # fmt: skip
    W: gl.constexpr = gl.num_warps()
    # [tile r, lane row (warp w, g), lane t, element u]: lanes (g, t) as mma's groupID / threadID_in_group
    L: gl.constexpr = gl.BlockedLayout([REPS, 1, 1, 4], [1, 8, 4, 1], [1, W, 1, 1], [3, 2, 1, 0])
    LX: gl.constexpr = gl.BlockedLayout([1, 1, 1, 16], [1, 8, 4, 1], [1, W, 1, 1], [3, 2, 1, 0])
    LS: gl.constexpr = gl.BlockedLayout([REPS, 1, 1, 2], [1, 8, 4, 1], [1, W, 1, 1], [3, 2, 1, 0])
    gl.static_assert(gl.to_linear_layout(L, [REPS, 8 * W, 4, 4]) == lane_layout(REPS, W), "lanes as mma's")
    BLOCK_N: gl.constexpr = 16 * W * REPS
    # axis 0: column tiles x row_blocks blocks of BLOCK_ROWS rows (17 to MAX_ROWS rows), a tile's blocks adjacent
    # (their programs read the same words at about the same time: once from HBM, then from L2)
    pid_n, pid_k = gl.program_id(0) // row_blocks, gl.program_id(1)
    # a tile's A rows g and g + 8 are the program's columns r 8W + 8w + g and that + HALF (a TMA slot's rows in two
    # halves, each in the lanes' order: ring_words)
    HALF: gl.constexpr = BLOCK_N // 2
    col = pid_n * BLOCK_N + axis(REPS, 0, L) * (8 * W) + axis(8 * W, 1, L)  # [REPS, 8W, 1, 1]: A's row g
    s_begin = pid_k * steps_per_split
    s_end = gl.minimum(s_begin + steps_per_split, num_steps)
    row0_w = pid_n * BLOCK_N  # STAGES: the program's first row in the descriptor's
    if STAGES > 0 and not ROUTED:  # the first steps' words asked for while the kernel before drains
        ring, ready = ring_start(w_desc, row0_w, s_begin, s_end - s_begin, REPS, W, STAGES)
    if PREFETCH > 0:  # the pieces' offsets from the weights (a routed program's expert's, after the wait)
        pf_a, pf_b = prefetch_pieces(pid_n, N, stride_wn, REPS, W)
        if not ROUTED:  # the first steps' words into L2 while the kernel before drains
            for j in gl.static_range(PREFETCH):
                prefetch_l2(w_ptr + (pf_a + gl.minimum(s_begin + j, s_end - 1) * 16))
                prefetch_l2(w_ptr + (pf_b + gl.minimum(s_begin + j, s_end - 1) * 16))
    # the epilogue's element u is C's register: column col + HALF (u >> 1), token 2t + (u & 1)
    col_s = pid_n * BLOCK_N + axis(REPS, 0, LS) * (8 * W) + axis(8 * W, 1, LS) + HALF * axis(2, 3, LS)
    if AHEAD and not ROUTED:  # the first step's scales too, read by no kernel before
        s_next, z_next = group_scales(s_ptr, col_s, stride_sn, z_ptr, stride_zn, N, s_begin, GROUP_SHIFT, EVEN_N,
                                      HAS_ZP)  # fmt: skip
    gdc_wait(USE_PDL)  # before the routed expert id (the router's output) and x
    if ROUTED:  # MoE decode (moe_wna16.py): axis 2 over (token, k) pairs, M = 1, each pair's expert's weights
        pair = gl.program_id(2).to(gl.int64)
        expert = gl.load(ids_ptr + pair).to(gl.int64)
        if STAGES > 0:  # the descriptor's rows: expert e's N rows from e N
            row0_w = (expert * N + row0_w).to(gl.int32)
            ring, ready = ring_start(w_desc, row0_w, s_begin, s_end - s_begin, REPS, W, STAGES)
        w_ptr += expert * stride_we
        s_ptr += expert * stride_se
        z_ptr += expert * stride_ze
        x_ptr += (pair // X_ROW_DIV) * stride_xm
        out_ptr += pair * stride_om
    else:  # this program's block of rows
        row0 = (gl.program_id(0) % row_blocks) * (8 * TOKEN_TILES)  # BLOCK_ROWS when row_blocks > 1
        x_ptr += row0.to(gl.int64) * stride_xm
        out_ptr += row0.to(gl.int64) * stride_om
        res_ptr += row0.to(gl.int64) * stride_om
        M -= row0
    words_a = w_ptr + col.to(gl.int64) * stride_wn + 4 * axis(4, 2, L) + axis(4, 3, L)  # words 4t + u
    words_b = words_a + HALF * stride_wn
    # token g's 64 bytes of the step (words 4t .. 4t + 3); rows past M read row M - 1 (their sums are not stored);
    # TOKEN_TILES 2: B's second tile, tokens 8 + g, through the same A fragments
    x_words = 16 * axis(4, 2, LX) + axis(16, 3, LX)
    xs = x_ptr + gl.minimum(axis(8 * W, 1, LX) % 8, M - 1) * stride_xm + x_words  # [1, 8W, 4, 16]
    xs2 = x_ptr + gl.minimum(axis(8 * W, 1, LX) % 8 + 8, M - 1) * stride_xm + x_words
    acc = gl.zeros([REPS, 8 * W, 4, 4], gl.float32, L)
    acc2 = gl.zeros([REPS, 8 * W, 4, 4], gl.float32, L)  # TOKEN_TILES 2
    zero = gl.zeros([REPS, 8 * W, 4, 4], gl.float32, L)
    zero_x = gl.zeros([1, 8 * W, 4, 4], gl.float32, L)
    gl.static_assert(UNROLL == 1 or STAGES == 0, "UNROLL with loads into registers")
    if STAGES > 0:  # the words from the ring, S steps a slot
        S: gl.constexpr = w_desc.block_type.shape[1] // 16
        # GATED (one row): x = silu(gate) * up made a slot ahead into shared memory, read back as x would be
        gl.static_assert(not GATED or (TOKEN_TILES == 1 and not ROUTED), "GATED: one row, not routed")
        if GATED:
            xbuf = gated_start(W, S)
            barrier()  # the zeros (stored across warps) before a warp's own rows
            gated_steps(xbuf, x_ptr, up_off, s_begin, s_end, 0, W, S)
            barrier()
            XL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
        # AHEAD: the first step's x (GATED: the second step's gate and up; routed: the scales) here; each turn asks
        # for the next step's (GATED: the step after's) before it waits for its own slot, and sums with what the
        # turn before asked for
        gl.static_assert(not AHEAD or (S == 1 and TOKEN_TILES == 1), "AHEAD: one step a slot, one token tile")
        if AHEAD:
            if GATED:
                g_next, u_next = gated_loads(x_ptr, up_off, gl.minimum(s_begin + 1, s_end - 1), W)
            else:
                xt_next = gl.load(xs + s_begin * 64)
            if ROUTED:  # the expert's, known after the wait
                s_next, z_next = group_scales(s_ptr, col_s, stride_sn, z_ptr, stride_zn, N, s_begin, GROUP_SHIFT,
                                              EVEN_N, HAS_ZP)  # fmt: skip
        for j in range(0, gl.cdiv(s_end - s_begin, S)):
            if AHEAD:  # this step's from the turn before; the next one's (clamped at the end) in flight past the wait
                s2, z2 = s_next, z_next
                ahead = gl.minimum(s_begin + j + 1, s_end - 1)
                # GATED: the next slot's gate and up, stored after this step's sums; the step after's asked for
                if GATED:
                    g_cur, u_cur = g_next, u_next
                    g_next, u_next = gated_loads(x_ptr, up_off, gl.minimum(s_begin + j + 2, s_end - 1), W)
                else:
                    xt = xt_next
                    xt_next = gl.load(xs + ahead * 64)
                s_next, z_next = group_scales(s_ptr, col_s, stride_sn, z_ptr, stride_zn, N, ahead, GROUP_SHIFT,
                                              EVEN_N, HAS_ZP)  # fmt: skip
            ring_wait(ready, j, STAGES)
            for sub in gl.static_range(S):
                wa, wb = ring_words(ring, j % STAGES, sub, L, REPS, W)
                step = s_begin + j * S + sub
                keep = 1.0
                # past the split's last step (2 steps a slot) the step's words and x count nothing (clamped, weight 0)
                if S > 1:
                    keep = (step < s_end).to(gl.float32)
                    step = gl.minimum(step, s_end - 1)
                if GATED:
                    xt = reinterpret(xbuf.index((j % 2) * S + sub), gl.int32, [1, 8 * W, 4, 16], XL).load(LX)
                elif not AHEAD:
                    xt = gl.load(xs + step * 64)
                if not AHEAD:
                    s2, z2 = group_scales(s_ptr, col_s, stride_sn, z_ptr, stride_zn, N, step, GROUP_SHIFT, EVEN_N,
                                          HAS_ZP)  # fmt: skip
                acc, acc2 = step_sums(acc, acc2, wa, wb, xt, xs2, step, zero, zero_x, s2, z2, L, REPS, W, HAS_ZP,
                                      TOKEN_TILES, keep)  # fmt: skip
            # GATED: the next slot's activations (its buffer last read a slot ago, before the last barrier)
            if GATED:
                if AHEAD:
                    gated_store(xbuf, g_cur, u_cur, (j + 1) % 2, W)
                else:
                    gated_steps(xbuf, x_ptr, up_off, s_begin + (j + 1) * S, s_end, (j + 1) % 2, W, S)
            barrier()  # every warp past the slot's words: it is refilled STAGES slots ahead
            if (j + STAGES) * S < s_end - s_begin:
                ring_load(w_desc, ring, ready, row0_w, s_begin + (j + STAGES) * S, j % STAGES)
    else:  # the words by address
        for step in range(s_begin, s_end, UNROLL):
            wa, wb, xt = step_loads(words_a, words_b, xs, col, N, step, EVEN_N, HALF)
            s2, z2 = group_scales(
                s_ptr, col_s, stride_sn, z_ptr, stride_zn, N, step, GROUP_SHIFT, EVEN_N, HAS_ZP
            )
            if PREFETCH > 0:  # step + PREFETCH's words into L2: bytes in flight that hold no register
                prefetch_l2(w_ptr + (pf_a + gl.minimum(step + PREFETCH, s_end - 1) * 16))
                prefetch_l2(w_ptr + (pf_b + gl.minimum(step + PREFETCH, s_end - 1) * 16))
            # UNROLL 2: the next step's loads issued before this step's products (its words clamped at the end)
            if UNROLL == 2:
                nxt = gl.minimum(step + 1, s_end - 1)
                wa2, wb2, xt2 = step_loads(words_a, words_b, xs, col, N, nxt, EVEN_N, HALF)
            acc, acc2 = step_sums(acc, acc2, wa, wb, xt, xs2, step, zero, zero_x, s2, z2, L, REPS, W, HAS_ZP,
                                  TOKEN_TILES)  # fmt: skip
            if UNROLL == 2:
                # past the split's last step the clamped words count nothing (their scale times 0)
                keep = (step + 1 < s_end).to(gl.float32)
                s2, z2 = group_scales(
                    s_ptr, col_s, stride_sn, z_ptr, stride_zn, N, nxt, GROUP_SHIFT, EVEN_N, HAS_ZP
                )
                acc, acc2 = step_sums(acc, acc2, wa2, wb2, xt2, xs2, nxt, zero, zero_x, s2, z2, L, REPS, W, HAS_ZP,
                                      TOKEN_TILES, keep)  # fmt: skip
    if STAGES > 0:
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
    col_c = col + HALF * (axis(4, 3, L) >> 1) + 0 * axis(4, 2, L)  # [REPS, 8W, 4, 4]
    token = 2 * axis(4, 2, L) + (axis(4, 3, L) & 1) + 0 * col  # [REPS, 8W, 4, 4]
    if TOKEN_TILES == 2:  # both tiles in one store (one arrival at a serial sum's counter)
        acc = gl.join(acc, acc2)
        col_c = gl.join(col_c, col_c)
        token = gl.join(token, token + 8)
    # a serial sum's counter per program column (column tile and row block)
    # NORM (one row): then the row's residual add and norm by the last tile to store (gluon_gemv.norm_row)
    gl.static_assert(not NORM or (TOKEN_TILES == 1 and not ROUTED), "NORM: one row, not routed")
    store_sums(out_ptr, acc, token * stride_om + col_c, (col_c < N) & (token < M), b_ptr, col_c, col_c < N,
               gl.program_id(0), pid_k, stride_os, res_ptr, lock_ptr, HAS_BIAS, PARTIAL, SERIAL, N, nres_ptr, nw_ptr,
               nout_ptr, nlock_ptr, eps, NORM, NORM_BLOCK)  # fmt: skip
