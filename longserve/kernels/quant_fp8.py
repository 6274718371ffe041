"""FP8 (e4m3) linear layers on the GPU, and the activations' quantization that INT8 W8A8 shares
(kernels/int8_linear.py); references: kernels/quant_reference.py (same signatures and arithmetic).

- `per_token_group_quant`: a Triton kernel that quantizes activations at run time, per token-group (128 for
  the DeepSeek/Qwen3 FP8 block recipe) or per token (group = K), to e4m3 or int8, writing float32 scales.
- `fp8_block_linear`: block-scaled FP8 (weight_scale_inv per 128x128 block, activations per 1x128 group).
  Two ways: torch's `F.scaled_mm` with cuBLAS's BlockWise1x128 / BlockWise128x128 recipes (Hopper, 128x128
  blocks only), or the Triton block GEMM below (any block). FP8_BLOCK_USE_SCALED_MM allows the former where
  it applies and a load-time check agrees with the Triton kernel, from FP8_BLOCK_SCALED_MM_MIN_TOKENS rows on
  (below them the Triton kernel is faster: scripts/gpu/bench_quant_kernels.py times both).
- `fp8_scaled_linear`: per-channel (or per-tensor, expanded to channels) weight scales and per-token (or
  static per-tensor) activation scales through `torch._scaled_mm` (rowwise scaling) for bf16, the Triton
  block GEMM with one block per row for other dtypes.

No host syncs: every size is a Python int of the shapes (CUDA graphs capture these).
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from longserve.kernels.activation import silu_and_mul, silu_and_mul_quant
from longserve.kernels.extend_attention import interpreting
from longserve.kernels.fp8_gemv import (
    FP8_GEMV_MAX_BLOCK_M,
    fp8_block_gemv,
    fp8_block_gemv_supported,
    fp8_channel_gemv,
)
from longserve.kernels.launch import fast_launch, pdl_prologue, use_pdl
from longserve.kernels.quant_reference import (
    FP8_DTYPE,
    FP8_MAX,
    INT8_QDIV,
    fp8_block_gemm_ref,
    per_token_group_quant_fp8_ref,
    per_token_quant_int8_ref,
    scaled_gemm_ref,
)
from longserve.kernels.quant_tiles import e4m3_rounded, groups_per_program, quant_outputs, rounded

__all__ = [
    "FP8_BLOCK_USE_SCALED_MM",
    "fp8_block_gemm",
    "fp8_block_gemm_ref",
    "fp8_block_linear",
    "fp8_scaled_linear",
    "per_token_group_quant",
    "per_token_group_quant_fp8_ref",
    "per_token_quant_int8_ref",
    "scaled_gemm_ref",
]

logger = logging.getLogger("longserve.kernels.quant_fp8")

# cuBLAS block-scaled FP8 where it applies (Hopper, 128x128 blocks), checked at load time against the Triton
# block GEMM (check_block_scaled_mm); False: always Triton.
FP8_BLOCK_USE_SCALED_MM = True
# ... and only from this many rows. Timed as CUDA-graph replays on an H200 (2026-12-02, 95cf20e,
# bench_quant_kernels.py --tokens 1,2,4,8,16; RESULTS.md sixth session), cuBLAS takes the four Llama-3.1-8B
# projections in 105.6 us at M=2 against the Triton block GEMM's 143.5, and 94.4 against 121.8 at M=16 (down,
# K=14336: 25.9 against 58.5); M=1 goes to the GEMV (FP8_GEMV_MAX_TOKENS). The earlier 256 came from eager
# timings (2026-12-01, 55ae18c), which at small M measured launch time; cuBLAS wins from M=256 on either way.
FP8_BLOCK_SCALED_MM_MIN_TOKENS = 2
# Passed as `max_num_imprecise_acc` to the fp8 tensor-core dots of the Triton block GEMM and the fused MoE
# kernel. None would be Triton's default, which on sm90 lets a whole dot (one BLOCK_K of at most 128) accumulate
# at the tensor cores' reduced precision; 0: full fp32 accumulation. Measured on an H200 (2026-12-02, 73be6a4,
# tests/gpu/test_quant_engine_gpu.py -k "fp8 or ct-int8" under scripts/probes/with_constants.py): with None the
# three fp8-activation formats' first-step logprobs drift 0.16-0.23 from the torch reference (bound 0.1) and
# the tests fail; with 0 all pass (64 fails too). The cost (RESULTS.md seventeenth session): the A3B FP8 cold 32K
# 1.277 s at 0 against 1.132 at None. Why (sm90 builds with Triton 3.6, scripts/dev/count_moe_sass.py, the MoE
# kernel at the H200 table's prefill tiles): at 0 Triton builds the fp8 dots as mma.sync on fp16 operands (128
# HMMA and 192 F2FP conversions a loop, no FP8 tensor core), at 32 / 64 / None as wgmma on e4m3 (QGMMA; 32
# promotes after each k32, as fp8_wgmma_gemv does with 0, and its GEMV's engine tests pass); with one weight scale
# a tile (66d642c) the loop holds 526 instructions at 0, 390 at 32, 175 at None. 32 and None in the engine:
# `gpu_check.sh a3b-fp8-prefill`; what each costs in quality against bf16: `gpu_check.sh fp8-acc-quality`.
FP8_DOT_MAX_IMPRECISE_ACC: int | None = 0
# sm90's fp8 tensor-core dot takes K steps of at least 32 (Triton refuses tl.dot on e4m3 with K < 32: "K >= 32"):
# a scale block narrower than that (the config allows multiples of 16) multiplies its e4m3 values in fp32, exactly
# (the interpreted tests' 16-wide blocks among them; sm90 builds of both in CI's compile check).
FP8_DOT_MIN_K = 32
# FP8 of at most this many rows runs as kernels/fp8_gemv.py's GEMVs (the weights read on the CUDA cores, split
# K; block FP8 with the activations' quantization inside) instead of the 16-row tensor-core GEMM (block FP8;
# read the 8B gate_up weights at ~1.6 TB/s at M=1, 2026-12-01) or torch._scaled_mm (per channel: 0.071 ms for
# gate_up at M=1 against bf16's 0.059, same call). Measured on an H200 as CUDA-graph replays (2026-12-02,
# 95cf20e, `gpu_check.sh quant-decode`, RESULTS.md sixth session): the GEMVs win at M=1 at every 8B projection
# (block gate_up 39.3 us against the Triton GEMM's 55.5 and cuBLAS's 42.1) but the block GEMV loses gate_up from
# M=2 (59.6 against 52.7): 1. The 8B decode at batch 1 (32K): block FP8 6.76 -> 4.87 ms, per channel 6.00 -> 4.76.
FP8_GEMV_MAX_TOKENS = 1
# FP8 GEMVs of up to fp8_wgmma_gemv.MAX_ROWS 16-bit rows on the tensor cores, the weights through a TMA ring
# (kernels/fp8_wgmma_gemv.py: Gluon), before the routes above and below: fp8_gemv.py reads the 8B projections at
# 50-80% of HBM's rate. Measured on an H200 (2026-12-05, 46763a7, `gpu_check.sh fp8-wgmma`, RESULTS.md twenty-fifth
# session; its GPU tests pass), per projection with weights from HBM it wins at qkv, o and down at every row count
# (down at 8 rows 26.7 against 58.8 us) and, at 4 stages a program, loses gate_up (42.3 against 35.1 at one row: 224
# programs of 32 blocks; 32.9 at 2 stages, STAGES). In the 8B decode with both on: block FP8 b1@32K 4.18 -> 4.25
# ms, b8@4K 5.45 -> 4.93, b16@8K 7.70 -> 8.53, b32@4K 9.44 -> 9.92; per channel b1 4.25 -> 4.31, b16 8.68 -> 7.80.
# At 2 stages (twenty-sixth session, 0aed29a, `gpu_check.sh fp8-block-decode`): block FP8 b1@32K 4.21 -> 4.06 ms
# (bf16 5.63), b8@4K 5.49 -> 4.70, b16@8K 7.76 -> 7.61, b32@4K 9.43 -> 9.73; so block FP8 on up to
# FP8_WGMMA_MAX_ROWS rows. The routed experts (moe_fp8_gemv, one row a pair; 2b1e2c7, `gpu_check.sh fp8-wgmma-moe`):
# the A3B expert block 21.7 -> 19.6 us at 1 token, 54.4 -> 41.3 at 4, 160.9 -> 128.8 at 16, the A3B FP8 decode b1@32K
# 4.04 -> 3.97 ms, b8@4K 8.13 -> 7.40 (with its attention projections on it too). Per channel on from
# FP8_WGMMA_CHANNEL_MIN_ROWS rows. Imported only when on.
FP8_WGMMA_GEMV = True
FP8_WGMMA_MAX_ROWS = 16
# The down projection's input, silu(gate) * up, made by the wgmma GEMV from gate|up as it quantizes its activations
# (fp8_wgmma_gemv GATED) instead of by activation.silu_and_mul's launch before it: one launch less a layer, ~2-3 us
# at one row (the SiLU kernel's own work; its span in a b1 decode profile holds the GEMV's wait). On since the
# thirty-first session (`gpu_check.sh fp8-gated` at 82a0989, H100, its GPU tests passing): the 8B decode b1@32K
# 5.32 -> 5.22 ms, b8@4K 6.16 -> 5.97, b16@8K 10.39 either way.
FP8_WGMMA_GATED = True
FP8_WGMMA_CHANNEL = True
FP8_WGMMA_CHANNEL_MIN_ROWS = 2
# A block-FP8 down projection's input, silu(gate) * up, made and quantized in one pass
# (activation.silu_and_mul_quant, bit-equal to the two kernels) instead of silu_and_mul writing the product and
# per_token_group_quant reading it back: at a 8K-token chunk of the Llama-3.1-8B shape 470 MB less traffic a
# layer. On an H200 (`gpu_check.sh silu-quant`, 0949067, RESULTS.md thirteenth session): the 8B FP8 cold 32K
# 1.0009 -> 0.9912 s, decode b64@4K 12.69 -> 12.59 ms.
FUSE_SILU_AND_MUL_QUANT = True


@fast_launch
@triton.jit
def _group_quant_kernel(
    x_ptr, q_ptr, s_ptr, static_ptr, K, group_size, num_groups, stride_xm, stride_qm, stride_sm, stride_sg,
    QMAX: tl.constexpr, OUT_INT8: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr, GPP: tl.constexpr,
    INTERPRET: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """One program per (token, GPP groups): per group scale = amax / QMAX (or the static one), q = x / scale,
    clamped and rounded to e4m3 or int8 (nearest, ties to even)."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GPP + tl.arange(0, GPP)  # [GPP]
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    offs = groups[:, None] * group_size + cols[None, :]  # [GPP, BLOCK]
    mask = (offs < K) & (cols < group_size)[None, :] & (groups < num_groups)[:, None]
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.full([GPP], 1.0, tl.float32) * tl.load(static_ptr).to(tl.float32)
    else:
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / QMAX  # [GPP]
    y = x / scale[:, None]
    if OUT_INT8:  # round half to even (torch.round), clamp to [-128, 127]
        r = tl.floor(y + 0.5)
        r = tl.where((r - y == 0.5) & ((r.to(tl.int32) & 1) == 1), r - 1.0, r)
        y = tl.minimum(tl.maximum(r, -128.0), 127.0)
    else:
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if INTERPRET:
            y = e4m3_rounded(y)
    tl.store(q_ptr + row * stride_qm + offs, y.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups < num_groups)


