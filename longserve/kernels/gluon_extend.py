"""A paged extend kernel in Gluon: a short chunk of new tokens over a long cached prefix (issue 19's prefix hit, 64
new over 32K, and the 1024-new case), the shape where the Triton extend kernel runs at ~180-240 TFLOP/s (RESULTS.md
fifteenth session: Triton waits for every wgmma, and gathers K/V by pointer). The engine runs it in the Triton
kernel's place when `attention.gluon_calls.GLUON_EXTEND_CALLS` is on: off until measured on the GPU (written in the
twenty-third session, built for sm90 with Triton 3.6 and 3.9, its work split checked in torch). The prefix kernel's
structure (gluon_attention.py: TMA, a 1-warp loader, two consumer warpgroups, asynchronous wgmma with the softmax
beside P V) on the paged cache and the packed rows.

`_extend_kernel`'s work, in its split form (kernels/extend_attention.py): a program owns 128 packed rows (token,
q head of one kv head: the q heads that share a kv head share its K/V) of one request and one key range (split-K),
and writes fp32 partials and base-2 log-sum-exps that `merge_splits` merges. Here:
- the loader brings each key block of 128 as 16-row boxes by TMA, one a run of consecutive cache slots within a
  page (page sizes that are multiples of 16), the page read from the page table (slots past the request's last
  page read its last page). The mask drops the keys past the request's end; their V rows would still enter P V
  times P = 0, and a non-finite value an earlier owner of the page left there would give NaN (the Triton kernel
  masks those loads), so the first consumer zeroes them in the request's last block before it is ready;
- each consumer warpgroup owns 64 of the rows: it loads its Q by pointer (a packed row's head varies within the
  tile, which one TMA box cannot follow), stores it to shared memory, then runs the prefix kernel's key-block
  steps (gluon_attention_steps: `_kv_block`, `_kv_run`) over the split's blocks, its masks bottom-right per token
  (a row's last key is prefix_len + its token) and at the request's end;
- the running max starts finite (-1e30), as in `_extend_kernel`: a split may hold no key a row can see (its
  partial then weighs nothing in the merge).
The descriptors span a layer's whole cache (fixed per layer), the lengths and page table are read on the device:
a launch can be captured in a CUDA graph as the Triton kernel's is.

Its torch reference is `extend_attention_ref` (kernels/attention_reference.py), as for the Triton kernel.

    PYTHONPATH=$PWD python3 scripts/probes/gluon_extend_check.py                  # on an H200, against Triton
    PYTHONPATH=/path/to/triton-3.6:$PWD python3 scripts/probes/gluon_extend_check.py --compile-only
    PYTHONPATH=$PWD python3 scripts/probes/gluon_extend_check.py --emulate        # the work split, in torch
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from longserve.kernels.extend_attention import merge_splits
from longserve.kernels.gluon_attention_steps import _key_blocks, _last_pv
from longserve.kernels.gluon_compat import barrier, tma_load

D = 128
TILE_M, PART_M, BLOCK_N, STAGES, KEY_BOX = 128, 64, 128, 2, 16
LOAD_REGS, COMPUTE_REGS = gl.constexpr(24), gl.constexpr(240)
RUN = gl.constexpr(2)  # unmasked key blocks a loop body (_kv_run), as the prefix kernel's default
LOG2E = 1.4426950408889634
# Triton 3.6 hands a worker partition its arguments as runtime values, constexprs included: the workers take the
# tile shape from these (the launch asserts the same)
_PART_M = gl.constexpr(PART_M)
_BLOCK_N = gl.constexpr(BLOCK_N)
_STAGES = gl.constexpr(STAGES)
_HEAD_DIM = gl.constexpr(D)
_KEY_BOX = gl.constexpr(KEY_BOX)
_Q_LAYOUT = gl.constexpr(gl.NVMMASharedLayout.get_default_for([PART_M, D], gl.bfloat16))
_KV_LAYOUT = gl.constexpr(gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16))


@gluon.jit
def _issue_kv(desc, bufs, bar, free, g, key0, pt_row, page_size, last_slot, kv_col, STAGES: gl.constexpr,
              BLOCK_N: gl.constexpr, KEY_BOX: gl.constexpr):  # fmt: skip
    """Block g of the ring (keys key0..key0 + BLOCK_N) into its stage once the consumers have freed it, landing on
    `bar` (its stage's ready barrier; for the request's last V block `land`, which `_zero_past_end` waits on):
    BLOCK_N / KEY_BOX boxes, each KEY_BOX consecutive slots of one page."""
    s = g % STAGES
    mbarrier.wait(free.index(s), ((g // STAGES) & 1) ^ 1)
    mbarrier.expect(bar, BLOCK_N * desc.block_type.shape[1] * 2)
    for i in gl.static_range(BLOCK_N // KEY_BOX):
        key = key0 + i * KEY_BOX
        slot = gl.minimum(key // page_size, last_slot)
        page = gl.load(pt_row + slot)
        tma_load(desc, [page * page_size + key % page_size, kv_col], bar,
                 bufs.index(s).slice(i * KEY_BOX, KEY_BOX))  # fmt: skip


@gluon.jit
def _zero_past_end(bufs, ready, land, g, key0, seq_len, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                   num_warps: gl.constexpr):  # fmt: skip
    """The first consumer warpgroup, between its last softmax and the last P V: the request's last V block landed
    (`land`, phase 0: one such block a program, the split's last, as its keys end at the request's), its rows past
    seq_len zeroed (the last page's stale slots, or the page's slots again where a box lies wholly past it), then
    the block is ready for both consumers. P is 0 there, but 0 x NaN is NaN: a slot an earlier owner of the page
    left non-finite would reach the output (the Triton kernel masks these loads). Groups of 8 rows and 64 columns:
    the V buffer's swizzle allows no finer slice."""
    # 8 x 64, 4 values a thread
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])
    buf = bufs.index(g % STAGES)
    mbarrier.wait(land, 0)
    for i in gl.static_range(BLOCK_N // 8):
        if key0 + (i + 1) * 8 > seq_len:
            keys = key0 + i * 8 + gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
            for c in gl.static_range(2):  # the buffer's two 64-column halves
                part = buf.slice(i * 8, 8).slice(c * 64, 64, dim=1)
                x = part.load(layout)
                part.store(gl.where((keys < seq_len)[:, None], x, gl.zeros_like(x)))
    fence_async_shared()  # the stores before either warpgroup's wgmma reads them (the async proxy)
    barrier()  # every warp's stores in before the arrive
    mbarrier.arrive(ready.index(g % STAGES), count=1)  # no bytes expected: the phase completes here


@gluon.jit
def _extend_loader(q_ptr, k_desc, v_desc, o_ptr, lse_ptr, page_table_ptr, q_smem, k_bufs, v_bufs, k_ready, v_ready,
                   k_free, v_free, land, stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_pt, page_size,
                   qk_scale, num_splits, num_q_heads, group, req, kv_head, split, q_start, num_rows, prefix_len,
                   seq_len, row0, s_lo, n_blocks):  # fmt: skip
    """K one block ahead of V, each into a buffer freed on its own barrier (the prefix kernel's order); V's block
    holding the request's end onto `land` (the steps' `turn` slot, unused there)."""
    pt_row = page_table_ptr + req.to(gl.int64) * stride_pt
    last_slot = (seq_len - 1) // page_size
    kv_col = kv_head * _HEAD_DIM
    if n_blocks > 0:
        _issue_kv(k_desc, k_bufs, k_ready.index(0), k_free, 0, s_lo, pt_row, page_size, last_slot, kv_col, _STAGES,
                  _BLOCK_N, _KEY_BOX)  # fmt: skip
    for j in range(n_blocks):
        if j + 1 < n_blocks:
            _issue_kv(k_desc, k_bufs, k_ready.index((j + 1) % _STAGES), k_free, j + 1, s_lo + (j + 1) * _BLOCK_N,
                      pt_row, page_size, last_slot, kv_col, _STAGES, _BLOCK_N, _KEY_BOX)  # fmt: skip
        key0 = s_lo + j * _BLOCK_N
        # the split's last block holding the request's end: the consumers' test (_extend_consumer), to the letter
        if (j == n_blocks - 1) & (s_lo + n_blocks * _BLOCK_N > seq_len):
            _issue_kv(v_desc, v_bufs, land, v_free, j, key0, pt_row, page_size, last_slot, kv_col, _STAGES, _BLOCK_N,
                      _KEY_BOX)  # fmt: skip
        else:
            _issue_kv(v_desc, v_bufs, v_ready.index(j % _STAGES), v_free, j, key0, pt_row, page_size, last_slot,
                      kv_col, _STAGES, _BLOCK_N, _KEY_BOX)  # fmt: skip


@gluon.jit
def _extend_consumer(q_ptr, k_desc, v_desc, o_ptr, lse_ptr, page_table_ptr, q_smem, k_bufs, v_bufs, k_ready, v_ready,
                     k_free, v_free, turn, stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_pt,
                     page_size, qk_scale, num_splits, num_q_heads, group, req, kv_head, split, q_start, num_rows,
                     prefix_len, seq_len, row0, s_lo, n_blocks, PART: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                     num_warps: gl.constexpr):  # fmt: skip
    """Rows row0 + PART * BLOCK_M.. of the tile over the split's key blocks; its fp32 partial and base-2 LSE."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    r0 = row0 + PART * BLOCK_M
    # Q: packed row r is token r // group, q head kv_head * group + r % group
    qr = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_blocked))
    qd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_blocked))
    q_offs = ((q_start + qr // group).to(gl.int64) * stride_qt + (kv_head * group + qr % group) * stride_qh)[
        :, None
    ]
    q = gl.load(q_ptr + q_offs + qd[None, :], mask=(qr < num_rows)[:, None], other=0.0)
    q_tile = q_smem.index(PART)
    q_tile.store(q)
    fence_async_shared()
    barrier()  # every warp's rows in before the wgmma reads them

    rows = (r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))) // group  # each row's token
    # keys relative to the split's first: a row's last key prefix_len + token, the request's end seq_len
    shift = prefix_len - s_lo
    num_keys = seq_len - s_lo
    m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, gl.SliceLayout(1, s_layout))  # finite: a row may see no key
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    if n_blocks > 0:
        # blocks from first_masked on cross this part's first token's diagonal or the request's end
        first_masked = gl.maximum(gl.minimum(num_keys, shift + r0 // group + 1), 0) // BLOCK_N
        p, alpha, acc, m_i, l_i = _key_blocks(q_tile, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, turn, 0, 0,
                                              n_blocks, first_masked, m_i, l_i, acc, rows, num_keys, shift, qk_scale,
                                              True, RUN, BLOCK_M, BLOCK_N, STAGES, PART, False, s_layout, o_layout,
                                              p_layout)  # fmt: skip
        if PART == 0 and s_lo + n_blocks * BLOCK_N > seq_len:  # the last block holds the request's end
            _zero_past_end(v_bufs, v_ready, turn, n_blocks - 1, s_lo + (n_blocks - 1) * BLOCK_N, seq_len, STAGES,
                           BLOCK_N, num_warps)  # fmt: skip
        acc = _last_pv(p, alpha, acc, v_bufs, v_ready, v_free, turn, 0, 0, n_blocks, STAGES, PART, False, o_layout,
                       p_layout)  # fmt: skip

    # the partial, normalised, and its base-2 log-sum-exp (-inf: no key this split; the merge weighs it 0)
    has_keys = l_i > 0.0
    l_safe = gl.where(has_keys, l_i, 1.0)
    lse = gl.where(has_keys, m_i + gl.log2(l_safe), -float("inf"))
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    o_r = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    o_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_tok = (q_start + o_r // group).to(gl.int64)
    o_head = kv_head * group + o_r % group
    o_offs = (o_tok * stride_ot + o_head * stride_oh + split * stride_os)[:, None] + o_d[None, :]
    gl.store(o_ptr + o_offs, out, mask=(o_r < num_rows)[:, None])
    s_r = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    s_tok = (q_start + s_r // group).to(gl.int64)
    lse_offs = (s_tok * num_q_heads + kv_head * group + s_r % group) * num_splits + split
    gl.store(lse_ptr + lse_offs, lse, mask=s_r < num_rows)


@gluon.jit
def _extend_consumer_worker(q_ptr, k_desc, v_desc, o_ptr, lse_ptr, page_table_ptr, q_smem, k_bufs, v_bufs, k_ready,
                            v_ready, k_free, v_free, turn, stride_qt, stride_qh, stride_ot, stride_oh, stride_os,
                            stride_pt, page_size, qk_scale, num_splits, num_q_heads, group, req, kv_head, split,
                            q_start, num_rows, prefix_len, seq_len, row0, s_lo, n_blocks):  # fmt: skip
    """The tile's second consumer warpgroup (rows 64..127)."""
    _extend_consumer(q_ptr, k_desc, v_desc, o_ptr, lse_ptr, page_table_ptr, q_smem, k_bufs, v_bufs, k_ready, v_ready,
                     k_free, v_free, turn, stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_pt,
                     page_size, qk_scale, num_splits, num_q_heads, group, req, kv_head, split, q_start, num_rows,
                     prefix_len, seq_len, row0, s_lo, n_blocks, 1, _PART_M, _BLOCK_N, _HEAD_DIM, _STAGES,
                     4)  # fmt: skip


# the split count and the page table's row stride are runtime values, as in `_extend_kernel` (whose constexpr split
# count compiled mid-step at serve time: 1-2.8 s stalls, extend_attention.py): Triton would build one kernel per
# 1 / multiple of 16 / other class of each
@gluon.jit(do_not_specialize=["num_splits", "stride_pt"])
def extend_fwd_kernel(q_ptr, k_desc, v_desc, o_ptr, lse_ptr, query_start_loc_ptr, prefix_lens_ptr, seq_lens_ptr,
                      page_table_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_pt, page_size,
                      qk_scale, num_splits, num_q_heads, GROUP: gl.constexpr, TILE_M: gl.constexpr,
                      PART_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                      num_warps: gl.constexpr):  # fmt: skip
    """Grid (row tiles, requests, kv heads x splits), x fastest and the last tiles first, as `_extend_kernel`'s
    split form: the tiles that share a kv head's key range run side by side (its K/V from L2 for all but one)."""
    gl.static_assert(
        PART_M == _PART_M and BLOCK_N == _BLOCK_N and STAGES == _STAGES and HEAD_DIM == _HEAD_DIM
    )
    block = gl.num_programs(0) - 1 - gl.program_id(0)
    req = gl.program_id(1)
    kv_head = gl.program_id(2) // num_splits
    split = gl.program_id(2) % num_splits
    q_start = gl.load(query_start_loc_ptr + req)
    num_rows = (gl.load(query_start_loc_ptr + req + 1) - q_start) * GROUP
    prefix_len = gl.load(prefix_lens_ptr + req)
    seq_len = gl.load(seq_lens_ptr + req)
    row0 = block * TILE_M
    # this split's keys, block-aligned from 0, up to the tile's last token (as `_extend_kernel`)
    # (at most the request's end: a CUDA graph's padded tokens lie past it, and a block wholly past it would both
    # read stale V and land a second block on `land`, which the first consumer waits on once: _zero_past_end)
    hi = gl.minimum(prefix_len + (gl.minimum(row0 + TILE_M, num_rows) - 1) // GROUP + 1, seq_len)
    chunk = gl.cdiv(gl.cdiv(hi, num_splits), BLOCK_N) * BLOCK_N
    s_lo = split * chunk
    n_blocks = gl.cdiv(gl.maximum(gl.minimum(s_lo + chunk, hi) - s_lo, 0), BLOCK_N)
    if row0 >= num_rows:
        n_blocks = 0

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, PART_M, HEAD_DIM], _Q_LAYOUT)
    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], _KV_LAYOUT)
    v_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], _KV_LAYOUT)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # the steps' turns (pingpong: off here) carry the landing barrier of the request's last V block (_extend_loader,
    # _zero_past_end). Barriers no partition uses share the memory Triton hands the partitions' arguments through
    # (Triton 3.6's sm90 build stored row0, s_lo, ... over two unused turns, with no mbarrier.inval between)
    turn = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(turn, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_free.index(i), count=2)  # both consumers free every buffer
        mbarrier.init(v_free.index(i), count=2)

    # fmt: off
    args = (q_ptr, k_desc, v_desc, o_ptr, lse_ptr, page_table_ptr, q_smem, k_bufs, v_bufs, k_ready, v_ready, k_free,
            v_free, turn, stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_pt, page_size, qk_scale,
            num_splits, num_q_heads, GROUP, req, kv_head, split, q_start, num_rows, prefix_len, seq_len, row0, s_lo,
            n_blocks)
    gl.warp_specialize(
        [
            (_extend_consumer, (q_ptr, k_desc, v_desc, o_ptr, lse_ptr, page_table_ptr, q_smem, k_bufs, v_bufs, k_ready,
                                v_ready, k_free, v_free, turn, stride_qt, stride_qh, stride_ot, stride_oh, stride_os,
                                stride_pt, page_size, qk_scale, num_splits, num_q_heads, GROUP, req, kv_head, split,
                                q_start, num_rows, prefix_len, seq_len, row0, s_lo, n_blocks, 0, PART_M, BLOCK_N,
                                HEAD_DIM, STAGES, num_warps)),
            (_extend_consumer_worker, args),
            (_extend_loader, args),
        ],
        [4, 1],
        [COMPUTE_REGS, LOAD_REGS],
    )
    # fmt: on


