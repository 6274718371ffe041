"""The block-FP8 decode GEMV on the tensor cores (Gluon: TMA ring + wgmma): `fp8_block_gemm_ref`'s product for 1 to
MAX_ROWS rows of bf16 activations, e4m3 weights [N, K] with 128 x 128 block scales (the official Qwen3 / DeepSeek FP8
checkpoints), the activations quantized per token-group of 128 inside the kernel as `per_token_group_quant` does.
`quant_fp8.fp8_block_linear` routes here when `FP8_WGMMA_GEMV` is on (up to `FP8_WGMMA_MAX_ROWS` rows) and `fits`,
and so does `moe_fp8_gemv` for the FP8 experts at decode with `fits_routed` (ROUTED: a (token, k) pair a program
column, its expert's weights, read after the wait on the kernel before since the expert id is the router's output);
`fp8_scaled_linear` (per-channel FP8: `--quantization fp8`, compressed-tensors FP8) when `FP8_WGMMA_CHANNEL` is on
(from 2 rows) and `fits_channel`, its activations quantized per token (or tensor) before it, both scales multiplying
the sums at the end (PER_CHANNEL). An MLP's down projection may take gate|up and make its input silu(gate) * up
as it quantizes (GATED, `FP8_WGMMA_GATED`).

Why: fp8_gemv.py's CUDA-core GEMV reads the 8B projections at 50-80% of HBM's 4.2 TB/s (RESULTS.md: gate_up 35.2
us against a 28 us floor, down 23.8 against 14, qkv 9.7 against 6, o 8.7 against 4) and is not issue-bound (27%
fewer instructions measured slower, tenth session): a program holds one 8 KB tile in registers at a time, too few
bytes in flight to cover HBM's latency. Issue 18's FP8 decode at batch 1 sits at 0.74x bf16 (target 0.7x). Here each
program keeps STAGES weight tiles in flight by TMA (2 x 16 KB, 6 programs an SM), and the products run on the
tensor cores: the SMs issue a few instructions per 16 KB instead of ~5.5 per weight.

The product, swapped (weights as wgmma's A, 64 rows a warpgroup instruction; tokens as its N, 8 to 32 columns):
- a program owns BLOCK_N = 128 weight rows (one scale block of rows) and a run of K blocks of 128 (split-K); its
  weight tiles [128, 128] e4m3 come by TMA into a ring of STAGES buffers, each on its own mbarrier; those of the
  first STAGES blocks are asked for before the wait on the kernel before (PDL: weights do not depend on it);
- per K block the activations [BLOCK_T, 128] (bf16, rows past M zero) are loaded, quantized (amax / 448 a row,
  e4m3 by the hardware conversion) and stored to shared memory as B's K-major tile, the next block's while this
  block's wgmma runs (two slots);
- acc_j = W_j xq_j^T in one asynchronous wgmma chain (fp32; `max_num_imprecise_acc` as quant_fp8's
  FP8_DOT_MAX_IMPRECISE_ACC: 0 promotes after each k32 instruction, as the Triton block GEMM does), then acc +=
  acc_j * w_scale[row block, j] * x_scale[token, j];
- split-K as the other decode GEMVs (split_k.SplitKOutputs: fp32 partials, summed by each tile's last program
  or by splitk_reduce); gluon_gemv.store_sums stores.
Rounding against the reference: the same e4m3 values on both sides, the scales applied to each block's fp32 sum (the
reference scales before its product): equal to fp32 summation order, as fp8_gemv.py's.

The kernel and its activation tiles: fp8_wgmma_kernel.py; this module holds the switches it is launched with, the
plan and the launches. Built for sm90 on the CPU machine with Triton 3.6 and 3.9 (scripts/dev/compile_quant_gemv.py
'{"fp8_wgmma": true}'). Measured on an H200 (RESULTS.md twenty-fifth session): tests/gpu/test_fp8_wgmma_gemv_gpu.py, `gpu_check.sh fp8-wgmma`.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from longserve.kernels import split_k
from longserve.kernels.fp8_wgmma_kernel import fp8_wgmma_gemv_kernel
from longserve.kernels.gluon_compat import supported
from longserve.kernels.gluon_gemv import RowNorm, norm_launch_args, one_wave_splits, weight_descriptor
from longserve.kernels.launch import use_pdl
from longserve.kernels.split_k import split_k_output, split_k_outputs

__all__ = [
    "BLOCK",
    "MAX_ROWS",
    "STAGES",
    "fits",
    "fits_channel",
    "fits_routed",
    "gemv",
    "launch",
    "routed_gemv",
    "splits",
    "supported",
]

BLOCK = (128, 128)  # the weight scales' block (rows, K) the kernel takes: a program's rows and a step's K
# activation rows: wgmma's N, 8 to 32 (BLOCK_T); at 64 the sm90 build spills (255 registers: the activations'
# block, its quantized copy, the block's products and the sums), where cuBLAS's block-scaled GEMM serves
MAX_ROWS = 32
# weight tiles in flight a program (16 KB each). Measured on an H200 (2026-12-05, 46763a7, RESULTS.md twenty-fifth
# session), per 8B projection at one row: 2 stages qkv / o / gate_up / down 11.5 / 8.8 / 32.9 / 20.5 us, 4 stages
# 10.7 / 8.9 / 42.3 / 20.8, 6 stages 11.9 / 9.1 / 41.8 / 23.2: at 2 a SM holds 6 programs (one wave splits gate_up's
# 224 tiles in 3), at 4 and 6 it holds 3 and 2 (gate_up unsplit: too few programs in flight).
STAGES = 2
# K blocks a split takes at least (gluon_gemv.one_wave_splits' min_steps): at one row the one wave splits the 8B qkv's
# 32 blocks 16 ways (2 blocks a program, then a serial sum of 16 planes; qkv 11.5 and o 8.8 us against HBM floors of
# 6 and 4). 4 since the thirty-first session (`gpu_check.sh fp8-gated` at 82a0989, H100, GATED off): the 8B decode
# b1@32K 5.32 -> 5.22 ms, b8@4K 6.16 -> 6.01, b16@8K 10.39 -> 10.21 against 1; 2 changed nothing.
MIN_SPLIT_BLOCKS = 4
# Block FP8: each K block's activations asked for two blocks ahead and its weight scale one ahead, in registers
# carried over the loop turn (the first scale before the PDL wait). Why: in the sm90 SASS (Triton 3.6) the wgmma
# chain is waited for before the next block's activations are loaded, and the weight scale after that: two global
# round trips a block in series with the ring, as in the int4 GEMV (int4_mma_gemv.AHEAD, whose one-row GEMVs an H100's
# counters found stalled on long scoreboard, twenty-ninth session). Up to 8 rows (BLOCK_T 8: 55-64 registers against
# 50-56, where shared memory holds 6 programs an SM either way; at 16 rows 100 against 64). On: on an H100 (thirtieth
# session, 2946dd0, `gpu_check.sh fp8-ahead` and `ahead-decodes`, two calls) the 8B block-FP8 decode b1@32K 5.33 /
# 5.34 -> 5.29 ms both times (bf16 7.67), the kernel's GPU tests passing with it (43); 2-8 rows not yet timed.
AHEAD = True
WARPS = 4  # one warpgroup


def _weights_fit(w: torch.Tensor, k: int) -> bool:
    """e4m3 weights [N, K] of whole 128-blocks along K in 16-byte aligned rows (TMA)."""
    return (
        w.dtype == torch.float8_e4m3fn
        and w.shape[1] == k
        and k % BLOCK[1] == 0
        and w.stride(1) == 1
        and w.stride(0) % 16 == 0
        and w.data_ptr() % 16 == 0
    )


def fits(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether the kernel takes this block-FP8 product: bf16 activations of 1 to MAX_ROWS rows, K a multiple of 128,
    128 x 128 scale blocks (any float dtype: `gemv` takes them as float32), 16-byte aligned rows (TMA)."""
    m, k = x.shape
    return (
        x.dtype == torch.bfloat16
        and 1 <= m <= MAX_ROWS
        and x.stride(1) == 1
        and tuple(block) == BLOCK
        and _weights_fit(w, k)
        and tuple(w_scale.shape) == (triton.cdiv(w.shape[0], BLOCK[0]), k // BLOCK[1])
    )


def fits_channel(xq: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> bool:
    """Whether the kernel takes this per-channel product (`scaled_gemm_ref`'s): e4m3 activations quantized per token
    (or tensor) of 1 to MAX_ROWS rows, a scale per output channel."""
    m, k = xq.shape
    return (
        xq.dtype == torch.float8_e4m3fn
        and 1 <= m <= MAX_ROWS
        and xq.stride(1) == 1
        and _weights_fit(w, k)
        and w_scale.numel() == w.shape[0]
    )


def block_t(m: int) -> int:
    """wgmma's N for m rows: 8, 16 or 32."""
    return max(8, triton.next_power_of_2(m))


# Registers of the sm90 builds by BLOCK_T, the most over the variants (Triton 3.6 and 3.9: 38-64 at 8 rows, 80 at 16,
# 126-157 at 32; scripts/dev/compile_quant_gemv.py; 64 at 8 with the serial sum's 4 loads at once or AHEAD), and with
# GATED (64, 86, 134-154). At 8 rows shared memory bounds the programs an SM at 6 either way.
_REGISTERS = {8: 64, 16: 80, 32: 160}
_REGISTERS_GATED = {8: 64, 16: 86, 32: 160}


def resident_programs(sms: int, m: int, gated: bool = False) -> int:
    """Programs the SMs hold at once at m rows: by shared memory (227 KB an SM: STAGES weight tiles, two activation
    slots, the barriers) and by registers (_REGISTERS, 4 warps a program)."""
    smem = STAGES * BLOCK[0] * BLOCK[1] + 2 * block_t(m) * BLOCK[1] + 1024
    regs = 65536 // (WARPS * 32 * (_REGISTERS_GATED if gated else _REGISTERS)[block_t(m)])
    return sms * max(1, min(227 * 1024 // smem, regs))


def splits(n_tiles: int, num_blocks: int, sms: int, m: int, gated: bool = False) -> int:
    """K splits for n_tiles row tiles over num_blocks K blocks: the most that keep one wave, each of at least
    MIN_SPLIT_BLOCKS blocks."""
    return one_wave_splits(n_tiles, num_blocks, resident_programs(sms, m, gated), MIN_SPLIT_BLOCKS)


def _descriptor(w: torch.Tensor) -> TensorDescriptor:
    """The weights' TMA descriptor over w as [rows, K] (the experts' rows one after another), made once per weight
    tensor."""

    def make() -> TensorDescriptor:
        rows = w.view(-1, w.shape[-1])
        layout = gl.NVMMASharedLayout.get_default_for(list(BLOCK), gl.float8e4nv)
        return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), list(BLOCK), layout)

    return weight_descriptor(w, (), make)


def launch(x, x_scales, w, w_scale, bias, blocks_per_split: int, num_splits: int, out, res, locks, stride_os: int,
           serial: bool, bias_in_kernel: bool, imprecise_acc: int, ids=None, x_row_div: int = 1,
           gated: bool = False, norm: RowNorm | None = None) -> None:  # fmt: skip
    """The kernel over a product `fits` (x bf16, x_scales None, w_scale in blocks) or `fits_channel` (x e4m3,
    x_scales [M], w_scale [N]) takes, K in num_splits runs of blocks_per_split blocks: into out [M, N] (one split)
    or its fp32 partials [num_splits, M, N], summed (SERIAL) by each tile's last program into res with the counters
    `locks` (split_k.SplitKOutputs makes these and sums them otherwise). Routed (`ids` [P], `fits_routed`'s experts
    w [E, N, K] and w_scale [E, ceil(N / 128), K / 128]): row p of out is x[p // x_row_div] times expert ids[p]'s.
    gated (block FP8, not routed): x is gate|up [M, 2K] and the product's input silu(gate) * up. norm (one row, one
    split or serial): then the row's residual add and RMSNorm into norm.out (gluon_gemv.norm_row)."""
    k = w.shape[-1]
    assert x.shape[1] == (2 * k if gated else k) and not (gated and (ids is not None or x_scales is not None))
    routed = ids is not None
    m, n = (1, w.shape[1]) if routed else (x.shape[0], w.shape[0])
    per_channel = x_scales is not None
    one_sum = serial or num_splits == 1  # norm: the row's last tile sums its own splits
    assert norm is None or (m == 1 and not routed and one_sum), "norm: one row, its sum here"
    norm_args, norm_constexprs = norm_launch_args(norm, w_scale)
    pdl = use_pdl(x)
    fp8_wgmma_gemv_kernel[(triton.cdiv(n, BLOCK[0]), num_splits, ids.shape[0] if routed else 1)](
        _descriptor(w), x.view(torch.uint8) if per_channel else x, x_scales if per_channel else w_scale,
        w_scale, bias if bias_in_kernel else w_scale, out, res, locks, ids if routed else locks, m, n,
        blocks_per_split, k // BLOCK[1], x.stride(0), 0 if per_channel else w_scale.stride(-2), stride_os,
        out.stride(-2), w_scale.stride(0) if routed else 0, *norm_args, HAS_BIAS=bias_in_kernel,
        PARTIAL=num_splits > 1, SERIAL=serial, BLOCK_T=block_t(m), STAGES=STAGES, IMPRECISE_ACC=imprecise_acc,
        USE_PDL=pdl, PER_CHANNEL=per_channel, num_warps=WARPS, ROUTED=routed, X_ROW_DIV=x_row_div, GATED=gated,
        AHEAD=AHEAD and not per_channel and block_t(m) == 8, **norm_constexprs, launch_pdl=pdl,
    )  # fmt: skip


def gemv(x: torch.Tensor, x_scales: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor,
         bias: torch.Tensor | None, out_dtype: torch.dtype, imprecise_acc: int, gated: bool = False,
         norm: RowNorm | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """[M, N] in out_dtype for a product `fits` takes (x_scales None: `fp8_block_gemm_ref(x, w, w_scale, BLOCK,
    bias)`; gated: of `silu_and_mul(x)`, x = gate|up [M, 2K]) or `fits_channel` does (`scaled_gemm_ref(x, x_scales,
    w, w_scale, out_dtype, bias)`), split K for one wave of programs (split_k.split_k_outputs: the serial sum up to
    its row limit). norm (one row): (normed, new residual) of its residual add and RMSNorm of the product, or None
    where the split's partials would be summed by a launch after (the caller norms)."""
    m, k = x.shape[0], w.shape[1]
    n = w.shape[0]
    n_tiles, num_blocks = triton.cdiv(n, BLOCK[0]), k // BLOCK[1]
    split = splits(n_tiles, num_blocks, split_k.num_sms(x.device.index or 0), m, gated)
    sk = split_k_outputs(num_blocks, split, m, n, n_tiles, out_dtype, x.device)
    if norm is not None and not sk.summed_in_kernel:
        return None
    scales = None if x_scales is None else x_scales.float().reshape(m)
    launch(x, scales, w, w_scale.float().reshape(n) if scales is not None else w_scale.float(), bias,
           sk.tiles_per_split, sk.splits, *sk.pointers(), sk.stride_os, sk.serial, sk.bias_in_kernel(bias),
           imprecise_acc, gated=gated, norm=norm)  # fmt: skip
    return sk.result(bias, out_dtype) if norm is None else norm.results()


def fits_routed(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether `routed_gemv` takes these experts: bf16 activations, e4m3 experts [E, N, K] (contiguous: one
    descriptor over [E x N, K]) with 128 x 128 scale blocks [E, ceil(N / 128), K / 128]."""
    e, n, k = w.shape
    return (
        x.dtype == torch.bfloat16
        and x.stride(1) == 1
        and tuple(block) == BLOCK
        and w.is_contiguous()
        and _weights_fit(w.view(e * n, k), k)
        and tuple(w_scale.shape) == (e, triton.cdiv(n, BLOCK[0]), k // BLOCK[1])
    )


def routed_gemv(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, ids: torch.Tensor, x_row_div: int,
                imprecise_acc: int) -> torch.Tensor:  # fmt: skip
    """Row p = `fp8_block_gemm_ref(x[p // x_row_div], w[ids[p]], w_scale[ids[p]], BLOCK)` (fp8_gemv.fp8_routed_gemv's
    contract: MoE decode, each (token, k) pair through its expert): [P, N] in x's dtype, or with split-K its fp32
    partial sums [S, P, N] (the consumers add them: moe_wna16.silu_mul_partials, moe_sum)."""
    num_rows, (_, n, k) = ids.shape[0], w.shape
    n_tiles, num_blocks = triton.cdiv(n, BLOCK[0]), k // BLOCK[1]
    # the pairs fill the chip along axis 2: split K only as far as one wave of every pair's programs allows
    split = splits(n_tiles * num_rows, num_blocks, split_k.num_sms(x.device.index or 0), 1)
    blocks_per_split, split, out = split_k_output(num_blocks, split, num_rows, n, x.dtype, x.device)
    launch(x, None, w, w_scale.float(), None, blocks_per_split, split, out, out, out,
           out.stride(0) if split > 1 else 0, False, False, imprecise_acc, ids=ids, x_row_div=x_row_div)  # fmt: skip
    return out
