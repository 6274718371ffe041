"""The int4 tensor-core GEMV's pieces a step (int4_mma_gemv.py's kernel: the module docstring there): its words and
activations loaded into registers or read back from the TMA ring, the activations as mma's B fragments, a step's
products and sums into the accumulators. The PTX and lane mapping: int4_mma_ptx.py."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from longserve.kernels.gluon_compat import reinterpret, tma_load
from longserve.kernels.gluon_gemv import axis, silu_times
from longserve.kernels.int4_mma_ptx import (
    PRMT_HI,
    PRMT_LO,
    STEP_ASM,
    STEP_CONSTRAINTS,
    SUMS_ASM,
    SUMS_CONSTRAINTS,
)

__all__ = [
    "b_pairs",
    "gated_loads",
    "gated_start",
    "gated_steps",
    "gated_store",
    "group_scales",
    "prefetch_pieces",
    "ring_load",
    "ring_start",
    "ring_wait",
    "ring_words",
    "step_loads",
    "step_sums",
]


@gluon.jit
def step_loads(words_a, words_b, xs, col, N, step, EVEN_N: gl.constexpr, HALF: gl.constexpr):
    """A step's words of A's rows g (column col) and g + 8 (column col + HALF), and token g's 64 bytes of x."""
    if EVEN_N:
        wa = gl.load(words_a + step * 16)
        wb = gl.load(words_b + step * 16)
    else:
        wa = gl.load(words_a + step * 16, mask=col < N, other=0)
        wb = gl.load(words_b + step * 16, mask=col + HALF < N, other=0)
    return wa, wb, gl.load(xs + step * 64)


@gluon.jit
def ring_load(w_desc, ring, ready, row0, step, slot):
    """The words of the program's rows (from row0 of the descriptor's) of the steps from `step` (the descriptor's
    box: the program's BLOCK_N rows, 16 words a step) into the ring's slot by one TMA load: its first half (A's rows
    g of every tile) and its second (rows g + 8) one after the other, as ring_words reads them. One load, not one a
    half: each asks the CTA barriers Triton puts around a TMA load and an mbarrier's expect (sm90 SASS, Triton 3.6:
    three a refill with two loads, two with one)."""
    mbarrier.expect(ready.index(slot), w_desc.block_type.nbytes)
    tma_load(w_desc, [row0, step * 16], ready.index(slot), ring.index(slot))


@gluon.jit
def ring_start(w_desc, row0, s_begin, n_steps, REPS: gl.constexpr, W: gl.constexpr, STAGES: gl.constexpr):
    """The ring (STAGES slots of [BLOCK_N, 16 S] words for S steps a slot, one mbarrier a slot) with its first
    STAGES slots asked for."""
    S: gl.constexpr = w_desc.block_type.shape[1] // 16
    ring = gl.allocate_shared_memory(gl.int32, [STAGES, 16 * W * REPS, 16 * S], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        if i * S < n_steps:
            ring_load(w_desc, ring, ready, row0, s_begin + i * S, i)
    return ring, ready


@gluon.jit
def ring_wait(ready, j, STAGES: gl.constexpr):
    """Until the program's j-th slot of steps has landed."""
    mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)


@gluon.jit
def ring_words(ring, slot, sub: gl.constexpr, L: gl.constexpr, REPS: gl.constexpr, W: gl.constexpr):
    """Step `sub` of a landed slot's steps: A's rows g and g + 8 of each tile (the slot's rows r 8W + 8w + g and
    that + HALF), words 16 sub + 4t + u, in L."""
    S: gl.constexpr = ring.shape[2] // 16  # steps a slot
    SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])  # row-major, as TMA wrote it
    # the halves one after another
    tiles = reinterpret(ring.index(slot), gl.int32, [2 * REPS, 8 * W, 4 * S, 4], SL)
    wa = tiles.slice(0, REPS, dim=0).slice(4 * sub, 4, dim=2)
    wb = tiles.slice(REPS, REPS, dim=0).slice(4 * sub, 4, dim=2)
    return wa.load(L), wb.load(L)


# silu(gate) * up's pair of results packed into one word of bf16 pairs, each rounded to nearest even (as .to(bf16))
_PACK_BF16X2 = gl.constexpr("cvt.rn.bf16x2.f32 $0, $1, $2;")


