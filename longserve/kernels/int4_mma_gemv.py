"""The int4 decode GEMV on the tensor cores (Gluon, mma.sync): y = x @ dequantize(w)^T for 1 to 64 rows of bf16
activations and 4-bit weights in the layout of `quant_reference` (GPTQ / AWQ after loading: uint8 [N, K / 2], scales
[N, G], optional uint8 zero points), groups of a multiple of 128 or one group. Same contract as
`quant_reference.wna16_gemm_ref`; `quant_gemv.wna16_gemv` routes here (`INT4_MMA_GEMV`, `INT4_MMA_MIN_ROWS`, `fits`),
and so does moe_wna16's routed expert GEMV (`INT4_MMA_ROUTED`; ROUTED: one program column a (token, k) pair, M = 1).

Why: the CUDA-core kernels (int4_gemv.py: 3.76 sm90 instructions a weight) leave the 8B int4 decode at 1.9x its floor
at batch 1. Products on the tensor cores take the FMAs off the SMs' issue, as Marlin does; Triton's tl.dot could not
take registers in the operand layout without a trip through shared memory (eighth session). Gluon fixes every
tensor's layout, so each lane holds exactly the words its mma fragments need: one `mma.sync.m16n8k16` in inline
PTX per 16 x 16 block.

The kernel: int4_mma_kernel.py (its steps' pieces: int4_mma_steps.py); this module holds the switches it is launched
with, the plan (tiles, splits) and the launch. The mapping of weights, activations and sums onto mma's fragments, and
the PTX: int4_mma_ptx.py. 17 to 64 rows run as blocks of 16, one program each (row_blocks), a column tile's blocks
adjacent in the grid.

Rounding: products of exact bf16 values (128 + q, x) accumulated in fp32 by the tensor cores, the 128 * sum(x)
terms cancelled in fp32 (as int4_gemv.py's kernel: ~5 bits of fp32's 24), then scaled; not bit-equal to the
reference, which rounds each weight to bf16 first. Split-K as the other decode GEMVs (split_k.SplitKOutputs): fp32
partials [splits, M, N], summed by the last program of each column tile (quant_tiles.store_gemv_out's scheme) or
by split_k.splitk_reduce.

Built for sm90 on the CPU machine with Triton 3.6 and 3.9 (`scripts/dev/count_gemv_sass.py '{"mma": true}'`: the
step loop at 1.45 instructions a weight, 142 registers, no shared memory, no spills; with the TMA ring (STAGES) 87
registers). Its PTX and epilogue run warp by warp on the CPU in int4_mma_reference.py. On an H200 (RESULTS.md
twenty-fifth and twenty-eighth sessions): its GPU tests (tests/gpu/test_int4_mma_gemv_gpu.py) pass with its words in
registers and by the ring; with words in registers it is far from its HBM floor at one row (the 8B gate_up 27-37 us
against 14: bytes in flight, not instructions, hold it), by the ring at 2 tiles a warp 24.3 (ONE_ROW); it beats the
CUDA-core kernels from 8 rows with words in registers and at one row by the ring: quant_gemv routes 1-64 rows here.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from longserve.kernels.gluon_compat import supported
from longserve.kernels.gluon_gemv import RowNorm, norm_launch_args, one_wave_splits, weight_descriptor
from longserve.kernels.int4_mma_kernel import int4_mma_gemv_kernel
from longserve.kernels.launch import use_pdl

__all__ = [
    "BLOCK_ROWS",
    "K_STEP",
    "MAX_ROWS",
    "WAVE_SPLITS",
    "block_n",
    "fits",
    "launch",
    "resident_programs",
    "row_blocks",
    "splits",
    "supported",
    "tiling",
    "token_tiles",
]

K_STEP = 128  # k values of a step: 16 words of a column, 4 lanes x 4 words
BLOCK_ROWS = 16  # activation rows a program: B's 8 columns, twice past 8 (TOKEN_TILES)
# Rows the kernel takes: past BLOCK_ROWS in blocks of 16, one program each beside the others of its column tile
# (the words read again from L2, and unpacked again: 1.81 sm90 instructions a weight for 16 rows). Against
# quant_gemv's general kernel there (tl.dot through shared memory): measured on an H200 (RESULTS.md twenty-fifth
# session) the four 8B projections at 64 rows 239.7 us against 233.1 (221.2 at REPS 2), the decode at b64@4K 16.43
# -> 15.44 ms (the smaller projections gain, gate_up loses 126.6 against 117.5).
MAX_ROWS = 64
WARPS = 4
# 16-column tiles a warp holds: a program's columns are 16 x WARPS x REPS. On an H200 (twenty-fifth session) 2
# took the four 8B projections at one row to 58.6 us against 84.7 at 4 (the CUDA-core kernels' 76.8), 88.8 against
# 79.5 at 16 rows and 221.2 against 239.7 at 64; in the 8B int4 decode from one row (twenty-sixth session, 2b1e2c7,
# `gpu_check.sh int4-reps2`) it lost everywhere: b1@32K 4.64 against 4.14 ms (the one-row CUDA-core kernel), b16@8K
# 7.84 / 7.51, b64@4K 16.80 / 15.60 (at 4 the decode at one row lost 0.78 ms where its projections lost 0.26).
REPS = 4
# 0: each step's words and activations loaded into registers at its start (a warp then waits out the load's
# latency; the other warps of the SM hide it). Past 0: a ring of STAGES steps' words in shared memory, each slot a
# program's [BLOCK_N, 64 B] asked for by one TMA load on its mbarrier (two, one a half, until the twenty-ninth
# session), STAGES - 1 steps ahead of the one read and (not routed) the first ones before the PDL wait: bytes in
# flight that hold no register and take no instruction a lane, as fp8_wgmma_gemv's ring (its gate_up at one row
# 32.9 us against a 28 us floor; ours 32.7-36.5 against 14: RESULTS.md twenty-fifth / twenty-sixth sessions). Lanes
# read their 16-byte pieces back (A's rows g of a warp's tiles from one half of the slot, rows g + 8 from the other:
# 8 lanes two adjacent 64-byte rows, no bank conflict).
# sm90 builds (Triton 3.6): 87 registers at REPS 4 against 142 at 0, the loop ~400 instructions against 371 (the
# slot's addresses, the mbarrier wait, a CTA barrier before each refill). It replaced a ring of per-lane cp.async
# copies (twenty-fifth session: gate_up at one row 99.1 us against 36.6 at 0). On an H200 (twenty-eighth session,
# 6f283db, `gpu_check.sh int4-tma`) alone at one row the four 8B projections at REPS 2 and 4 stages 57.2 us (qkv /
# o / gate_up / down 8.5 / 7.5 / 24.3 / 16.9) against 76.5 on the CUDA-core kernel; at 16 rows the ring lost in the
# decode (ONE_ROW): 0 past one row.
STAGES = 0
# (REPS, STAGES) a dense product of one row takes (None: REPS and STAGES). The 8B int4 decode at b1@32K from one row
# on this kernel, ms, on an H200 (twenty-eighth session, 6f283db; bf16 5.73): (2, 1) 3.72, (2, 2) 3.73-3.74, (2, 3)
# 3.80, (2, 4) 4.00, (4, 2) 3.94-3.95, (4, 0) 4.91, against 4.12-4.13 on the CUDA-core kernel: 0.651x bf16 at (2, 2).
# At b16@8K: (4, 0) 7.42 ms against 7.49 at (4, 2) and 7.78-7.82 at REPS 2.
ONE_ROW: tuple[int, int] | None = (2, 2)
# Steps a ring slot holds: each slot's boxes take that many 64-byte pieces of each of its rows (the 8B's rows are 2 KB
# or 7 KB apart: at 1 a box reads 64 bytes of each of 64 rows, the next 64 a step later; HBM's rows are ~2 KB, and
# the FP8 GEMV's ring, 128 bytes a row a box, streams at 3.6 TB/s where ours holds ~2.4). 1 until measured
# (`gpu_check.sh tma-stream`: the rate by box shape; `int4-tma`).
STAGE_STEPS = 1
# The ring's loop asks for each step's activations (GATED: gate and up, a slot before it stages them) and group scales
# a step ahead (one step a slot, one token tile), in registers carried over the loop turn, instead of after the
# step's slot has landed. Why: on an H100 (twenty-ninth session, 96b79d3, `gpu_check.sh int4-ncu`, caches flushed)
# the one-row GEMVs by the ring stall mostly on long scoreboard (8.9-12.2 of 15.8-21.6 cycles an issued instruction;
# DRAM 24-64% busy): in the sm90 SASS (Triton 3.6) each turn waits for the slot, then loads x (LDG.128) and the
# scales (LDG.U16) and waits for them before its last FMAs and the refill's CTA barrier (GATED: and loads the next
# slot's gate and up and waits for them before the barrier): two global round trips a step, in series with the
# ring's. On: on an H100 (thirtieth session, 2946dd0, `gpu_check.sh int4-ahead` and `ahead-decodes`, two calls) the
# 8B int4 decode b1@32K 4.60 -> 4.54 ms both times (bf16 7.66; 0.593x), with rings of 3 and 4 stages 4.71 and 4.77;
# the kernel's GPU tests pass with it (54, and the routed experts' 4). PC sampling of gate_up at one row: without it
# 47% of the warps' samples sit on the PRMTs that take x's loaded values, with it 27% on the slot's mbarrier wait
# (the words' arrival) and 16% on the PRMTs and a move after them (benchmarks/RESULTS.md, thirtieth session).
AHEAD = True
# Steps whose words the kernel asks L2 for ahead of the one it loads (STAGES 0; gluon_gemv.prefetch_l2), the first
# ones before its PDL wait (not routed); 0: none. Why: bytes in flight hold the kernel (above), and a prefetch
# holds no register: sm90 builds (Triton 3.6) at 2 steps 128 registers against 142 at one token tile, 182 at two
# (unchanged), but 186 against 144 with zero points (2 programs an SM instead of 3). Off: on an H200 (twenty-sixth
# session, 0aed29a, `gpu_check.sh gemv-prefetch`) at 2 gate_up gained alone (36.5 -> 32.7 us at one row, 36.4 ->
# 33.3 at 16) and qkv and o lost (at 16 rows 11.2 -> 12.4, 10.5 -> 12.1); at 4 all lost; the 8B int4 decode lost
# (b16@8K 7.45 -> 7.54 ms, with int4_gemv.INT4_GEMV_PREFETCH alike).
PREFETCH = 0
# Steps a loop turn takes (STAGES 0, one token tile): at 2 the next step's words and activations are loaded before
# this step's products, as far as ptxas keeps them there (sm90, Triton 3.6: it issues them among the first step's
# mmas; 88 registers against 82 at REPS 2, 140 against 142 at 4; two token tiles with zero points would spill).
# 1 until measured (`gpu_check.sh int4-mma`'s UNROLL=2 variants).
UNROLL = 1


def fits(
    x: torch.Tensor, qweight: torch.Tensor, g_idx, bits: int, group_size: int, routed: bool = False
) -> bool:
    """Whether the kernel takes this product: bf16 activations of 1 to MAX_ROWS rows (routed: one a pair, any
    number), 4 bits without act order, groups of K_STEP times a power of two (or one group), K a multiple of K_STEP,
    rows of whole 16-byte aligned words."""
    m, k = x.shape
    m = 1 if routed else m
    steps = (group_size if group_size > 0 else k) // K_STEP
    return (
        x.dtype == torch.bfloat16
        and 1 <= m <= MAX_ROWS
        and bits == 4
        and g_idx is None
        and k % K_STEP == 0
        and (group_size <= 0 or group_size == k or (group_size % K_STEP == 0 and steps & (steps - 1) == 0))
        and x.stride(1) == 1
        and x.stride(0) % 8 == 0
        and x.data_ptr() % 16 == 0
        and qweight.stride(-1) == 1
        and all(st % 16 == 0 for st in qweight.stride()[:-1])  # rows (and experts) of whole 16-byte pieces
        and qweight.data_ptr() % 16 == 0
        # the ring's descriptor takes the experts' rows as one run (expert e's from e N)
        and not (
            routed and tiling(1, routed)[1] and qweight.stride(0) != qweight.shape[1] * qweight.stride(1)
        )
    )


def tiling(m: int, routed: bool = False) -> tuple[int, int]:
    """(REPS, STAGES) of a launch at m rows (routed: one row a pair)."""
    return ONE_ROW if ONE_ROW and m == 1 and not routed else (REPS, STAGES)


def block_n(m: int, routed: bool = False) -> int:
    """Output columns a program holds at m rows."""
    return 16 * WARPS * tiling(m, routed)[0]


def row_blocks(m: int) -> int:
    """Programs a column tile takes for m rows (blocks of BLOCK_ROWS)."""
    return -(-m // BLOCK_ROWS)


# Programs of 4 warps an SM holds at once, by (REPS, TOKEN_TILES): 65,536 / (128 x the registers of the sm90
# builds, Triton 3.6: 142 and 80 at one token tile, 186 (222 with zero points) and 130 at two; scripts/dev/
# count_gemv_sass.py; the TMA ring's builds take fewer: 87-150 and 71-80, 168-192 and 124-128); the ring (STAGES x
# 16 KB at REPS 4) may hold fewer.
_RESIDENT = {(4, 1): 3, (2, 1): 6, (4, 2): 2, (2, 2): 3}
# the same with the ring at 2 steps a slot (STAGE_STEPS): both steps' words and activations loaded at once, 106-188
# registers at one token tile (REPS 2: 106-128), 154-240 at two (4 steps a slot spill: not taken)
_RESIDENT_PAIRS = {(4, 1): 2, (2, 1): 4, (4, 2): 2, (2, 2): 2}
# the same with a step's x and scales in flight a step ahead (AHEAD, one token tile): 96 registers at REPS 2 (116 with
# zero points), 136 at REPS 4
_RESIDENT_AHEAD = {(4, 1): 3, (2, 1): 5}
# K split so that every program runs in one wave (columns x splits <= the programs the SMs hold at once), each
# split at least one step: with split_k.splits_for's ~8 programs an SM the 8B down projection (16 tiles x 28
# splits = 448 programs against 396 resident) would run a second wave of 52. On an H200 (twenty-fifth session) about
# equal to splits_for's split at every 8B projection and row count.
WAVE_SPLITS = True
# Steps a split takes at least: at one row and REPS 2 the one wave splits the 8B qkv's 32 steps 16 ways (2 steps a
# program, then a serial sum of 16 planes), whose fixed latency a GEMV launched back to back hides and one after a
# small kernel (the decode) does not. 1 until `gpu_check.sh int4-wave` measures 4 and 8 in the decode.
MIN_SPLIT_STEPS = 1


def token_tiles(m: int) -> int:
    """B's token tiles a program runs for m rows (TOKEN_TILES)."""
    return 1 if m <= 8 else 2


