"""The MLP's gate/up GEMM writing silu(gate) * up from its epilogue (Hopper, TMA); reference: `swiglu_gemm_ref`.

A dense MLP's prefill runs cuBLAS for gate|up [T, 2I], then kernels/activation.py's silu_and_mul reads it back and
writes silu(gate) * up [T, I]. At the Llama-3.1-8B shape (I 14336) that round trip is ~114 KB a token a layer: at a
cold 32K prompt ~120 GB, ~40 ms at an H100's ~2.9 TB/s, about what separates longserve's cold 32K from 0.95 of
vLLM's on an H100 (1.2248 against 1.2446 s, RESULTS.md thirty-sixth session). Here each program of a persistent
grid holds a gate tile and the matching up tile (as fused_moe's gate+up kernel does) and writes only the product;
it gains only while it runs at cuBLAS's rate: at 32K the gate/up GEMM is ~10.5 ms a layer, each 1% slower ~3.4 ms
of the prompt. `scripts/probes/probe_swiglu_gemm.py` times it against cuBLAS (+ silu_and_mul), and
`gpu_check.sh swiglu-gemm` runs the probe and then the engine off / on.

Measured on an H100 (2026-12-06, `79bcaf3`, RESULTS.md fortieth session): at the 8B shape the kernel alone against
cuBLAS + silu_and_mul, 128 x 128 x 64 tiles in 3 stages, 1.078x at 512 tokens, 0.952x at 1K, 0.939x at 2K, 0.924x at
4K, 0.976x at 8K, 0.925x at 32K (4 stages 0.889x at 32K, but no better in the engine's 8K steps); Triton's
warp-specialized loop is 18-27% slower. In the engine, 8B bf16 cold prompts off / on, two runs each: 512 0.0135 /
0.0142 s (+5%), 1K 0.0255 / 0.0247 (-3%), 2K 0.0507 / 0.0493, 4K 0.1052 / 0.1042, 8K 0.2169 / 0.2124 (-2.1%), 32K
1.2202 / 1.2087 (-0.9%).
So steps of at least 1,024 tokens take it (`SWIGLU_GEMM_MIN_TOKENS`; 0 turns it off); models/linear_method.py asks
`swiglu_gemm_serves` for each unquantized gate/up product without a bias.

Rounding as the unfused path: each accumulator rounded to the dtype, silu in fp32 rounded, times up, rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from longserve.kernels import split_k
from longserve.kernels.activation_reference import swiglu_gemm_ref
from longserve.kernels.launch import is_hopper

__all__ = [
    "SWIGLU_GEMM_CONFIG",
    "SWIGLU_GEMM_MIN_TOKENS",
    "swiglu_gemm",
    "swiglu_gemm_ref",
    "swiglu_gemm_serves",
]

# Steps of at least this many tokens take the fused kernel (0: none): at 512 it lost, from 1K on it won (docstring).
SWIGLU_GEMM_MIN_TOKENS = 1024
# A 128 x (2 x 128) tile, cuBLAS's usual sm90 bf16 shape: the best of the probe's sweep at 1K-4K and in the engine.
# At 8K, the 8B's usual step, 3 stages still win (H100, forty-first session: 0.961x of cuBLAS + silu_and_mul against
# 0.970x in 4 stages and 0.977x with the epilogue stored in halves); at 32K 4 stages do (0.903x against 0.976x; the
# fortieth session 0.889x against 0.925x), a step only a lone prompt's takes, but in the engine a cold 32K in one
# lone step took 1.1908 / 1.1893 s with 4 stages for it against 1.1847 / 1.1873 with 3 (H100, forty-second session).
# The tile loop flattened into the K loop (FLATTEN) lost 15-27% at both.
SWIGLU_GEMM_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "STAGES": 3, "num_warps": 8}


@triton.jit
def _tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row tiles share the weight tiles they read while those stay in L2."""
    group = tile_id // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % size_m)
    pid_n = (tile_id % (GROUP_M * num_pid_n)) // size_m
    return pid_m, pid_n


