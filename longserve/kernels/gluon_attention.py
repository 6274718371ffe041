"""Our Hopper attention kernel (Gluon: TMA, mbarriers, asynchronous wgmma, warp specialization; FlashAttention-3's
structure): causal (aligned bottom-right) and prefix (no mask) attention of one layer with the natural-log
log-sum-exp the engine's merges take. The engine's long prefix calls go here on sm90 (`attention/gluon_calls.py`);
its torch references: `gluon_attention_reference.py` (fp32, and the kernel's loop).

Why our own: with vLLM's FA3 answering the engine's cuDNN calls, cold 128K took 7.8% less and 32K 3.7% less
(RESULTS.md, twenty-first session), and cuDNN offers no faster plan. Measured on the H200 (RESULTS.md, twenty-second
and twenty-third sessions), the default variant (split tile, runs of 2 key blocks, persistent): right to fp32's
error; prefix calls (8K new over 32K / 128K keys) 1.00-1.035x cuDNN's rate, causal squares 0.91x (8K) to 0.99x
(32K), FA3 10-16% ahead; answering the engine's prefix calls, cold 128K 1.6% faster end to end. The causal calls
stay on cuDNN.

The kernel (tiles of 128 query rows of one q head, one a program or (persistent) a program an SM walking them; GQA
by the kv head's column in K/V):
- a 1-warp load partition: each tile's Q once the last tile's S are done with it, then K one block ahead of V
  through rings of STAGES buffers by TMA, K's and V's buffers each freed on their own barrier (K once S has read it,
  V once P V has);
- the consumers (gluon_attention_steps.py): S_j = Q K_j^T issued asynchronously, then O += P_{j-1} V_{j-1} (P from
  registers), the softmax of S_j meant to run while that does (FA3's intra-warpgroup overlap; in the SASS ptxas
  waits for P V first except in a run's blocks but its last, _kv_run); masks only on the blocks that cross the
  causal diagonal (query i of L sees keys up to i + S - L) or the keys' end.
q/k/v are read as the engine lays them (views of the fused qkv output, or a prefix on consecutive cache pages):
2D [rows, heads * D] with a row stride, 16-byte aligned; bf16, D = 128 (`fits`). Built with Triton 3.6 (the GPU
machine's) and 3.9 (`gluon_compat.supported()`: the versions known to build it). The variants (`Variant`, `use_variant` before
the first launch; `scripts/probes/gluon_attention_check.py` picks one from GLUON_*): split (each half tile its own
consumer warpgroup: the default partition and a worker of 4 warps over the same buffers) or one consumer partition
of 8 warps meeting at a barrier four times an iteration (~490 TFLOP/s); pingpong (FA3's turns between the two,
measured 0-3% slower); key tiles of 64 or 128; stages; the key blocks a run; persistent. Built for sm90 on any
machine: `gluon_attention_check.py --compile-only` (registers, spills, SASS).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from longserve.kernels import split_k
from longserve.kernels.gluon_attention_steps import _key_blocks, _last_pv
from longserve.kernels.gluon_compat import tma_load

D = 128  # the head dim the kernel is built for
BLOCK_M, NUM_WARPS = 128, 8
LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class Variant:
    # two consumer warpgroups, one a half tile each (one partition of 8 warps: ~490 TFLOP/s)
    split: bool = True
    # the two take turns issuing their GEMMs (FA3's order; 0-3% slower, twenty-second session)
    pingpong: bool = False
    block_n: int = 128
    stages: int = 2  # 3: no faster
    # the unmasked key blocks `run` at a time in one body, each one's P V waited for after the next one's S is issued
    # (_kv_run): at 2 (pairs) prefix calls 605-612 TFLOP/s against 587-605 at 1 (twenty-third session); 1: _kv_block;
    # 3 builds (2 of 3 softmaxes beside a P V) and is not yet run; 4 makes ptxas serialize every wgmma
    run: int = 2
    # a program an SM walking the tiles (_tile's snake order), the next tile's loads under the last one's end; with
    # pairs, 3000 rows over 12000 keys 550 against 484 TFLOP/s, prefix calls the same
    persistent: bool = True
    load_regs: int = 24  # the load partition's registers
    compute_regs: int = 240  # the split tile's second consumer's (the first gets what is left: 256)


VARIANT = Variant()
_launched = False


def use_variant(variant: Variant) -> None:
    """Build the kernel as `variant` (one variant a process: Triton checks that the globals a kernel read at its
    compile have not changed since)."""
    global VARIANT, SPLIT, PINGPONG, BLOCK_N, STAGES, PERSISTENT, RUN, LOAD_REGS, COMPUTE_REGS
    global _PART_M, _BLOCK_N, _STAGES, _PINGPONG
    if _launched and variant != VARIANT:
        raise RuntimeError("gluon_attention.use_variant: the kernel has already run as another variant")
    VARIANT = variant
    SPLIT, PINGPONG = variant.split, variant.split and variant.pingpong
    BLOCK_N, STAGES, PERSISTENT = variant.block_n, variant.stages, variant.persistent
    RUN = gl.constexpr(variant.run)
    LOAD_REGS, COMPUTE_REGS = gl.constexpr(variant.load_regs), gl.constexpr(variant.compute_regs)
    # Triton 3.6 hands a worker partition its arguments as runtime values, constexprs included: the split tile's
    # workers take their tile shape from these module constants (the launch passes the same) and the mask kind as a
    # value
    _PART_M, _BLOCK_N, _STAGES, _PINGPONG = (
        gl.constexpr(x) for x in (BLOCK_M // 2, BLOCK_N, STAGES, PINGPONG)
    )


_TILE_M = gl.constexpr(BLOCK_M)
_HEAD_DIM = gl.constexpr(D)
use_variant(VARIANT)


@gluon.jit
def _tile(t, num_heads, num_tiles, num_keys, shift, causal, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Work item t: (q head, the tile's first row, its key blocks). The q heads of a kv head run side by side (their
    K/V stay in L2); causal tiles longest first. Persistent programs take the t of each round of nprog items in
    turn, every other full round in reverse (a snake): with the causal tiles' lengths falling, program 0 would
    otherwise take the longest of every round (at causal 8K, ~15 rounds of ~4 tile lengths each: ~12% more than
    the average program; measured persistent 493 against 544 TFLOP/s one tile a program, twenty-third session)."""
    nprog = gl.num_programs(0)
    r = t // nprog
    if causal and r % 2 == 1 and (r + 1) * nprog <= num_heads * num_tiles:
        t = r * nprog + nprog - 1 - (t - r * nprog)
    head = t % num_heads
    tile = t // num_heads
    kv_end = num_keys
    if causal:
        tile = num_tiles - 1 - tile
        kv_end = gl.minimum(num_keys, tile * TILE_M + TILE_M + shift)
    return head, tile * TILE_M, gl.cdiv(kv_end, BLOCK_N)


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_free, k_ready, v_ready, k_free, v_free,
                    num_heads, num_tiles, num_keys, shift, causal, group, TILE_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, Q_PARTS: gl.constexpr):  # fmt: skip
    """Each of the program's tiles (one, or several when persistent): Q once the consumers are done with the last
    tile's, then K one block ahead of V: K_{j+1} before V_j, each into a buffer freed on its own barrier (K's once S
    has read it, V's once P V has), the ring's stages and phases running on across tiles. With one barrier for both
    (the first GPU run: 511 TFLOP/s at best against cuDNN's 603-645), block j's loads waited for P_{j-2} V_{j-2},
    which the compute partition finishes at the end of iteration j - 1 just before it waits for K_j: every iteration
    sat through a TMA load's latency (and key tiles of 64, twice the iterations, ran slower still: 407). Now K_j is
    issued about 1.5 iterations before S_j needs it and V_{j-1} one iteration before P_{j-1} V_{j-1}."""
    g0 = 0
    i = 0
    for t in range(gl.program_id(0), num_heads * num_tiles, gl.num_programs(0)):
        head, q_row, n_blocks = _tile(t, num_heads, num_tiles, num_keys, shift, causal, TILE_M, BLOCK_N)
        q_col = head * q_desc.block_type.shape[1]
        kv_col = (head // group) * k_desc.block_type.shape[1]
        # a fresh barrier counts as freed: the first wait on each buffer (parity 1) passes
        mbarrier.wait(q_free, (i & 1) ^ 1)
        mbarrier.expect(q_ready, Q_PARTS * q_desc.block_type.nbytes)
        for part in gl.static_range(Q_PARTS):  # one part a consumer warpgroup (split) or the whole tile
            tma_load(q_desc, [q_row + part * q_desc.block_type.shape[0], q_col], q_ready, q_smem.index(part))
        s = g0 % STAGES
        mbarrier.wait(k_free.index(s), ((g0 // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma_load(k_desc, [0, kv_col], k_ready.index(s), k_bufs.index(s))
        for j in range(n_blocks):
            if j + 1 < n_blocks:
                s = (g0 + j + 1) % STAGES
                mbarrier.wait(k_free.index(s), (((g0 + j + 1) // STAGES) & 1) ^ 1)
                mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                tma_load(k_desc, [(j + 1) * BLOCK_N, kv_col], k_ready.index(s), k_bufs.index(s))
            s = (g0 + j) % STAGES
            mbarrier.wait(v_free.index(s), (((g0 + j) // STAGES) & 1) ^ 1)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma_load(v_desc, [j * BLOCK_N, kv_col], v_ready.index(s), v_bufs.index(s))
        g0 += n_blocks
        i += 1  # noqa: SIM113 (no enumerate in a Gluon kernel)


@gluon.jit
def _compute_partition(q_smem, k_bufs, v_bufs, q_ready, q_free, k_ready, v_ready, k_free, v_free, turn, o_ptr, lse_ptr,
                       num_heads, num_tiles, num_rows, num_keys, shift, qk_scale, o_row_stride, causal,
                       TILE_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                       STAGES: gl.constexpr, PART: gl.constexpr, PINGPONG: gl.constexpr,
                       num_warps: gl.constexpr):  # fmt: skip
    """For each of the program's tiles: BLOCK_M rows (the tile's part PART, its Q in q_smem.index(PART)) over the
    tile's key blocks; the ring's stages and phases run on across tiles (g0), and so do the issue slots (slot0)."""
    q_tile = q_smem.index(PART)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    g0 = 0
    i = 0
    for t in range(gl.program_id(0), num_heads * num_tiles, gl.num_programs(0)):
        head, tile_start, n_blocks = _tile(t, num_heads, num_tiles, num_keys, shift, causal, TILE_M, BLOCK_N)
        q_start = tile_start + PART * BLOCK_M
        mask_from = num_keys
        if causal:
            mask_from = gl.minimum(num_keys, q_start + shift + 1)
        slot0 = g0 + i
        rows = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

        mbarrier.wait(q_ready, i & 1)
        # block j crosses the diagonal or the keys' end iff j >= first_masked
        p, alpha, acc, m_i, l_i = _key_blocks(q_tile, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, turn, g0,
                                              slot0, n_blocks, mask_from // BLOCK_N, m_i, l_i, acc, rows, num_keys,
                                              shift, qk_scale, causal, RUN, BLOCK_M, BLOCK_N, STAGES, PART, PINGPONG,
                                              s_layout, o_layout, p_layout)  # fmt: skip
        mbarrier.arrive(
            q_free, count=1
        )  # every S of the tile waited for: the loader may bring the next tile's Q
        acc = _last_pv(p, alpha, acc, v_bufs, v_ready, v_free, turn, g0, slot0, n_blocks, STAGES, PART, PINGPONG,
                       o_layout, p_layout)  # fmt: skip

        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        out = (acc / l_o[:, None]).to(gl.bfloat16)
        o_rows = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        o_offs = o_rows[:, None] * o_row_stride + head * HEAD_DIM + o_cols[None, :]
        gl.store(o_ptr + o_offs, out, mask=(o_rows < num_rows)[:, None])
        # natural log of sum(exp(scale * s)) = ln 2 * (m + log2(l)) in the base-2 units above
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
        gl.store(lse_ptr + head * num_rows + rows, lse, mask=rows < num_rows)
        g0 += n_blocks
        i += 1  # noqa: SIM113 (no enumerate in a Gluon kernel)


@gluon.jit
def _split_compute_worker(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_free, k_ready, v_ready, k_free,
                          v_free, turn, o_ptr, lse_ptr, num_heads, num_tiles, num_rows, num_keys, shift, qk_scale,
                          o_row_stride, causal, group):  # fmt: skip
    """The second consumer warpgroup of a split tile: its rows are each tile's second half."""
    _compute_partition(q_smem, k_bufs, v_bufs, q_ready, q_free, k_ready, v_ready, k_free, v_free, turn, o_ptr, lse_ptr,
                       num_heads, num_tiles, num_rows, num_keys, shift, qk_scale, o_row_stride, causal, _TILE_M,
                       _PART_M, _BLOCK_N, _HEAD_DIM, _STAGES, 1, _PINGPONG, 4)  # fmt: skip


@gluon.jit
def _split_load_worker(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_free, k_ready, v_ready, k_free,
                       v_free, turn, o_ptr, lse_ptr, num_heads, num_tiles, num_rows, num_keys, shift, qk_scale,
                       o_row_stride, causal, group):  # fmt: skip
    """The split tile's loader (the same arguments as the other worker, as warp_specialize wants)."""
    _load_partition(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_free, k_ready, v_ready, k_free, v_free,
                    num_heads, num_tiles, num_keys, shift, causal, group, _TILE_M, _BLOCK_N, _STAGES, 2)  # fmt: skip


@gluon.jit
def attention_fwd_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr, num_heads, num_rows, num_keys, shift, qk_scale,
                         o_row_stride, GROUP: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                         PART_M: gl.constexpr, PINGPONG: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """Tiles of BLOCK_M query rows of one q head: one a program, or (GLUON_PERSISTENT) a program an SM walking every
    nprog-th tile, its loader bringing the next tile's Q and first K while the consumers finish the last. SPLIT: the
    tile is two halves, each its own consumer warpgroup (the default partition of 4 warps and a worker of 4) reading
    the same K/V buffers, so that the warp schedulers can run one half's softmax while the other's wgmma runs, in
    turns with PINGPONG (FA3's order); otherwise one consumer partition of num_warps warps holds the whole tile."""
    num_tiles = gl.cdiv(num_rows, BLOCK_M)
    parts: gl.constexpr = 2 if SPLIT else 1
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [parts] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(
        gl.int64, [2, 1], mbarrier.MBarrierLayout()
    )  # a split tile's warpgroups' turns
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_free, count=parts)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_free.index(i), count=parts)  # every consumer frees every buffer
        mbarrier.init(v_free.index(i), count=parts)

    if SPLIT:
        # fmt: off
        worker_args = (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_free, k_ready, v_ready, k_free,
                       v_free, turn, o_ptr, lse_ptr, num_heads, num_tiles, num_rows, num_keys, shift, qk_scale,
                       o_row_stride, CAUSAL, GROUP)
        gl.static_assert(BLOCK_M == _TILE_M and PART_M == _PART_M and BLOCK_N == _BLOCK_N and STAGES == _STAGES
                         and HEAD_DIM == _HEAD_DIM and PINGPONG == _PINGPONG)
        gl.warp_specialize(
            [
                (_compute_partition, (q_smem, k_bufs, v_bufs, q_ready, q_free, k_ready, v_ready, k_free, v_free, turn,
                                      o_ptr, lse_ptr, num_heads, num_tiles, num_rows, num_keys, shift, qk_scale,
                                      o_row_stride, CAUSAL, BLOCK_M, PART_M, BLOCK_N, HEAD_DIM, STAGES, 0, PINGPONG,
                                      num_warps)),
                (_split_compute_worker, worker_args),
                (_split_load_worker, worker_args),
            ],
            [4, 1],
            [COMPUTE_REGS, LOAD_REGS],
        )
        # fmt: on
    else:
        gl.warp_specialize(
            [
                (_compute_partition, (q_smem, k_bufs, v_bufs, q_ready, q_free, k_ready, v_ready, k_free, v_free, turn,
                                      o_ptr, lse_ptr, num_heads, num_tiles, num_rows, num_keys, shift, qk_scale,
                                      o_row_stride, CAUSAL, BLOCK_M, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, 0, False,
                                      num_warps)),
                (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_free, k_ready, v_ready,
                                   k_free, v_free, num_heads, num_tiles, num_keys, shift, CAUSAL, GROUP, BLOCK_M,
                                   BLOCK_N, STAGES, 1)),
            ],
            [1],
            [LOAD_REGS],
        )  # fmt: skip


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel reads these q [L, Hq, D], k/v [S, Hkv, D] as they lie: bf16, D = 128, each row of heads
    contiguous (unit stride along D, D along the heads), rows 16-byte aligned (TMA), whole groups of q heads."""
    return (
        q.dtype == k.dtype == v.dtype == torch.bfloat16
        and q.shape[2] == k.shape[2] == v.shape[2] == D
        and k.shape == v.shape
        and q.shape[1] % k.shape[1] == 0
        and all(
            x.stride(2) == 1 and x.stride(1) == D and x.stride(0) * 2 % 16 == 0 and x.data_ptr() % 16 == 0
            for x in (q, k, v)
        )
    )


def _rows_2d(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] with unit stride along D and D along H (the engine's views) as [T, H * D] with its row stride."""
    t, h, d = x.shape
    assert x.stride(2) == 1 and x.stride(1) == d, x.stride()
    return x.as_strided((t, h * d), (x.stride(0), 1))


def descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    q_rows = BLOCK_M // 2 if SPLIT else BLOCK_M  # a split tile loads its halves apart
    q_layout = gl.NVMMASharedLayout.get_default_for([q_rows, D], gl.bfloat16)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
    q2, k2, v2 = _rows_2d(q), _rows_2d(k), _rows_2d(v)
    return (
        TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [q_rows, D], q_layout),
        TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [BLOCK_N, D], kv_layout),
        TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [BLOCK_N, D], kv_layout),
    )


def attention(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [L, Hq, D], k/v [S, Hkv, D] (bf16, the engine's strided views) -> (o [L, Hq, D], lse [Hq, L] fp32, natural
    log); causal: the mask aligned bottom-right (query i sees keys up to i + S - L)."""
    global _launched
    num_rows, num_heads, _ = q.shape
    num_keys = k.shape[0]
    o = torch.empty(num_rows, num_heads, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_heads, num_rows, dtype=torch.float32, device=q.device)
    q_desc, k_desc, v_desc = descriptors(q, k, v)
    tiles = num_heads * triton.cdiv(num_rows, BLOCK_M)
    if PERSISTENT:  # a program an SM (one CTA fits an SM: 160 KB of shared memory)
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        tiles = min(tiles, split_k.num_sms(index))
    _launched = True
    attention_fwd_kernel[(tiles,)](
        q_desc, k_desc, v_desc, o, lse, num_heads, num_rows, num_keys, num_keys - num_rows, scale * LOG2E, num_heads * D,
        num_heads // k.shape[1], causal, BLOCK_M, BLOCK_N, D, STAGES, SPLIT, BLOCK_M // 2 if SPLIT else BLOCK_M,
        PINGPONG, num_warps=4 if SPLIT else NUM_WARPS,
        maxnreg=168,
    )  # fmt: skip
    return o, lse
