"""The per-key-block steps of the Gluon attention kernel (gluon_attention.py, where the kernel, its partitions and
its launch are; gluon_extend.py runs them too): one block's online softmax, the turns between a split
tile's two warpgroups, and a key block's issue, softmax and waits (_kv_start, _kv_block; runs of blocks in one body:
_kv_run), with what ptxas makes of each in the sm90 SASS; and a tile's whole walk over its key blocks
(_key_blocks, then _last_pv), which both kernels run."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _softmax_step(qk, m_i, l_i, j, rows, num_keys, shift, qk_scale, causal, MASKED: gl.constexpr,
                  BLOCK_N: gl.constexpr, layout: gl.constexpr):  # fmt: skip
    """One key block's online softmax (base 2): (p in bf16, the new max, the new sum, the old sum's factor). The
    max is taken over the raw scores and scaled once a row (the scale is positive), so that each score's scale and
    shift is one FFMA: 61 fewer instructions a thread an iteration, 518 -> 457 on the unmasked path (sm90 SASS,
    `--compile-only`; FA3 folds it alike). p is rounded here, so that its fp32 values die before the P V in flight
    lands (at key tiles of 128 the compute partition spilled ~50 registers holding them)."""
    if MASKED:  # the block crosses the diagonal or the keys' end
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        # each row's last key: its diagonal when causal (a constant in the default partition, a value in a split
        # tile's worker, so no branch), else the keys' end
        last = gl.where(causal, rows + shift, num_keys - 1)
        keep = (cols[None, :] < num_keys) & (cols[None, :] <= last[:, None])
        qk = gl.where(keep, qk, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
    p = gl.exp2(qk * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p.to(gl.bfloat16), m_new, l_i * alpha + gl.sum(p, axis=1), alpha


@gluon.jit
def _my_turn(turn, slot, PART: gl.constexpr, PINGPONG: gl.constexpr):
    """FA3's ordering of a split tile's two consumer warpgroups (its warp-scheduler barrier, here a pair of
    mbarriers): each issue slot (S_0; S_j with P_{j-1} V_{j-1}; the last P V) waits for the other warpgroup's slot
    before it, so the tensor cores run one half's GEMMs while the other half's softmax runs, instead of both
    softmaxes at once. Warpgroup 0 goes first (a fresh barrier's parity-1 wait passes)."""
    if PINGPONG:
        mbarrier.wait(turn.index(PART), (slot & 1) ^ (1 - PART))


@gluon.jit
def _their_turn(turn, PART: gl.constexpr, PINGPONG: gl.constexpr):
    """This warpgroup's GEMMs of the slot are issued: the other's turn."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - PART), count=1)


@gluon.jit
def _kv_start(j, g0, slot0, q_tile, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, turn, p, m_i, l_i, alpha, acc,
              rows, num_keys, shift, qk_scale, causal, MASKED: gl.constexpr, IN_RUN: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PART: gl.constexpr,
              PINGPONG: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
              p_layout: gl.constexpr):  # fmt: skip
    """Key block j >= 1 up to its softmax: S_j issued, O rescaled for block j-1's max while it runs (FA3's place for
    it), P_{j-1} V_{j-1} issued; S_j's softmax while that runs (FA3's intra-warpgroup overlap), K_j's buffer freed.
    O comes back in flight: the caller waits for it. g0: the key blocks this program's ring carried before this tile
    (a persistent program runs several), slot0: its issue slots before it. IN_RUN (a block after the first of a run,
    _kv_run): P_{j-2} V_{j-2} is still in flight, and is waited for (V_{j-2}'s buffer freed) right after S_j's issue,
    where ptxas cannot move the wait up (a wait moved above S_j's commit would wait for less)."""
    g = g0 + j
    s = g % STAGES
    prev = (g - 1) % STAGES
    # both in before the turn: it is held to issue
    mbarrier.wait(k_ready.index(s), (g // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((g - 1) // STAGES) & 1)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    p_op = gl.convert_layout(p, p_layout)
    _my_turn(turn, slot0 + j, PART, PINGPONG)
    qk = warpgroup_mma(q_tile, k_bufs.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if IN_RUN:
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # P_{j-2} V_{j-2} done, S_j in flight
        mbarrier.arrive(v_free.index((g - 2) % STAGES), count=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    acc = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
    _their_turn(turn, PART, PINGPONG)
    qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk,))  # S_j done; P_{j-1} V_{j-1} may still run
    mbarrier.arrive(k_free.index(s), count=1)  # K_j read: the loader may bring K_{j+STAGES}
    p, m_i, l_i, alpha = _softmax_step(qk, m_i, l_i, j, rows, num_keys, shift, qk_scale, causal, MASKED, BLOCK_N,
                                       s_layout)  # fmt: skip
    return p, m_i, l_i, alpha, acc


@gluon.jit
def _kv_block(j, g0, slot0, q_tile, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, turn, p, m_i, l_i, alpha, acc,
              rows, num_keys, shift, qk_scale, causal, MASKED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, PART: gl.constexpr, PINGPONG: gl.constexpr, s_layout: gl.constexpr,
              o_layout: gl.constexpr, p_layout: gl.constexpr):  # fmt: skip
    """Key block j >= 1 (_kv_start), then P_{j-1} V_{j-1} waited for and V_{j-1}'s buffer freed.
    What ptxas makes of it (sm90 SASS, `--compile-only` with Triton 3.6; twenty-second session): P V's wait lands
    right after the row max's first shuffle, before the exponentials, whatever the source order (a wgmma wait may
    always move up across plain arithmetic), so the overlap is not in the machine code. Carrying P V's token into the
    next iteration (its wait after S_{j+1}'s issue, where it cannot move up) makes ptxas serialize every wgmma
    (C7514: it cannot follow a wgmma's registers across the loop's back edge), and so does a wait written as PTX
    predicated on the row sum (so that it could not move above the softmax). _kv_run takes the way that builds."""
    p, m_i, l_i, alpha, acc = _kv_start(j, g0, slot0, q_tile, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, turn,
                                        p, m_i, l_i, alpha, acc, rows, num_keys, shift, qk_scale, causal, MASKED,
                                        False, BLOCK_M, BLOCK_N, STAGES, PART, PINGPONG, s_layout, o_layout,
                                        p_layout)  # fmt: skip
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(v_free.index((g0 + j - 1) % STAGES), count=1)  # V_{j-1} read
    return p, m_i, l_i, alpha, acc


@gluon.jit
def _kv_run(j, g0, slot0, q_tile, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, turn, p, m_i, l_i, alpha, acc,
            rows, num_keys, shift, qk_scale, causal, RUN: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr, PART: gl.constexpr, PINGPONG: gl.constexpr, s_layout: gl.constexpr,
            o_layout: gl.constexpr, p_layout: gl.constexpr):  # fmt: skip
    """Key blocks j .. j + RUN - 1 (no mask) in one body: each block's P V is waited for only after the next block's
    S is issued (_kv_start's IN_RUN), where ptxas cannot hoist the wait above the softmax it is to overlap, so every block
    but the run's last has its softmax beside a P V in the machine code (_kv_block: none; RUN = 2 was `_kv_pair`:
    the first of each pair). Inside one body, so that ptxas follows the accumulator from its issue to its wait
    (across the loop's back edge it serialized every wgmma, C7514). Only P_{j-1} and P_j are live at once: the
    registers of RUN = 2 serve any RUN (the split tile's worker, at 240, spills 8-16 bytes at RUN = 2, 24 at 3).
    The sm90 SASS (Triton 3.6, `gluon_attention_check.py --compile-only`): RUN = 2 and 3 keep each S and P V as 8
    HGMMAs in flight with the waits where written, 1 and 2 of the run's softmaxes beside a P V; at RUN = 4 ptxas
    serializes every HGMMA of the kernel (a wait after each), so 3 is the longest run."""
    for i in gl.static_range(
        RUN
    ):  # blocks after the run's first: P V of the block before last still in flight
        p, m_i, l_i, alpha, acc = _kv_start(j + i, g0, slot0, q_tile, k_bufs, v_bufs, k_ready, v_ready, k_free,
                                            v_free, turn, p, m_i, l_i, alpha, acc, rows, num_keys, shift, qk_scale,
                                            causal, False, i > 0, BLOCK_M, BLOCK_N, STAGES, PART, PINGPONG, s_layout,
                                            o_layout, p_layout)  # fmt: skip
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(v_free.index((g0 + j + RUN - 2) % STAGES), count=1)  # V_{j+RUN-2} read
    return p, m_i, l_i, alpha, acc


@gluon.jit
def _key_blocks(q_tile, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, turn, g0, slot0, n_blocks, first_masked,
                m_i, l_i, acc, rows, num_keys, shift, qk_scale, causal, RUN: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PART: gl.constexpr, PINGPONG: gl.constexpr,
                s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):  # fmt: skip
    """A tile's n_blocks >= 1 key blocks (block j crosses the mask iff j >= first_masked): block 0's S and softmax
    (nothing in flight: the mask's branch is free here), then the blocks with no mask (in runs of RUN, then one at a
    time), then those with one, each its own loop: no block asks whether it needs the mask, and no branch sits in the
    window where P V is in flight. Returns (P_{n-1}, its alpha, O, m, l), P_{n-1} V_{n-1} not yet issued (_last_pv)."""
    s0 = g0 % STAGES
    mbarrier.wait(k_ready.index(s0), (g0 // STAGES) & 1)
    # use_acc=False ignores the accumulator's values: zeros made at each issue, not a tensor kept across loops
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    _my_turn(turn, slot0, PART, PINGPONG)
    qk = warpgroup_mma(q_tile, k_bufs.index(s0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    _their_turn(turn, PART, PINGPONG)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
    mbarrier.arrive(k_free.index(s0), count=1)  # K_0 read
    if first_masked == 0:
        p, m_i, l_i, alpha = _softmax_step(qk, m_i, l_i, 0, rows, num_keys, shift, qk_scale, causal, True, BLOCK_N,
                                           s_layout)  # fmt: skip
    else:
        p, m_i, l_i, alpha = _softmax_step(qk, m_i, l_i, 0, rows, num_keys, shift, qk_scale, causal, False, BLOCK_N,
                                           s_layout)  # fmt: skip
    n_free = gl.maximum(gl.minimum(first_masked, n_blocks), 1)  # blocks [1, n_free) have no mask
    runs_end = 1
    if RUN > 1:
        runs_end = 1 + (n_free - 1) // RUN * RUN
        for j in range(1, runs_end, RUN):
            p, m_i, l_i, alpha, acc = _kv_run(j, g0, slot0, q_tile, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free,
                                              turn, p, m_i, l_i, alpha, acc, rows, num_keys, shift, qk_scale, causal,
                                              RUN, BLOCK_M, BLOCK_N, STAGES, PART, PINGPONG, s_layout, o_layout,
                                              p_layout)  # fmt: skip
    for j in range(runs_end, n_free):
        p, m_i, l_i, alpha, acc = _kv_block(j, g0, slot0, q_tile, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free,
                                            turn, p, m_i, l_i, alpha, acc, rows, num_keys, shift, qk_scale, causal,
                                            False, BLOCK_M, BLOCK_N, STAGES, PART, PINGPONG, s_layout, o_layout,
                                            p_layout)  # fmt: skip
    for j in range(gl.maximum(first_masked, 1), n_blocks):
        p, m_i, l_i, alpha, acc = _kv_block(j, g0, slot0, q_tile, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free,
                                            turn, p, m_i, l_i, alpha, acc, rows, num_keys, shift, qk_scale, causal,
                                            True, BLOCK_M, BLOCK_N, STAGES, PART, PINGPONG, s_layout, o_layout,
                                            p_layout)  # fmt: skip
    return p, alpha, acc, m_i, l_i


@gluon.jit
def _last_pv(p, alpha, acc, v_bufs, v_ready, v_free, turn, g0, slot0, n_blocks, STAGES: gl.constexpr,
             PART: gl.constexpr, PINGPONG: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):  # fmt: skip
    """The tile's last P V (block n_blocks - 1's), waited for, its V buffer freed: O complete."""
    last = (g0 + n_blocks - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((g0 + n_blocks - 1) // STAGES) & 1)
    p_op = gl.convert_layout(p, p_layout)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    _my_turn(turn, slot0 + n_blocks, PART, PINGPONG)
    acc = warpgroup_mma(p_op, v_bufs.index(last), acc, is_async=True)
    _their_turn(turn, PART, PINGPONG)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(v_free.index(last), count=1)
    return acc