@triton.jit
def _store(c_desc, tile, off_m, off_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUBTILE: tl.constexpr):
    """A [BLOCK_M, BLOCK_N] tile through the output descriptor; SUBTILE: as two [BLOCK_M, BLOCK_N / 2] halves (the
    descriptor's block), half the epilogue's shared memory, which can go to one more stage of the main loop."""
    if SUBTILE:
        halves = tl.permute(tl.reshape(tile, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        left, right = tl.split(halves)
        c_desc.store([off_m, off_n], left)
        c_desc.store([off_m, off_n + BLOCK_N // 2], right)
    else:
        c_desc.store([off_m, off_n], tile)


@triton.jit
def _one_tile(
    a_desc, b_desc, c_desc, tile_id, num_pid_m, num_pid_n, INTER, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    STAGES: tl.constexpr, FUSED: tl.constexpr, OUT_TY: tl.constexpr, SUBTILE: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        a = a_desc.load([off_m, k])  # [BLOCK_M, BLOCK_K]; rows past M read as zeros
        acc_g = tl.dot(a, b_desc.load([off_n, k]).T, acc_g)
        acc_u = tl.dot(a, b_desc.load([INTER + off_n, k]).T, acc_u)  # rows past 2 INTER: zeros
    g = acc_g.to(OUT_TY)
    u = acc_u.to(OUT_TY)
    if FUSED:
        # a ragged last column tile's gate columns past INTER are up rows' products: never stored (the
        # descriptor's INTER columns clip the store)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(OUT_TY).to(tl.float32)  # F.silu's rounding
        _store(c_desc, (act * u.to(tl.float32)).to(OUT_TY), off_m, off_n, BLOCK_M, BLOCK_N, SUBTILE)
    else:
        _store(c_desc, g, off_m, off_n, BLOCK_M, BLOCK_N, SUBTILE)
        _store(c_desc, u, off_m, INTER + off_n, BLOCK_M, BLOCK_N, SUBTILE)


@triton.jit
def _gate_up_kernel(
    a_desc, b_desc, c_desc, M, INTER, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, STAGES: tl.constexpr, FUSED: tl.constexpr, OUT_TY: tl.constexpr,
    FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, SUBTILE: tl.constexpr,
):  # fmt: skip
    """Persistent: each program takes tiles NUM_PROGRAMS apart. A tile is BLOCK_M rows x BLOCK_N columns of the
    gate half and the same columns of the up half (rows INTER + n of the weight). FUSED: stores silu(g) * u
    [M, INTER]; else g and u into gate|up [M, 2 INTER]. FLATTEN: the tile loop and the K loop pipelined as one, so
    the next tile's first loads are issued while this one's epilogue runs (Triton's persistent-matmul tutorial);
    WARP_SPECIALIZE (flattened too): Triton's producer/consumer warps."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(INTER, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    for tile_id in tl.range(
        tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE
    ):
        _one_tile(a_desc, b_desc, c_desc, tile_id, num_pid_m, num_pid_n, INTER, K,
                  BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, FUSED, OUT_TY, SUBTILE)  # fmt: skip


def _aligned(t: torch.Tensor) -> bool:
    """A TMA descriptor's needs: unit inner stride, 16-byte aligned base and row stride."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def swiglu_gemm_serves(x: torch.Tensor, w13: torch.Tensor) -> bool:
    """Whether the fused kernel takes x [T, H] @ w13 [2I, H]^T on this step: switched on for T, a Hopper GPU (TMA;
    timed on an H100 alone), 16-bit operands alike, descriptors' alignment."""
    return (
        0 < SWIGLU_GEMM_MIN_TOKENS <= x.shape[0]
        and x.is_cuda
        and x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and w13.dtype == x.dtype
        and w13.shape[0] % 2 == 0
        and (w13.shape[0] // 2) % 8 == 0  # the output's row stride, 16 bytes
        and is_hopper(x.device.index or 0)  # measured on Hopper only
        and _aligned(x)
        and _aligned(w13)
    )


def swiglu_gemm(
    x: torch.Tensor, w13: torch.Tensor, fused: bool = True, cfg: dict | None = None
) -> torch.Tensor:
    """x [T, H] @ w13 [2I, H]^T (gate rows first, as gate_up_proj stacks them): silu(gate) * up [T, I] (fused), or
    gate|up [T, 2I] (the same GEMM without the epilogue: the probe's like-for-like against cuBLAS). `cfg`: tiles,
    STAGES, num_warps, and the switches "flat" (FLATTEN), "ws" (WARP_SPECIALIZE), "subtile" (SUBTILE)."""
    cfg = cfg or SWIGLU_GEMM_CONFIG
    m, k = x.shape
    inter = w13.shape[0] // 2
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if not fused and inter % bn:
        raise ValueError(f"gate|up out needs the intermediate size ({inter}) a multiple of BLOCK_N ({bn})")
    out = torch.empty(m, inter if fused else 2 * inter, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    sms = split_k.num_sms(x.device.index or 0) if x.is_cuda else 4
    programs = min(sms, triton.cdiv(m, bm) * triton.cdiv(inter, bn))
    ws, sub = cfg.get("ws", False), cfg.get("subtile", False)
    _gate_up_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w13, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn // 2 if sub else bn]), m, inter, k,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_PROGRAMS=programs, STAGES=cfg["STAGES"], FUSED=fused,
        OUT_TY=tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16, FLATTEN=ws or cfg.get("flat", False),
        WARP_SPECIALIZE=ws, SUBTILE=sub, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out
