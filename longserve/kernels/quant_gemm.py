"""W4A16 / W8A16 GEMM in Triton with the dequantization fused: y = x @ dequantize(w)^T, for integer weights
in the layout of `quant_reference` (uint8 [N, K * bits / 8] packed along K, scales [N, G], optional uint8
zero points [N, G], optional act-order g_idx [K]); reference: `wna16_gemm_ref` (same signature and rounding:
the weight dequantized in float32, rounded to x's dtype, products accumulated in float32).

Two paths, chosen by the number of tokens M:

- fused (`_wna16_gemm_kernel`): each program loads a tile of packed weights, unpacks and scales it in
  registers and feeds the tensor cores at the activations' dtype. At decode batch sizes the GEMM is bound by
  reading the weights (4 bits instead of 16: up to 4x less); N / BLOCK_N programs are too few to fill the GPU
  when M is small, so K is split over SPLIT_K programs whose float32 partial sums are added in a fixed order
  (deterministic, no atomics).
- dequantize then cuBLAS (`_wna16_dequant_kernel` + torch.matmul): for many tokens the GEMM is bound by the
  tensor cores, and writing the [N, K] weight once is amortized over M rows.

- GEMV (`quant_gemv.wna16_gemv`, decode sizes M <= WNA16_GEMV_MAX_TOKENS): split-K over ~8 programs per SM,
  16-byte loads of the packed rows, scales applied once per tile; built for the memory floor at M = 1..16.

WNA16_DEQUANT_MIN_TOKENS is the crossover between the fused kernel and dequantize-then-cuBLAS, measured by
scripts/gpu/bench_quant_kernels.py (per M, both paths).

No host syncs (CUDA graphs capture both paths): every size is a Python int of the shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels import split_k
from longserve.kernels.extend_attention import interpreting
from longserve.kernels.quant_gemv import wna16_gemv, wna16_gemv_supported
from longserve.kernels.quant_reference import dequantize_wna16, wna16_gemm_ref
from longserve.kernels.quant_tiles import int_weight_rows, int_weight_tile, rounded

__all__ = [
    "WNA16_DEQUANT_MIN_TOKENS",
    "WNA16_GEMV_MAX_TOKENS",
    "wna16_dequantize",
    "wna16_gemm",
    "wna16_gemm_ref",
]

# crossover fused -> dequantize + cuBLAS. Measured on an H200 (2026-12-01, 55ae18c, bench_quant_kernels.py, GPTQ
# int4 g128 on the Llama-3.1-8B shapes): dequantize + cuBLAS is faster at every M from 1 (gate_up at M=1:
# 0.174 against 0.186 ms; down: 0.090 against 0.137; at M=32: 0.177 against 0.99). So by default the fused
# kernel serves no size; it stays as the tested baseline the decode GEMV and a retuned fused kernel must beat.
# Those timings were of eager calls (at small M, launch time); as CUDA-graph replays (2026-12-02, 95cf20e, M=1-16)
# dequantize + cuBLAS still wins at every M and shape (gate_up at M=1: 166 against 178 us), behind the GEMV.
WNA16_DEQUANT_MIN_TOKENS = 1
# The fused kernel's weight tiles loaded as the memory lies (quant_tiles.int_weight_rows, no act order): each row's
# packed bytes once, where int_weight_tile loads every byte twice, a byte a lane; the same values, bit for bit. So
# the MoE kernel's int path went from 25,124-28,898 to 1,638-1,654 us a layer at 4,096 tokens (moe_gemm.INT_ROWS;
# H100, RESULTS.md thirty-seventh session), past the dequantized experts. The timings above were by columns.
WNA16_INT_ROWS = True
# Past the GEMV, up to this many rows the fused kernel (by rows) serves instead of dequantize + cuBLAS, whose
# dequantization is a fixed cost a step (the 8B's gate_up 133 us and down 64 us a layer on an H100, RESULTS.md
# thirty-seventh session; with qkv and o by their sizes ~0.25 ms a layer, ~8 ms a step) and whose cuBLAS reads the
# bf16 weights it wrote: an 8B int4 decode past 64 requests or a prompt step of a few hundred tokens pays it. Timed
# on an H100 (2026-12-06, 79bcaf3, `gpu_check.sh int4-dense-rows`, RESULTS.md fortieth session) it loses at every
# size: the 8B's four projections 0.80 against 0.51 ms at 512 rows, 5.47 against 2.74 at 4,096 (default tile;
# the best of the sweep 0.80 and 1.36 against 0.78 at 1K); the 8B int4 cold 512 0.036 against 0.021 s, 2K 0.109
# against 0.054. So 0 (off): the kernel stays the tested baseline, as above.
WNA16_FUSED_MAX_TOKENS = 0
# Except a wide product: in that sweep the 8B's gate_up (N 28672) by rows won from 65 to 256 rows (0.108 against
# 0.210 ms at 65, 0.111 / 0.210 at 128, 0.211 / 0.225 at 256; 512: 0.365 / 0.280), where the dequantization writes
# and cuBLAS reads back 235 MB of bf16 weights for a few rows; qkv, o and down lost (0.054 / 0.045 ms qkv at 65).
# Past 64 rows the kernel takes no split-K: those three have 32-48 output tiles of 128 x 128 for the H100's 132
# SMs, gate_up 224 a row tile. So up to this many rows the fused kernel serves a product whose output tiles at
# its default tile fill the SMs (`_fills_the_sms`), 4-bit weights as swept: an int4 decode of 65-256 requests. The
# 8B int4 decode at 2K contexts, off / on (one run each, `79bcaf3` + this): b96 23.69 / 21.03 ms, b128 25.66 / 23.05
# ms (-10%); cold 128 tokens 0.0157 / 0.0130 s. 0 turns it off.
WNA16_FUSED_WIDE_MAX_TOKENS = 256
# wna16_dequantize by _wna16_dequant_rows_kernel (no act order): rows of packed bytes loaded once as vectors and
# stored as runs, where _wna16_dequant_kernel loads each byte twice, a byte a lane. What it is for: the A3B int4
# prefill dequantizes every expert each chunk (moe_wna16's dequant path: 0.3 GB read, 1.2 GB written a layer); on
# an H100 (2026-12-06, 9daccd2, RESULTS.md thirty-sixth session) the A3B int4 cold 32K took 1.258 s against bf16's
# 1.125 (1.12x; issue 18: <= 1.1x), ~133 ms over bf16 where those bytes take ~96 ms at 3 TB/s. Built for sm90 on a
# CPU (Triton 3.9, 64 x 128 tiles, 4 warps): the columns kernel loads its weights in 64 one-byte loads a thread (80
# registers), the rows kernel in 4 eight-byte loads (32 registers); both store 16-byte vectors. Measured on an
# H100 (2026-12-06, 4804d36, `gpu_check.sh int4-dequant`, RESULTS.md thirty-seventh session), alone: the A3B
# experts' gate_up 458 -> 443 us, down 213 -> 202 us (16 rows, 4 warps: the least summed over those two of 12
# settings), the 8B's gate_up 139 -> 133 us, down 69 -> 64 us, ~2.2-2.5 TB/s both, so the write of the bf16
# weights bounds it. In the engine the A3B int4 cold 8K 184.1 -> 182.7 ms, 32K 1,247.1 -> 1,242.8 ms; the 8B's
# unchanged (212.4 / 1,179.9 against 212.5 / 1,179.5 ms). Bit for bit the columns kernel's (its GPU test).
DEQUANT_ROWS = True
# rows a program, by 128 columns at groups of 128: 1 KB of int4 in, 4 KB of bf16 out
DEQUANT_ROWS_BLOCK_N = 16
DEQUANT_ROWS_WARPS = 4
# The decode GEMV serves M <= WNA16_GEMV_MAX_TOKENS. Measured on an H200 (2026-12-02, 95cf20e, `gpu_check.sh
# quant-decode`: CUDA-graph replays, RESULTS.md sixth session) it beats the fused kernel and dequantize+cuBLAS at
# every Llama-3.1-8B projection up to M=16, the largest M timed (gate_up at M=1: 42.2 us against 166 us; at M=16
# 54.4 against 166), and the 8B int4 decode at batch 1 (32K) took 5.01 ms with it against 12.14 ms without.
# Beyond 16 rows (2026-12-02, 35fd681, `bench_quant_kernels.py --tokens 1,16,32,64`, RESULTS.md seventh session;
# its GPU test at 33 and 64 rows passes) the GEMV's tl.dot tile still wins over the four 8B projections: at M=32
# 137 against 310 us, at M=64 234 against 314 (o alone loses there, 23.7 against 21.9 us).
WNA16_GEMV_MAX_TOKENS = 64


@triton.jit
def _wna16_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K * BITS / 8] uint8
    s_ptr,  # [N, G]
    z_ptr,  # [N, G] uint8 (HAS_ZP)
    g_ptr,  # [K] int32 (HAS_GIDX)
    out_ptr,  # [SPLIT_K, M, N] float32 partial sums, or [M, N] in x's dtype when SPLIT_K == 1
    M, N, K, group_size, k_per_split,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om, stride_os,
    BITS: tl.constexpr, HAS_ZP: tl.constexpr, HAS_GIDX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    INTERPRET_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr, INT_ROWS: tl.constexpr,
):  # fmt: skip
    """INT_ROWS (no g_idx; BLOCK_K within one group): the weight tile loaded as rows (WNA16_INT_ROWS above), rows
    past N read as row N - 1 and never stored."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_ty = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        a = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if INT_ROWS:
            PACK: tl.constexpr = 8 // BITS
            offs_kb = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
            rows = tl.minimum(offs_n, N - 1)  # rows past N read as row N - 1, never stored
            w = int_weight_rows(
                w_ptr, s_ptr, z_ptr, rows, offs_kb, k0, (offs_kb < k_end // PACK)[None, :],
                stride_wn, stride_sn, stride_zn, group_size, BITS, HAS_ZP, BLOCK_K,
            )  # fmt: skip
            w = tl.trans(w)  # [BLOCK_N, BLOCK_K] -> [BLOCK_K, BLOCK_N]
        else:
            w = int_weight_tile(
                w_ptr, s_ptr, z_ptr, g_ptr, offs_n, offs_k, k0, n_mask, k_mask,
                stride_wn, stride_sn, stride_zn, group_size, BITS, HAS_ZP, HAS_GIDX,
            )  # fmt: skip
        if INTERPRET_BF16:  # the interpreter's bf16 dot and casts are wrong: round by hand, dot in fp32
            b = rounded(w, x_ty, INTERPRET_BF16)
            a = a.to(tl.float32)
        else:
            b = w.to(x_ty)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    out_ty = out_ptr.dtype.element_ty
    out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    res = acc if SPLIT_K > 1 else rounded(acc, out_ty, INTERPRET_BF16)
    tl.store(out_ptrs, res.to(out_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _wna16_dequant_kernel(
    w_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K, group_size,
    stride_wn, stride_sn, stride_zn, stride_on,
    BITS: tl.constexpr, HAS_ZP: tl.constexpr, HAS_GIDX: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET_BF16: tl.constexpr,
):  # fmt: skip
    """out [N, K] = the dequantized weight in out's dtype (one tile per program)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = pid_k * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    n_mask, k_mask = offs_n < N, offs_k < K
    w = int_weight_tile(
        w_ptr,
        s_ptr,
        z_ptr,
        g_ptr,
        offs_n,
        offs_k,
        k0,
        n_mask,
        k_mask,
        stride_wn,
        stride_sn,
        stride_zn,
        group_size,
        BITS,
        HAS_ZP,
        HAS_GIDX,
    )  # fmt: skip  [BLOCK_K, BLOCK_N]
    out_ty = out_ptr.dtype.element_ty
    ptrs = out_ptr + offs_n[None, :] * stride_on + offs_k[:, None]
    tl.store(ptrs, rounded(w, out_ty, INTERPRET_BF16).to(out_ty), mask=k_mask[:, None] & n_mask[None, :])


@triton.jit
def _wna16_dequant_rows_kernel(
    w_ptr, s_ptr, z_ptr, out_ptr, N, K, group_size,
    stride_wn, stride_sn, stride_zn, stride_on,
    BITS: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
):  # fmt: skip
    """_wna16_dequant_kernel without g_idx, tiled as the memory lies (quant_tiles.int_weight_rows): [BLOCK_N rows,
    BLOCK_K columns], each row's packed bytes loaded once as one run and its BLOCK_K outputs stored as one. Rows past
    N load row n % N and are not stored."""
    PACK: tl.constexpr = 8 // BITS
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = pid_k * BLOCK_K
    offs_kb = pid_k * (BLOCK_K // PACK) + tl.arange(0, BLOCK_K // PACK)
    w = int_weight_rows(  # [BLOCK_N, BLOCK_K]
        w_ptr, s_ptr, z_ptr, offs_n % N, offs_kb, k0, (offs_kb < K // PACK)[None, :], stride_wn, stride_sn,
        stride_zn, group_size, BITS, HAS_ZP, BLOCK_K,
    )  # fmt: skip
    offs_k = k0 + tl.arange(0, BLOCK_K)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs_n[:, None] * stride_on + offs_k[None, :], rounded(w, out_ty, INTERPRET_BF16).to(out_ty),
             mask=(offs_n < N)[:, None] & (offs_k < K)[None, :])  # fmt: skip


def _block_k(group_size: int, k: int, has_gidx: bool) -> int:
    """A K tile within one group: BLOCK_K divides group_size (any tile when every row reads its own group or
    one group spans K); >= 16 for tl.dot."""
    if has_gidx or group_size >= k:
        return 64
    for bk in (128, 64, 32, 16):
        if group_size % bk == 0:
            return bk
    raise ValueError(f"group_size {group_size} is not a multiple of 16")


# wna16_config's tile by rows past the GEMV's 64 rows (no split-K), which _fills_the_sms counts
_ROWS_BLOCK_M, _ROWS_BLOCK_N = 128, 128


def _fills_the_sms(m: int, n: int, device: torch.device) -> bool:
    """Whether the fused kernel's output tiles past the GEMV (its tile by rows, no split-K) number at least the SMs."""
    if device.type != "cuda":
        return False
    tiles = triton.cdiv(m, _ROWS_BLOCK_M) * triton.cdiv(n, _ROWS_BLOCK_N)
    return tiles >= split_k.num_sms(device.index or 0)


def wna16_config(
    m: int, n: int, k: int, group_size: int, has_gidx: bool, device: torch.device
) -> dict[str, int]:
    """Tile sizes and split-K for an [M, K] x [K, N] product (defaults, no tuned table yet)."""
    if m > 64 and not has_gidx and WNA16_INT_ROWS:
        # by rows past the GEMV's sizes: built for sm90 here (Triton 3.9, int4 g128, the strides 16-aligned), 128 x
        # 128 x 64 on 8 warps holds 128 registers and a 325-instruction loop a warp (650 issue clocks a K step
        # against ~1,024 of wgmma) where 64 x 128 x 128 on 4 warps takes 938 (by columns 2,120); neither spills
        bk = min(_block_k(group_size, k, has_gidx), 64)
        return {"BLOCK_M": _ROWS_BLOCK_M, "BLOCK_N": _ROWS_BLOCK_N, "BLOCK_K": bk, "SPLIT_K": 1, "num_warps": 8,
                "num_stages": 3}  # fmt: skip
    block_k = min(_block_k(group_size, k, has_gidx), 64 if m <= 16 else 128)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 64 else 128
    splits = 1
    if m <= 64 and device.type == "cuda":  # too few output tiles to fill the SMs: split the reduction
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        want = triton.cdiv(2 * split_k.num_sms(device.index or 0), tiles)
        splits = max(1, min(want, k // (4 * block_k), 16))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": splits,
            "num_warps": 4, "num_stages": 3}  # fmt: skip


def _check(x, qweight, scales, zeros, g_idx, bits, group_size) -> tuple[int, int, int, int]:
    """(M, N, K, group): group_size <= 0 means one group of all K (per channel)."""
    m, k = x.shape
    n = qweight.shape[0]
    assert qweight.dtype == torch.uint8 and qweight.shape[1] * 8 == k * bits, (
        f"qweight {tuple(qweight.shape)} {qweight.dtype} for K={k}, {bits} bits"
    )
    assert scales.shape[0] == n and (zeros is None or zeros.shape == scales.shape)
    group = group_size if group_size > 0 else k
    assert g_idx is not None or scales.shape[1] == -(-k // group), (
        f"scales {tuple(scales.shape)}, group {group}"
    )
    return m, n, k, group


def wna16_gemm(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K * bits / 8] uint8
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor | None,  # [N, G] uint8
    g_idx: torch.Tensor | None,  # [K] int32
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    path: str | None = None,  # "gemv" / "fused" / "dequant": force a path (tests, the crossover benchmark)
) -> torch.Tensor:
    """[M, N] in x's dtype; same contract as `wna16_gemm_ref`."""
    m, n, k, group = _check(x, qweight, scales, zeros, g_idx, bits, group_size)
    x = x if x.stride(1) == 1 else x.contiguous()
    gemv_config = config if path == "gemv" else None  # a config given with path=None is the fused kernel's
    if path is None and config is not None:
        path = "fused"  # a config given with path=None is the fused kernel's
    if path is None:
        if m <= WNA16_GEMV_MAX_TOKENS and wna16_gemv_supported(m, k, bits):
            path = "gemv"
        elif (
            WNA16_INT_ROWS
            and g_idx is None
            and (
                m <= WNA16_FUSED_MAX_TOKENS
                or (bits == 4 and m <= WNA16_FUSED_WIDE_MAX_TOKENS and _fills_the_sms(m, n, x.device))
            )
        ):
            path = "fused"
        else:
            path = "dequant" if m >= WNA16_DEQUANT_MIN_TOKENS else "fused"
    if path == "gemv":
        return wna16_gemv(x, qweight, scales, zeros, g_idx, bits, group_size, bias, config=gemv_config)
    if path == "dequant":
        return torch.nn.functional.linear(
            x, wna16_dequantize(qweight, scales, zeros, g_idx, bits, group, x.dtype), bias
        )
    cfg = config or wna16_config(m, n, k, group, g_idx is not None, x.device)
    split = cfg["SPLIT_K"]
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split = triton.cdiv(k, k_per_split)
    interpret_bf16 = interpreting() and x.dtype == torch.bfloat16
    if split > 1:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)
    z = zeros if zeros is not None else qweight
    g = g_idx if g_idx is not None else qweight
    _wna16_gemm_kernel[grid](
        x, qweight, scales, z, g, out, m, n, k, group, k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), z.stride(0), out.stride(-2),
        out.stride(0) if split > 1 else 0,
        BITS=bits, HAS_ZP=zeros is not None, HAS_GIDX=g_idx is not None,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT_K=split,
        INTERPRET_BF16=interpret_bf16,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # the interpreter ignores it
        INT_ROWS=WNA16_INT_ROWS and g_idx is None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if split > 1:
        out = out.sum(dim=0).to(x.dtype)  # fixed order over the splits: deterministic
    return out if bias is None else out + bias


def wna16_dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The whole weight [N, K] in `dtype` (the large-M path; equals dequantize_wna16(...).to(dtype))."""
    n = qweight.shape[0]
    k = qweight.shape[1] * 8 // bits
    if not qweight.is_cuda and not interpreting():
        return dequantize_wna16(qweight, scales, zeros, g_idx, bits, group_size).to(dtype)
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    group_size = group_size if group_size > 0 else k
    block_k = _block_k(group_size, k, g_idx is not None)
    z = zeros if zeros is not None else qweight
    interpret_bf16 = interpreting() and dtype == torch.bfloat16
    if DEQUANT_ROWS and g_idx is None:  # block_k: within one group, as before
        _wna16_dequant_rows_kernel[(triton.cdiv(n, DEQUANT_ROWS_BLOCK_N), triton.cdiv(k, block_k))](
            qweight, scales, z, out, n, k, group_size, qweight.stride(0), scales.stride(0), z.stride(0),
            out.stride(0), BITS=bits, HAS_ZP=zeros is not None, BLOCK_N=DEQUANT_ROWS_BLOCK_N, BLOCK_K=block_k,
            INTERPRET_BF16=interpret_bf16, num_warps=DEQUANT_ROWS_WARPS,
        )  # fmt: skip
        return out
    block_n = 64
    g = g_idx if g_idx is not None else qweight
    _wna16_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight, scales, z, g, out, n, k, group_size,
        qweight.stride(0), scales.stride(0), z.stride(0), out.stride(0),
        BITS=bits, HAS_ZP=zeros is not None, HAS_GIDX=g_idx is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        INTERPRET_BF16=interpret_bf16,
    )  # fmt: skip
    return out