def choose_splits(query_lens: list[int], seq_lens: list[int], group: int, num_kv_heads: int, num_sms: int = 132,
                  waves: float = 2.0) -> int:  # fmt: skip
    """Key splits for about `waves` waves of one-program-an-SM tiles (the Triton kernel aims at 8 waves of its
    shorter-lived programs), at least 2 key blocks a split, at most 64 splits. The engine passes the Triton kernel's
    count instead (fixed per CUDA graph): `gluon_extend_check.py` times both."""
    programs = num_kv_heads * sum(-(-q * group // TILE_M) for q in query_lens)
    if programs == 0:
        return 1
    by_waves = max(1, round(waves * num_sms / programs))
    by_length = max(1, max(seq_lens, default=1) // (2 * BLOCK_N))
    return min(by_waves, by_length, 64)


def fits(q: torch.Tensor, k_cache: torch.Tensor, page_size: int) -> bool:
    """Whether the kernel takes this call: bf16 q and cache, D = 128, page sizes of 16n, q's heads side by side."""
    return (
        q.dtype == k_cache.dtype == torch.bfloat16
        and q.shape[2] == k_cache.shape[3] == D
        and page_size % KEY_BOX == 0
        and q.stride(2) == 1
    )


def extend_attention(q, k_cache, v_cache, query_start_loc, prefix_lens, seq_lens, page_table, page_size: int,
                     max_query_len: int, scale: float, num_splits: int, out=None) -> torch.Tensor:  # fmt: skip
    """`kernels.extend_attention.extend_attention`'s causal attention of the new tokens over their paged K/V
    (stored already): q [T, Hq, D] bf16, caches [num_pages, page_size, Hkv, D] bf16 (page_size a multiple of 16);
    fp32 partials of `num_splits` key ranges merged by `merge_splits`. o [T, Hq, D]."""
    num_tokens, num_q_heads, _ = q.shape
    num_pages, _, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    assert page_size % KEY_BOX == 0 and q.dtype == k_cache.dtype == torch.bfloat16 and q.stride(2) == 1
    part = torch.empty(num_tokens, num_q_heads, num_splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_tokens, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0 or max_query_len == 0:
        return out
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
    k2, v2 = (c.view(num_pages * page_size, num_kv_heads * D) for c in (k_cache, v_cache))
    k_desc, v_desc = (
        TensorDescriptor(c, list(c.shape), list(c.stride()), [KEY_BOX, D], layout) for c in (k2, v2)
    )
    grid = (triton.cdiv(max_query_len * group, TILE_M), seq_lens.shape[0], num_kv_heads * num_splits)
    extend_fwd_kernel[grid](
        q, k_desc, v_desc, part, lse, query_start_loc, prefix_lens, seq_lens, page_table, q.stride(0), q.stride(1),
        part.stride(0), part.stride(1), part.stride(2), page_table.stride(0), page_size, scale * LOG2E, num_splits,
        num_q_heads, group, TILE_M, PART_M, BLOCK_N, D, STAGES, num_warps=4, maxnreg=168,
    )  # fmt: skip
    return merge_splits(part, lse, out)