def per_token_group_quant(
    x: torch.Tensor,  # [M, K]
    group_size: int,  # <= 0: per token (one group of K)
    dtype: torch.dtype = FP8_DTYPE,
    static_scale: torch.Tensor | None = None,  # [1] float32: a per-tensor scale instead of computed ones
    column_major_scales: bool = False,  # scales stored [G, M] (returned transposed): cuBLAS block recipes
) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized [M, K] in `dtype` (e4m3 or int8), float32 scales [M, G]): equals
    per_token_group_quant_fp8_ref / per_token_quant_int8_ref."""
    m, k = x.shape
    group = group_size if group_size > 0 else k
    groups = triton.cdiv(k, group) if static_scale is None else 1
    x = x if x.stride(1) == 1 else x.contiguous()
    q, scales = quant_outputs(m, k, groups, dtype, x.device, column_major_scales)
    if m == 0:
        return q, scales
    out_int8 = dtype == torch.int8
    launch_groups = triton.cdiv(k, group)
    if static_scale is not None:  # every group of a row shares the one scale: write it once
        scales_arg, stride_sg = scales, 0
    else:
        scales_arg, stride_sg = scales, scales.stride(1)
    block = triton.next_power_of_2(group)
    gpp = groups_per_program(block, launch_groups)
    pdl = use_pdl(x)
    _group_quant_kernel[(m, triton.cdiv(launch_groups, gpp))](
        x, q, scales_arg, static_scale if static_scale is not None else x, k, group, launch_groups,
        x.stride(0), q.stride(0), scales_arg.stride(0), stride_sg,
        QMAX=INT8_QDIV if out_int8 else FP8_MAX, OUT_INT8=out_int8, STATIC=static_scale is not None,
        BLOCK=block, GPP=gpp, INTERPRET=interpreting(), USE_PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    return q, scales


@triton.jit
def _fp8_block_gemm_kernel(
    a_ptr, a_s_ptr, b_ptr, b_s_ptr, c_ptr, bias_ptr, M, N, K,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr, INTERPRET_BF16: tl.constexpr, MAX_IMPRECISE_ACC: tl.constexpr,
):  # fmt: skip
    """c [M, N] = sum over K blocks of (a_blk . b_blk^T) * a_scale[m, kb] * b_scale[n // GROUP_N, kb]
    (BLOCK_K divides GROUP_K: one scale per tile along K)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    rows_m = tl.where(m_mask, offs_m, 0)
    rows_n = tl.where(n_mask, offs_n, 0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + rows_m[:, None] * stride_am + offs_k[None, :], mask=k_mask[None, :], other=0.0)
        b = tl.load(b_ptr + rows_n[None, :] * stride_bn + offs_k[:, None], mask=k_mask[:, None], other=0.0)
        a_s = tl.load(a_s_ptr + rows_m * stride_asm + k0 // GROUP_K)  # [BLOCK_M]
        b_s = tl.load(b_s_ptr + (rows_n // GROUP_N) * stride_bsn + k0 // GROUP_K)  # [BLOCK_N]
        if FP32_DOT:  # a K step under FP8_DOT_MIN_K: e4m3 values are exact in fp32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, max_num_imprecise_acc=MAX_IMPRECISE_ACC) * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_n).to(tl.float32)[None, :]
    c_ty = c_ptr.dtype.element_ty
    c = rounded(acc, c_ty, INTERPRET_BF16)
    tl.store(
        c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :],
        c.to(c_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def fp8_block_gemm(
    xq: torch.Tensor,  # [M, K] e4m3
    x_scale: torch.Tensor,  # [M, K / bk] float32
    w: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32
    block: tuple[int, int],
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton block-scaled FP8 GEMM: [M, N] in out_dtype."""
    m, k = xq.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    block_k = 128  # a power of two dividing the scale block's k (one scale per tile), at least 16 for tl.dot
    while block[1] % block_k and block_k > 16:
        block_k //= 2
    assert block[1] % block_k == 0, f"the scale block's k ({block[1]}) must be a multiple of 16"
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 64 else 128
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_block_gemm_kernel[grid](
        xq, x_scale, w, w_scale, out, bias if bias is not None else out, m, n, k,
        xq.stride(0), x_scale.stride(0), w.stride(0), w_scale.stride(0), out.stride(0),
        GROUP_N=block[0], GROUP_K=block[1], HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP32_DOT=block_k < FP8_DOT_MIN_K,
        INTERPRET_BF16=interpreting() and out_dtype == torch.bfloat16,
        MAX_IMPRECISE_ACC=FP8_DOT_MAX_IMPRECISE_ACC, num_warps=4, num_stages=3,
    )  # fmt: skip
    return out


@functools.cache
def _scaled_mm_blockwise_ok(device_index: int) -> bool:
    """cuBLAS block-scaled FP8 (torch's F.scaled_mm BlockWise recipes) needs Hopper (sm90) exactly."""
    if not hasattr(torch.nn.functional, "scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device_index) == (9, 0)


_BLOCK_SCALED_MM_CHECKED: dict[int, bool] = {}


def check_block_scaled_mm(w: torch.Tensor, w_scale: torch.Tensor) -> bool:
    """Whether cuBLAS's block-scaled FP8 (F.scaled_mm) computes what the Triton block GEMM does on this GPU, for
    a weight of 128x128 blocks: tried once per device at load time (eager, before any CUDA graph), on a small
    input; on an error or a mismatch the Triton kernel serves every block-FP8 layer (logged)."""
    device = w.device.index or 0
    if device in _BLOCK_SCALED_MM_CHECKED:
        return _BLOCK_SCALED_MM_CHECKED[device]
    if w.shape[0] % 128 or w.shape[1] % 128:
        return False  # this weight never takes the cuBLAS path: check with the next one
    ok = False
    if FP8_BLOCK_USE_SCALED_MM and _scaled_mm_blockwise_ok(device):
        try:
            ok = True
            for m in (1, 32):  # a decode step and a chunk: both must work before every step relies on it
                x = torch.randn(m, w.shape[1], device=w.device, dtype=torch.bfloat16)
                got = fp8_block_linear(x, w, w_scale, (128, 128), use_scaled_mm=True).float()
                want = fp8_block_linear(x, w, w_scale, (128, 128), use_scaled_mm=False).float()
                ok = ok and bool(((got - want).norm() / want.norm().clamp(min=1e-12)) < 1e-2)
        except (RuntimeError, ValueError, TypeError) as e:
            ok = None
            logger.warning(
                "block-scaled FP8 through F.scaled_mm failed (%s): the Triton block GEMM serves", e
            )
        if ok is False:
            logger.warning("block-scaled FP8 through F.scaled_mm disagrees with the reference: Triton serves")
    _BLOCK_SCALED_MM_CHECKED[device] = bool(ok)
    return bool(ok)


def wgmma_imprecise_acc(block_k: int) -> int:
    """FP8_DOT_MAX_IMPRECISE_ACC for fp8_wgmma_gemv's wgmma: 0 (fp32 accumulation) promotes after each k32
    instruction, the least Gluon's fp8 wgmma takes; None: once a block of block_k."""
    acc = FP8_DOT_MAX_IMPRECISE_ACC
    return block_k if acc is None else max(32, acc)


def wgmma_takes(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int], gated: bool = False
) -> bool:
    """Whether the block-FP8 wgmma GEMV (fp8_wgmma_gemv.py, FP8_WGMMA_GEMV up to FP8_WGMMA_MAX_ROWS rows) takes
    x [M, K] (gated: gate|up [M, 2K], asked as its silu * up will be: rows, dtype, strides) times w."""
    if not (FP8_WGMMA_GEMV and x.shape[0] <= FP8_WGMMA_MAX_ROWS and x.is_cuda):
        return False
    from longserve.kernels import fp8_wgmma_gemv as wg

    k = x.shape[1] // 2 if gated else x.shape[1]
    return wg.supported() and wg.fits(x[:, :k], w, w_scale, block)


def fp8_block_linear(
    x: torch.Tensor,  # [M, K], or (gated) gate|up [M, 2K]
    w: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    use_scaled_mm: bool | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """Block FP8 linear: x quantized per token-group of bk (Triton), then the block-scaled GEMM; equals
    fp8_block_gemm_ref. Up to FP8_GEMV_MAX_TOKENS rows: both in one GEMV (kernels/fp8_gemv.py). gated: the input
    is silu(gate) * up of x = gate|up (an MLP's down projection), computed in the quantizing pass
    (activation.silu_and_mul_quant; FUSE_SILU_AND_MUL_QUANT) or, for the GEMV, first."""
    m, k = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    n = w.shape[0]
    if wgmma_takes(x, w, w_scale, block, gated):
        from longserve.kernels import fp8_wgmma_gemv as wg

        imprecise = wgmma_imprecise_acc(wg.BLOCK[1])
        inside = gated and FP8_WGMMA_GATED  # silu(gate) * up made by the kernel from gate|up
        a = silu_and_mul(x) if gated and not inside else x
        return wg.gemv(a, None, w, w_scale, bias, x.dtype, imprecise, gated=inside)
    if m <= FP8_GEMV_MAX_TOKENS and fp8_block_gemv_supported(m, block):
        return fp8_block_gemv(silu_and_mul(x) if gated else x, w, w_scale, block, bias)
    if gated and (not FUSE_SILU_AND_MUL_QUANT or block[1] & (block[1] - 1)):  # the fused kernel: 2^n groups
        x, gated = silu_and_mul(x), False

    def quantize(a: torch.Tensor, column_major_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if gated:
            return silu_and_mul_quant(a, block[1], column_major_scales)
        return per_token_group_quant(a, block[1], column_major_scales=column_major_scales)

    if use_scaled_mm is None:  # what the load-time check found (check_block_scaled_mm), for large M only
        checked = _BLOCK_SCALED_MM_CHECKED.get(x.device.index or 0, False) if x.is_cuda else False
        use_scaled_mm = checked and m >= FP8_BLOCK_SCALED_MM_MIN_TOKENS
    use = use_scaled_mm and x.is_cuda and tuple(block) == (128, 128) and k % 128 == 0 and n % 128 == 0
    if use:
        F = torch.nn.functional
        # cuBLAS refuses block scaling for M = 1 (CUBLAS_STATUS_NOT_SUPPORTED on an H200, cu130; M = 64 and
        # 2048 work): rows padded to a multiple of 16, which costs one copy of x only when M is not
        pad = -m % 16
        xp = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
        xq, xs = quantize(xp, column_major_scales=True)
        out = F.scaled_mm(
            xq, w.t(), xs, F.ScalingType.BlockWise1x128, w_scale.t(), F.ScalingType.BlockWise128x128,
            output_dtype=x.dtype,
        )  # fmt: skip
        out = out[:m] if pad else out
        return out if bias is None else out + bias
    xq, xs = quantize(x)
    return fp8_block_gemm(xq, xs, w, w_scale, block, x.dtype, bias)


def fp8_scaled_linear(
    x: torch.Tensor,  # [M, K]
    w: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [N] float32 per output channel
    input_scale: torch.Tensor | None = None,  # [1] static per-tensor activation scale; None: per token
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-channel FP8 W8A8: bf16 through torch._scaled_mm (rowwise scales, cuBLAS), other dtypes through the
    Triton block GEMM with one block per row and all of K, up to FP8_GEMV_MAX_TOKENS rows the GEMV
    (kernels/fp8_gemv.py); equals scaled_gemm_ref of the quantized activations."""
    xq, xs = per_token_group_quant(x, 0, FP8_DTYPE, static_scale=input_scale)
    if (
        FP8_WGMMA_CHANNEL
        and x.shape[0] >= FP8_WGMMA_CHANNEL_MIN_ROWS
        and x.is_cuda
        and x.dtype != torch.float32
    ):
        from longserve.kernels import fp8_wgmma_gemv as wg

        if wg.supported() and wg.fits_channel(xq, w, w_scale):
            return wg.gemv(xq, xs, w, w_scale, bias, x.dtype, wgmma_imprecise_acc(wg.BLOCK[1]))
    if x.shape[0] <= min(FP8_GEMV_MAX_TOKENS, FP8_GEMV_MAX_BLOCK_M):
        return fp8_channel_gemv(xq, xs, w, w_scale, x.dtype, bias)
    if not x.is_cuda:  # the interpreter (tests): the reference product of the same quantized values
        return scaled_gemm_ref(xq, xs, w, w_scale, x.dtype, bias)
    if x.dtype == torch.bfloat16:
        out = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16)
        return out if bias is None else out + bias
    return fp8_block_gemm(xq, xs, w, w_scale.view(-1, 1), (1, x.shape[1]), x.dtype, bias)