@gluon.jit
def gated_start(W: gl.constexpr, S: gl.constexpr):
    """GATED's activations in shared memory: 2 slots of S steps, each [8W lane rows, 64 words] as the lanes read x
    (LX), zeroed: only each warp's lane row g = 0 (token 0, the one row) is written after; rows of tokens past it
    feed sums that are not stored."""
    # a layout of rank 2: each index() a plain [8W, 64] row-major buffer
    xbuf = gl.allocate_shared_memory(gl.int32, [2 * S, 8 * W, 64], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    ZL: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [W, 1], [1, 0])
    for i in gl.static_range(2 * S):
        xbuf.index(i).store(gl.zeros([8 * W, 64], gl.int32, ZL))
    return xbuf


@gluon.jit
def gated_loads(x_ptr, up_off, step, W: gl.constexpr):
    """The one row's gate and up words of a step (gate|up at x_ptr, up from word up_off), as stored: [W, 64] words,
    a warp a copy (gated_store makes each warp's own)."""
    PL: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [W, 1], [1, 0])  # [W, 64] words: a warp a copy
    copy = gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, PL)), 1)  # [W, 1]
    words = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, PL)), 0) + 0 * copy  # [W, 64]
    return gl.load(x_ptr + step * 64 + words), gl.load(x_ptr + up_off + step * 64 + words)


@gluon.jit
def gated_store(xbuf, g, u, index, W: gl.constexpr):
    """silu(gate) * up of a step's words (gated_loads') into xbuf's buffer `index`, rows 8w (each warp its copy, which
    its lanes alone read), rounded as activation.silu_and_mul rounds them."""
    RL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    lo = silu_times(
        (g << 16).to(gl.float32, bitcast=True), (u << 16).to(gl.float32, bitcast=True), gl.bfloat16
    )
    hi = silu_times(
        (g & -65536).to(gl.float32, bitcast=True), (u & -65536).to(gl.float32, bitcast=True), gl.bfloat16
    )
    packed = gl.inline_asm_elementwise(_PACK_BF16X2, "=r,f,f", [hi, lo], dtype=gl.int32, is_pure=True, pack=1)
    rows = reinterpret(xbuf.index(index), gl.int32, [W, 8 * 64], RL)  # warp w's rows 8w ..
    rows.slice(0, 64, dim=1).store(packed)


@gluon.jit
def gated_steps(xbuf, x_ptr, up_off, first, s_end, slot, W: gl.constexpr, S: gl.constexpr):
    """silu(gate) * up of the one row's steps first .. first + S - 1 (steps past s_end clamped: their sums are
    weighted 0) into the slot's buffers (gated_loads, then gated_store)."""
    for sub in gl.static_range(S):
        g, u = gated_loads(x_ptr, up_off, gl.minimum(first + sub, s_end - 1), W)
        gated_store(xbuf, g, u, slot * S + sub, W)


@gluon.jit
def prefetch_pieces(pid_n, N, stride_wn, REPS: gl.constexpr, W: gl.constexpr):
    """Word offsets of step 0's 16-byte pieces of A's rows g and g + 8 (columns col and col + HALF; words_a,
    words_b: lane t's words 4t .. 4t + 3) for gluon_gemv.prefetch_l2, one element a piece (int32 offsets, in a layout
    of one element along the pieces' words: a pointer a word would hold 8 registers a piece); the columns past N at
    N - 1 (a prefetch outside the weights is not defined). Int32: the 8B's largest projection is 7.3M words."""
    LP: gl.constexpr = gl.BlockedLayout([REPS, 1, 1, 1], [1, 8, 4, 1], [1, W, 1, 1], [3, 2, 1, 0])
    col = pid_n * (16 * W * REPS) + axis(REPS, 0, LP) * (8 * W) + axis(8 * W, 1, LP)
    piece = 4 * axis(4, 2, LP)
    half = 8 * W * REPS
    return gl.minimum(col, N - 1) * stride_wn + piece, gl.minimum(col + half, N - 1) * stride_wn + piece


