"""A 16-bit GEMV for decode batch sizes (M up to DENSE_GEMV_MAX_BLOCK_M): y = x @ w^T (+ bias) for a bf16/fp16
weight [N, K], beside its reference `F.linear`. `dense_linear` routes the unquantized linear layers here for
M <= DENSE_GEMV_MAX_TOKENS on the GPU (0 = off until measured: `gpu_check.sh quant-decode` times it per shape).

Why: at one token a decode step only reads weights, and cuBLAS reads the small projections of the
Qwen3-30B-A3B shape slowly. In its batch-1 profile at 4K (`44eb601`, benchmarks/RESULTS.md) the dense GEMMs
took 1.19 ms a step for 2.43 GB (48 layers of qkv 5120x2048 and o 2048x4096, 37.7 MB a layer, the router, and
the 622 MB lm_head): 2.0 TB/s, half of the H200's 4.2 TB/s. At 80% of it they would take ~0.72 ms, 12% of
the step; issue 17's target (1.5x the floor) needs that and more.

Design (quant_gemv.py's, for 16-bit weights):
- The grid is (N / BLOCK_N, SPLIT_K); a program owns BLOCK_N rows and a run of K tiles of BLOCK_K columns.
  The weight tile [BLOCK_N, BLOCK_K] is contiguous along K (16-byte vector loads) and multiplied on the CUDA
  cores in fp32, one activation row at a time (the tile is reused across the M rows), summed along K.
- Small row blocks instead of split-K where they fill the GPU: a split's partials need a second launch (~2 us in
  a graph, as much as a 2048x4096 product's whole floor of 4 us), so the default splits only when fewer than
  ~4 programs per SM would run; the bench's sweep (`scripts/gpu/bench_quant_kernels.py --dense`) decides.
- Rounding: fp32 sums rounded once to x's dtype; equal to `F.linear` up to summation order.

No host syncs: CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from longserve.kernels.extend_attention import interpreting
from longserve.kernels.quant_gemv import _num_sms, pow2_at_most, splitk_reduce
from longserve.kernels.quant_tiles import rounded

__all__ = [
    "DENSE_GEMV_MAX_BLOCK_M",
    "DENSE_GEMV_MAX_TOKENS",
    "dense_gemv",
    "dense_gemv_config",
    "dense_linear",
]

# M up to which `dense_linear` takes the GEMV on the GPU. 0 = off: it awaits the GPU measurement.
DENSE_GEMV_MAX_TOKENS = 0
DENSE_GEMV_MAX_BLOCK_M = 8  # every row is a pass over the tile in registers; beyond ~8 cuBLAS's GEMM wins


@triton.jit
def _dense_gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] 16-bit
    b_ptr,  # [N] bias (HAS_BIAS, not PARTIAL)
    out_ptr,  # [M, N] in x's dtype, or (PARTIAL) [splits, M, N] float32 partial sums
    M, N, K, tiles_per_split, num_tiles,
    stride_xm, stride_wn, stride_om, stride_os,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr, INTERPRET_BF16: tl.constexpr,
):  # fmt: skip
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n[:, None] * stride_wn  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # rows along dim 0, as the K reduction leaves them
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    for t in range(t_begin, t_end):
        cols = t * BLOCK_K + offs_k
        k_ok = cols < K
        if EVEN_K:
            w = tl.load(w_rows + cols[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
        else:
            w = tl.load(w_rows + cols[None, :], mask=n_mask[:, None] & k_ok[None, :], other=0.0).to(
                tl.float32
            )
        for mi in tl.static_range(BLOCK_M):
            xm = tl.load(x_ptr + mi * stride_xm + cols, mask=k_ok & ((cols * 0 + mi) < M), other=0.0)
            part = tl.sum(w * xm.to(tl.float32)[None, :], axis=1)  # [BLOCK_N]
            if BLOCK_M == 1:
                acc += part[:, None]
            else:
                acc += tl.where(offs_m[None, :] == mi, part[:, None], 0.0)
    out_off = offs_m[None, :] * stride_om + offs_n[:, None]
    out_mask = (offs_m < M)[None, :] & n_mask[:, None]
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n[:, None], mask=n_mask[:, None], other=0.0).to(tl.float32)
        out_ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + out_off, rounded(acc, out_ty, INTERPRET_BF16).to(out_ty), mask=out_mask)
    else:
        tl.store(out_ptr + pid_k * stride_os + out_off, acc, mask=out_mask)


def dense_gemv_config(m: int, n: int, k: int, device: torch.device) -> dict[str, int]:
    """Defaults (the bench's --dense sweep times candidates): tiles of up to 256 columns (512 bytes a row);
    BLOCK_N from 16 rows down to 4 until ~4 programs per SM run (an H200: N = 5120 in 8 rows, N = 2048 in 4);
    SPLIT_K only where row blocks give fewer than 2 programs per SM, at least 2 tiles a split."""
    block_k = min(256, max(16, triton.next_power_of_2(k)))
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 1
    want = 4 * sms
    block_n = 16
    while block_n > 4 and triton.cdiv(n, block_n) < want:
        block_n //= 2
    num_tiles = triton.cdiv(k, block_k)
    blocks = triton.cdiv(n, block_n)
    split_k = 1 if blocks >= 2 * sms else max(1, min(triton.cdiv(want, blocks), num_tiles // 2, 16))
    return {"BLOCK_M": triton.next_power_of_2(m), "BLOCK_N": block_n, "BLOCK_K": block_k,
            "SPLIT_K": pow2_at_most(split_k), "num_warps": 4, "num_stages": 3}  # fmt: skip


def dense_gemv(
    x: torch.Tensor,  # [M, K] bf16/fp16/fp32
    w: torch.Tensor,  # [N, K] in x's dtype
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """[M, N] in x's dtype: `F.linear(x, w, bias)` up to fp32 summation order."""
    m, k = x.shape
    n = w.shape[0]
    assert 1 <= m <= DENSE_GEMV_MAX_BLOCK_M and w.shape[1] == k, (
        f"GEMV of x {tuple(x.shape)}, w {tuple(w.shape)}"
    )
    cfg = dict(dense_gemv_config(m, n, k, x.device), **(config or {}))
    assert cfg["BLOCK_M"] >= m, cfg
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    num_tiles = triton.cdiv(k, cfg["BLOCK_K"])
    tiles_per_split = triton.cdiv(num_tiles, max(1, min(cfg["SPLIT_K"], num_tiles)))
    split = triton.cdiv(num_tiles, tiles_per_split)  # no empty split
    interpret_bf16 = interpreting() and x.dtype == torch.bfloat16
    shape = (split, m, n) if split > 1 else (m, n)
    out = torch.empty(shape, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    _dense_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split)](
        x, w, bias if bias is not None else w, out, m, n, k, tiles_per_split, num_tiles,
        x.stride(0), w.stride(0), out.stride(-2), out.stride(0) if split > 1 else 0,
        HAS_BIAS=bias is not None and split == 1, EVEN_K=k % cfg["BLOCK_K"] == 0, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], PARTIAL=split > 1, INTERPRET_BF16=interpret_bf16,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out if split == 1 else splitk_reduce(out, bias, x.dtype)


def dense_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ w^T (+ bias): the GEMV for T <= DENSE_GEMV_MAX_TOKENS on the GPU (or interpreted, for the
    tests), else F.linear."""
    if (
        (x.is_cuda or interpreting())
        and x.dim() == 2
        and x.shape[0] <= min(DENSE_GEMV_MAX_TOKENS, DENSE_GEMV_MAX_BLOCK_M)
    ):
        return dense_gemv(x, w, bias)
    return F.linear(x, w, bias)
