"""FP8 W8A8 GEMVs for decode batch sizes (M up to FP8_GEMV_MAX_BLOCK_M), plus a split-K reduction:
- `fp8_block_gemv`: `fp8_block_gemm_ref`'s product (activations quantized to e4m3 per token-group of the
  block's bk columns, times the e4m3 weights with their 128x128 block scales) in one launch, the activations'
  quantization done inside it;
- `fp8_channel_gemv`: `scaled_gemm_ref`'s (activations already quantized per token or per tensor, weights
  scaled per output channel: compressed-tensors FP8 and `--quantization fp8`), instead of torch._scaled_mm.

Why: at M=1 the block-FP8 linear is two launches, `per_token_group_quant` then the Triton block GEMM on the
tensor cores in 16-row tiles, and read the Llama-3.1-8B gate_up weights (117 MB of e4m3) in 73 us on an H200,
~1.6 TB/s (2026-12-01, benchmarks/RESULTS.md): the 8B FP8 decode at batch 1 (32K) took 0.96x of bf16's time,
against issue 18's target of 0.7x. Read at the bandwidth, the weights would take ~28 us.

Design (quant_gemv.py's, for e4m3 bytes):
- The grid is (N / BLOCK_N, SPLIT_K); a program owns BLOCK_N rows and a run of K tiles of BLOCK_K = bk
  columns (one activation group, one weight scale block along K). The weight tile [BLOCK_N, BLOCK_K] is bytes
  contiguous along K (16-byte vector loads), converted e4m3 -> fp32 in registers.
- Each activation row's tile is quantized where it is used: amax over the group, scale = amax / 448, the row
  divided, clamped and rounded to e4m3 (the hardware conversion; `e4m3_rounded` under the interpreter), as
  `per_token_group_quant` does. Every program repeats this for its tiles: M x K values, a few KB.
- Products on the CUDA cores: the e4m3 x e4m3 products are exact in fp32 and summed in fp32 along the tile;
  the tile's sum is scaled by the row's activation scale and each weight row's block scale. SPLIT_K > 1
  writes fp32 partial sums, added in a fixed order by quant_gemv's reduction (deterministic, no atomics).
- Rounding against the reference: the same e4m3 values on both sides; the reference scales before its fp32
  product, this kernel after each tile's sum, so the two agree to fp32 rounding and summation order.

Per channel, the activations come quantized (`per_token_group_quant`: their scale spans all of K, which a
program does not see) and both scales multiply each program's sums once.

No host syncs: CUDA graphs capture both launches. `FP8_GEMV_MAX_TOKENS` (kernels/quant_fp8.py) routes
`fp8_block_linear` and `fp8_scaled_linear` here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels.extend_attention import interpreting
from longserve.kernels.gemv_tables import tuned_gemv_config
from longserve.kernels.launch import pdl_prologue, use_pdl
from longserve.kernels.quant_gemv import pow2_at_most
from longserve.kernels.quant_reference import FP8_MAX
from longserve.kernels.quant_tiles import e4m3_rounded, store_gemv_out
from longserve.kernels.split_k import split_k_output, split_k_outputs, splits_for

__all__ = [
    "FP8_GEMV_MAX_BLOCK_M",
    "fp8_block_gemv",
    "fp8_block_gemv_supported",
    "fp8_channel_gemv",
    "fp8_gemv_config",
    "fp8_routed_gemv",
]

FP8_GEMV_MAX_BLOCK_M = 16  # the most activation rows: each one is a pass over the weight tile in registers
_E4M3_MAX = tl.constexpr(FP8_MAX)  # 448.0, as a constant the compiler may read


@triton.jit
def _fp8_tile_load(w_rows, s_rows, offs_k, valid, t, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   PER_CHANNEL: tl.constexpr):  # fmt: skip
    """Tile t's e4m3 bytes [BLOCK_N, BLOCK_K] and (block FP8) its rows' scales [BLOCK_N] (per channel: zeros,
    unused), rows where `valid`."""
    cols = t * BLOCK_K + offs_k  # [BLOCK_K]
    if EVEN_K:
        wb = tl.load(w_rows + cols[None, :], mask=valid[:, None], other=0)
    else:
        wb = tl.load(w_rows + cols[None, :], mask=valid[:, None] & (cols < K)[None, :], other=0)
    if PER_CHANNEL:  # the scales multiply the sums after the loop
        w_scale = tl.zeros(valid.shape, dtype=tl.float32)
    else:
        w_scale = tl.load(s_rows + t, mask=valid, other=0.0)  # [BLOCK_N]
    return wb, w_scale


@triton.jit
def _activation_tile(x_cols, x_ok, PER_CHANNEL: tl.constexpr, INTERPRET: tl.constexpr):
    """An activation row's tile as e4m3 values in fp32 and its scale: per channel quantized already (the scales
    multiply the sums after the loop; scale 1), else a group quantized here as per_token_group_quant does."""
    if PER_CHANNEL:
        xq = tl.load(x_cols, mask=x_ok, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return xq, 1.0
    xm = tl.load(x_cols, mask=x_ok, other=0.0).to(tl.float32)
    x_scale = tl.maximum(tl.max(tl.abs(xm)), 1e-10) / _E4M3_MAX
    xq = tl.minimum(tl.maximum(xm / x_scale, -_E4M3_MAX), _E4M3_MAX)
    if INTERPRET:  # the interpreter's fp32 -> e4m3 cast mis-rounds (quant_tiles.e4m3_rounded)
        xq = e4m3_rounded(xq)
    else:
        xq = xq.to(tl.float8e4nv).to(tl.float32)
    return xq, x_scale


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [M, K] 16- or 32-bit; PER_CHANNEL: e4m3, read as uint8
    xs_ptr,  # PER_CHANNEL: [M] float32 activation scales (per token, or one per tensor repeated)
    w_ptr,  # [N, K] e4m3, read as uint8
    s_ptr,  # float32 weight scales: [ceil(N / bn), ceil(K / bk)] blocks, or (PER_CHANNEL) [N]
    b_ptr,  # [N] bias (HAS_BIAS, not PARTIAL; with SERIAL, added by the last split)
    out_ptr,  # [M, N] in the output dtype, or (PARTIAL) [splits, M, N] float32 partial sums
    res_ptr,  # SERIAL: [M, N] in the output dtype, the partials' sum (quant_tiles.store_gemv_out)
    lock_ptr,  # SERIAL: int32 counters, one per column tile, zero
    ids_ptr,  # ROUTED: [P] int32, each output row's expert
    M, N, K, block_n, tiles_per_split, num_tiles,
    stride_xm, stride_xsm, stride_wn, stride_sn, stride_om, stride_os, stride_we, stride_se,
    PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
    INTERPRET: tl.constexpr, INTERPRET_BF16: tl.constexpr, USE_PDL: tl.constexpr, SERIAL: tl.constexpr,
    ROUTED: tl.constexpr, X_ROW_DIV: tl.constexpr,
):  # fmt: skip
    pdl_prologue(USE_PDL)  # before the routed expert id (the router's output) and x
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    if ROUTED:  # MoE decode (moe_fp8_gemv.py): one row a program along axis 2, a (token, k) pair's expert
        row = tl.program_id(2).to(tl.int64)
        expert = tl.load(ids_ptr + row).to(tl.int64)
        w_ptr += expert * stride_we
        s_ptr += expert * stride_se
        x_ptr += (row // X_ROW_DIV) * stride_xm
        out_ptr += row * stride_om
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n[:, None] * stride_wn  # [BLOCK_N, 1]
    s_rows = (
        s_ptr + (offs_n // block_n) * stride_sn
    )  # [BLOCK_N]: each row's block of scales (block_n 1: its own)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # rows along dim 0, as the K reduction leaves them
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    # Register double-buffering of the next tile (prefetch) was tried and measured slower on an H200 (ninth
    # session, RESULTS.md): Triton pipelines only loads that feed a tl.dot.
    # One-row tile accumulation (products in a [BLOCK_N, BLOCK_K] tile, reduced after the loop) was slower
    # on an H200 despite sm90 SASS 5.53 -> 4.03 a weight (e9be5b7: M=1 gate_up 35.2 -> 44.0 us, down 23.8 ->
    # 30.5 us; 8B decode b1@32K 4.57 -> 5.03 ms): removed.
    for t in range(t_begin, t_end):
        cols = t * BLOCK_K + offs_k  # [BLOCK_K]
        k_ok = cols < K
        wb, w_scale = _fp8_tile_load(w_rows, s_rows, offs_k, n_mask, t, K, BLOCK_K, EVEN_K, PER_CHANNEL)
        w = wb.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # [BLOCK_N, BLOCK_K], exact
        for mi in tl.static_range(BLOCK_M):
            x_ok = k_ok & ((cols * 0 + mi) < M)
            xq, x_scale = _activation_tile(x_ptr + mi * stride_xm + cols, x_ok, PER_CHANNEL, INTERPRET)
            part = tl.sum(w * xq[None, :], axis=1)  # [BLOCK_N]
            if not PER_CHANNEL:
                part = part * (w_scale * x_scale)
            if BLOCK_M == 1:
                acc += part[:, None]
            else:
                acc += tl.where(offs_m[None, :] == mi, part[:, None], 0.0)
    if PER_CHANNEL:  # sum_k xq w * x_scale * w_scale, as scaled_gemm_ref
        x_scales = tl.load(xs_ptr + offs_m * stride_xsm, mask=offs_m < M, other=0.0)  # [BLOCK_M]
        acc = acc * x_scales[None, :] * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
    out_off = offs_m[None, :] * stride_om + offs_n[:, None]
    out_mask = (offs_m < M)[None, :] & n_mask[:, None]
    store_gemv_out(out_ptr, acc, out_off, out_mask, b_ptr, offs_n[:, None], n_mask[:, None], pid_k, stride_os,
                   res_ptr, lock_ptr, HAS_BIAS, PARTIAL, INTERPRET_BF16, SERIAL)  # fmt: skip


def fp8_block_gemv_supported(m: int, block: tuple[int, int]) -> bool:
    """Whether the GEMV takes this product: up to FP8_GEMV_MAX_BLOCK_M rows, a power-of-two bk of at least 16
    (one tile per activation group)."""
    bk = block[1]
    return 1 <= m <= FP8_GEMV_MAX_BLOCK_M and bk >= 16 and bk & (bk - 1) == 0


def fp8_gemv_config(
    m: int, n: int, k: int, block_k: int, device: torch.device, kernel: str
) -> dict[str, int]:
    """The tiles of gemv_tables' entry for (kernel, N, K, M) on this GPU where one was timed, else defaults:
    tiles of block_k columns (one activation group for block FP8); BLOCK_N so that a tile holds ~8K weights (64
    bytes a thread at 4 warps: four 16-byte loads), fewer from 4 rows on (the products of every row live beside
    the tile); SPLIT_K for ~8 programs per SM."""
    block_m = triton.next_power_of_2(m)
    budget = 8192 if block_m <= 4 else 4096
    block_n = max(16, min(128, pow2_at_most(budget // block_k), triton.next_power_of_2(n)))
    num_tiles = triton.cdiv(k, block_k)
    split_k = splits_for(device, triton.cdiv(n, block_n), num_tiles)
    cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "num_warps": 4,
           "num_stages": 2}  # fmt: skip
    return {**cfg, **(tuned_gemv_config(kernel, n, k, m, device) or {})}


def _launch(
    x: torch.Tensor,  # [M, K]: 16/32-bit, or e4m3 (x_scales given)
    x_scales: torch.Tensor | None,  # [M] float32 (per channel)
    w: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # float32 blocks [ceil(N / bn), ceil(K / bk)], or [N, 1] per channel
    block_n: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    cfg: dict[str, int],
) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    num_tiles = triton.cdiv(k, cfg["BLOCK_K"])
    n_tiles = triton.cdiv(n, cfg["BLOCK_N"])
    sk = split_k_outputs(num_tiles, cfg["SPLIT_K"], m, n, n_tiles, out_dtype, x.device)
    interp = interpreting()
    interpret_bf16 = interp and out_dtype == torch.bfloat16
    per_channel = x_scales is not None
    xs = x_scales if per_channel else w_scale
    pdl = use_pdl(x)
    _fp8_gemv_kernel[(n_tiles, sk.splits)](
        x.view(torch.uint8) if per_channel else x, xs, w.view(torch.uint8), w_scale,
        bias if bias is not None else w_scale, *sk.pointers(), w_scale, m, n, k, block_n, sk.tiles_per_split,
        num_tiles, x.stride(0), xs.stride(0), w.stride(0), w_scale.stride(0), sk.out.stride(-2), sk.stride_os, 0, 0,
        PER_CHANNEL=per_channel, HAS_BIAS=sk.bias_in_kernel(bias), EVEN_K=k % cfg["BLOCK_K"] == 0,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], PARTIAL=sk.partial,
        INTERPRET=interp, INTERPRET_BF16=interpret_bf16, USE_PDL=pdl, SERIAL=sk.serial, ROUTED=False,
        X_ROW_DIV=1, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=pdl,
    )  # fmt: skip
    return sk.result(bias, out_dtype)


def fp8_routed_gemv(
    x: torch.Tensor,  # [rows, K]
    w: torch.Tensor,  # [E, N, K] e4m3
    w_scale: torch.Tensor,  # [E, ceil(N / bn), ceil(K / bk)] float32
    block: tuple[int, int],
    ids: torch.Tensor,  # [P] int32: each output row's expert
    x_row_div: int,  # output row p reads x row p // x_row_div
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Row p = `fp8_block_gemm_ref(x[p // x_row_div], w[ids[p]], w_scale[ids[p]], block)` (MoE decode: each
    (token, k) pair through its expert): [P, N] in x's dtype, or with split-K its fp32 partial sums [S, P, N]
    (the consumers add them: moe_wna16.silu_mul_partials, moe_sum). One program row a pair (BLOCK_M 1)."""
    num_rows, (_, n, k) = ids.shape[0], w.shape
    assert fp8_block_gemv_supported(1, block) and k % block[1] == 0, (
        f"routed FP8 GEMV of K={k}, block {block}"
    )
    assert w_scale.shape == (w.shape[0], triton.cdiv(n, block[0]), k // block[1]), tuple(w_scale.shape)
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.is_contiguous() else w.contiguous()
    w_scale = w_scale.float().contiguous()
    cfg = dict(fp8_gemv_config(1, n, k, block[1], x.device, f"fp8_block_gemv_bk{block[1]}"), **(config or {}))
    num_tiles = k // block[1]
    n_tiles = triton.cdiv(n, cfg["BLOCK_N"])
    # the pairs fill the chip along axis 2: split K only as far as a lone row's GEMV would, over the pairs
    split = splits_for(x.device, n_tiles * num_rows, num_tiles) if config is None else cfg["SPLIT_K"]
    tiles_per_split, split, out = split_k_output(num_tiles, split, num_rows, n, x.dtype, x.device)
    pdl = use_pdl(x)
    _fp8_gemv_kernel[(n_tiles, split, num_rows)](
        x, w_scale, w.view(torch.uint8), w_scale, w_scale, out, out, out, ids, 1, n, k, block[0], tiles_per_split,
        num_tiles, x.stride(0), 0, w.stride(1), w_scale.stride(1), out.stride(-2), out.stride(0) if split > 1 else 0,
        w.stride(0), w_scale.stride(0),
        PER_CHANNEL=False, HAS_BIAS=False, EVEN_K=True, BLOCK_M=1, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block[1],
        PARTIAL=split > 1, INTERPRET=interpreting(), INTERPRET_BF16=interpreting() and x.dtype == torch.bfloat16,
        USE_PDL=pdl, SERIAL=False, ROUTED=True, X_ROW_DIV=x_row_div, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], launch_pdl=pdl,
    )  # fmt: skip
    return out