def resident_programs(sms: int, m: int, routed: bool = False, gated: bool = False) -> int:
    """Programs the SMs hold at once at m rows: by registers (_RESIDENT, by its token tiles) and by shared memory
    (the ring's STAGES slots; gated: and the activations' two slots, 8W lane rows of 64 words a step)."""
    reps, stages = tiling(m, routed)
    assert STAGE_STEPS in (1, 2), f"STAGE_STEPS {STAGE_STEPS}: 1 or 2"
    ring = stages * block_n(m, routed) * STAGE_STEPS * K_STEP // 2  # bytes of shared memory a program
    ring += 2 * STAGE_STEPS * 8 * WARPS * 64 * 4 if gated else 0
    by_registers = _RESIDENT_PAIRS if stages and STAGE_STEPS == 2 else _RESIDENT
    if ahead(m, routed):
        by_registers = _RESIDENT_AHEAD
    return min(by_registers.get((reps, token_tiles(m)), 2), 227 * 1024 // ring if ring else 8) * sms


def ahead(m: int, routed: bool = False) -> bool:
    """Whether a launch at m rows asks for each step's x (gated: gate and up) and scales a step ahead (AHEAD)."""
    return AHEAD and bool(tiling(m, routed)[1]) and STAGE_STEPS == 1 and token_tiles(m) == 1


def splits(n_tiles: int, num_steps: int, sms: int, m: int, routed: bool = False, gated: bool = False) -> int:
    """K splits for n_tiles column tiles over num_steps steps at m rows (WAVE_SPLITS): the most that keep one wave
    (row_blocks(m) programs a column tile), each of at least MIN_SPLIT_STEPS steps."""
    resident = resident_programs(sms, m, routed, gated)
    return one_wave_splits(n_tiles * row_blocks(m), num_steps, resident, MIN_SPLIT_STEPS)


def _descriptor(qweight: torch.Tensor, columns: int) -> TensorDescriptor:
    """The words' TMA descriptor for the ring of programs of `columns` (int32 [rows, K / 8], the experts' rows one
    after another, boxes of the columns by STAGE_STEPS steps), made once per weight tensor and program shape."""

    def make() -> TensorDescriptor:
        words = qweight.view(torch.int32).view(-1, qweight.shape[-1] // 4)
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        box = [columns, STAGE_STEPS * K_STEP // 8]
        return TensorDescriptor(words, list(words.shape), list(words.stride()), box, layout)

    return weight_descriptor(qweight, (columns, STAGE_STEPS), make)


def launch(x, qweight, scales, zeros, bias, group_size: int, steps_per_split: int, num_splits: int, out, res,
           locks, stride_os: int, serial: bool, bias_in_kernel: bool, ids=None, x_row_div: int = 1,
           gated: bool = False, norm: RowNorm | None = None) -> None:  # fmt: skip
    """The kernel over a product `fits` takes, K in num_splits runs of steps_per_split steps: into out [M, N] (one
    split) or its fp32 partials out [num_splits, M, N], summed (SERIAL) by each tile's last program into res with the
    counters `locks` (split_k.SplitKOutputs makes these and sums them otherwise). Routed (`ids` [P], the experts'
    qweight [E, N, K / 2], scales and zeros [E, N, G]): row p of out is x[p // x_row_div] times expert ids[p]'s.
    gated (one row, by the ring): x is gate|up [1, 2K] and the product's input silu(gate) * up. norm (one row, one
    split or serial): then the row's residual add and RMSNorm into norm.out (gluon_gemv.norm_row)."""
    k = x.shape[1] // 2 if gated else x.shape[1]
    routed = ids is not None
    m, n = (1, qweight.shape[1]) if routed else (x.shape[0], qweight.shape[0])
    steps = (group_size if 0 < group_size < k else k) // K_STEP
    group_shift = -1 if group_size <= 0 or group_size >= k else steps.bit_length() - 1
    z = zeros if zeros is not None else scales
    blocks = 1 if routed else row_blocks(m)
    reps, stages = tiling(m, routed)
    assert not gated or (m == 1 and not routed and stages), "gated: one row, by the ring"
    columns = block_n(m, routed)
    assert not (serial and blocks > 1 and locks.numel() < triton.cdiv(n, columns) * blocks)
    one_sum = serial or num_splits == 1  # norm: the row's last tile sums its own splits
    assert norm is None or (m == 1 and not routed and one_sum), "norm: one row, its sum here"
    norm_args, norm_constexprs = norm_launch_args(norm, scales)
    pdl = use_pdl(x)
    int4_mma_gemv_kernel[(triton.cdiv(n, columns) * blocks, num_splits, ids.shape[0] if routed else 1)](
        _descriptor(qweight, columns) if stages else None, x.view(torch.int32), qweight.view(torch.int32), scales,
        z, bias if bias_in_kernel else scales, out, res, locks, ids if routed else locks, m, n, steps_per_split,
        k // K_STEP, x.stride(0) // 2, qweight.stride(-2) // 4, scales.stride(-2), z.stride(-2), stride_os,
        out.stride(-2), qweight.stride(0) // 4 if routed else 0, scales.stride(0) if routed else 0,
        z.stride(0) if routed else 0, blocks, k // 2, *norm_args, HAS_ZP=zeros is not None, HAS_BIAS=bias_in_kernel,
        PARTIAL=num_splits > 1, SERIAL=serial, EVEN_N=n % columns == 0, GROUP_SHIFT=group_shift, REPS=reps,
        STAGES=stages, USE_PDL=pdl, ROUTED=routed, X_ROW_DIV=x_row_div, TOKEN_TILES=token_tiles(m),
        PREFETCH=PREFETCH if stages == 0 else 0, UNROLL=UNROLL if stages == 0 and token_tiles(m) == 1 else 1,
        GATED=gated, AHEAD=ahead(m, routed), **norm_constexprs, num_warps=WARPS, launch_pdl=pdl,
    )  # fmt: skip