@gluon.jit
def b_pairs(xt, L: gl.constexpr):
    """A step's x words [1, 8W, 4, 16] (each word's natural pairs P_p, p = 2a + b) as B's X_0..X_3 in L:
    X_i = (x[8j + i], x[8j + i + 4]), one prmt each."""
    pa0, pa1 = gl.split(gl.reshape(xt, [1, xt.shape[1], 4, 4, 2, 2]))  # b = 0, 1: [1, 8W, 4, 4, 2] over a
    p0, p2 = gl.split(pa0)
    p1, p3 = gl.split(pa1)
    x0 = gl.inline_asm_elementwise(PRMT_LO, "=r,r,r", [p0, p2], dtype=gl.int32, is_pure=True, pack=1)
    x1 = gl.inline_asm_elementwise(PRMT_HI, "=r,r,r", [p0, p2], dtype=gl.int32, is_pure=True, pack=1)
    x2 = gl.inline_asm_elementwise(PRMT_LO, "=r,r,r", [p1, p3], dtype=gl.int32, is_pure=True, pack=1)
    x3 = gl.inline_asm_elementwise(PRMT_HI, "=r,r,r", [p1, p3], dtype=gl.int32, is_pure=True, pack=1)
    return (
        gl.convert_layout(x0, L),
        gl.convert_layout(x1, L),
        gl.convert_layout(x2, L),
        gl.convert_layout(x3, L),
    )


@gluon.jit
def group_scales(s_ptr, col_s, stride_sn, z_ptr, stride_zn, N, step, GROUP_SHIFT: gl.constexpr,
                 EVEN_N: gl.constexpr, HAS_ZP: gl.constexpr):  # fmt: skip
    """A step's group scales of the program's columns col_s (LS), as stored, and its zero points (HAS_ZP; else the
    scales again, unused)."""
    if GROUP_SHIFT < 0:  # one group
        grp = 0
    else:
        grp = step >> GROUP_SHIFT
    if EVEN_N:
        s2 = gl.load(s_ptr + col_s * stride_sn + grp)
    else:
        s2 = gl.load(s_ptr + col_s * stride_sn + grp, mask=col_s < N, other=0.0)
    if HAS_ZP:
        z2 = gl.load(z_ptr + col_s * stride_zn + grp, mask=col_s < N, other=0)
    else:
        z2 = s2
    return s2, z2


@gluon.jit
def step_sums(acc, acc2, wa, wb, xt, xs2, step, zero, zero_x, s2, z2, L: gl.constexpr, REPS: gl.constexpr,
              W: gl.constexpr, HAS_ZP: gl.constexpr, TOKEN_TILES: gl.constexpr, weight=1.0):  # fmt: skip
    """A step's products into the accumulators (acc: tokens 0-7; acc2, TOKEN_TILES 2: tokens 8-15, B's second tile
    through the same words, its x loaded here): the step's sums, less (128 + z) times its sums of x, scaled by its
    group's scales s2 and zero points z2 (group_scales) and times `weight` (0 drops a step)."""
    x0, x1, x2, x3 = b_pairs(xt, L)
    sums = gl.inline_asm_elementwise(
        SUMS_ASM, SUMS_CONSTRAINTS, [zero_x, x0, x1, x2, x3], dtype=gl.float32, is_pure=True, pack=4
    )
    c = gl.inline_asm_elementwise(
        STEP_ASM, STEP_CONSTRAINTS, [zero, wa, wb, x0, x1, x2, x3], dtype=gl.float32, is_pure=True, pack=4
    )
    if TOKEN_TILES == 2:  # tokens 8-15: the same words unpacked again beside another B (registers: not kept)
        y0, y1, y2, y3 = b_pairs(gl.load(xs2 + step * 64), L)
        sums2 = gl.inline_asm_elementwise(
            SUMS_ASM, SUMS_CONSTRAINTS, [zero_x, y0, y1, y2, y3], dtype=gl.float32, is_pure=True, pack=4
        )
        c2 = gl.inline_asm_elementwise(
            STEP_ASM, STEP_CONSTRAINTS, [zero, wa, wb, y0, y1, y2, y3], dtype=gl.float32, is_pure=True, pack=4
        )
    sf = s2.to(gl.float32)
    scale = gl.convert_layout(gl.reshape(gl.join(sf, sf), [REPS, 8 * W, 1, 4]), L) * weight
    if HAS_ZP:
        zf = z2.to(gl.float32) + 128.0
        zq = gl.convert_layout(gl.reshape(gl.join(zf, zf), [REPS, 8 * W, 1, 4]), L)
    else:
        zq = 136.0  # 128 + 2^(4 - 1)
    acc += scale * (c - zq * sums)
    if TOKEN_TILES == 2:
        acc2 += scale * (c2 - zq * sums2)
    return acc, acc2