def fp8_block_gemv(
    x: torch.Tensor,  # [M, K]
    w: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """[M, N] in x's dtype: `fp8_block_gemm_ref(x, w, w_scale, block, bias)` (module docstring: rounding)."""
    m, k = x.shape
    n = w.shape[0]
    assert fp8_block_gemv_supported(m, block), f"FP8 GEMV of M={m}, block {block}"
    assert w.shape[1] == k and w_scale.shape == (triton.cdiv(n, block[0]), triton.cdiv(k, block[1])), (
        f"w {tuple(w.shape)}, scales {tuple(w_scale.shape)} for K={k}, block {block}"
    )
    kernel = f"fp8_block_gemv_bk{block[1]}"  # gemv_tables' name: the tiles depend on the activation group
    cfg = dict(fp8_gemv_config(m, n, k, block[1], x.device, kernel), **(config or {}))
    assert cfg["BLOCK_K"] == block[1] and cfg["BLOCK_M"] >= m, cfg
    return _launch(x, None, w, w_scale.float(), block[0], bias, x.dtype, cfg)


def fp8_channel_gemv(
    xq: torch.Tensor,  # [M, K] e4m3
    x_scale: torch.Tensor,  # [M, 1] float32 (per token, or a per-tensor scale expanded)
    w: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [N] float32 per output channel
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """[M, N] in out_dtype: `scaled_gemm_ref(xq, x_scale, w, w_scale, out_dtype, bias)` to fp32 summation."""
    m, k = xq.shape
    n = w.shape[0]
    assert (
        1 <= m <= FP8_GEMV_MAX_BLOCK_M and w.shape[1] == k and x_scale.numel() == m and w_scale.numel() == n
    )
    cfg = dict(fp8_gemv_config(m, n, k, 128, xq.device, "fp8_channel_gemv"), **(config or {}))
    assert cfg["BLOCK_M"] >= m, cfg
    scales = w_scale.float().reshape(n, 1)  # one scale per row: "blocks" of one row
    return _launch(xq, x_scale.float().reshape(m), w, scales, 1, bias, out_dtype, cfg)
