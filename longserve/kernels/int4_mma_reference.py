"""The int4 tensor-core GEMV (int4_mma_gemv.py) emulated warp by warp on the CPU: its own inline PTX strings run by
ptx_reference.run_ptx on the operands each lane holds by the kernel's layout (lanes (g, t): A's rows g and g + 8 of a
warp's tile, a program's columns r 8W + 8w + g and that + HALF, words 4t .. 4t + 3 of a step; token g's activations),
then the kernel's epilogue and split-K sum.
What it checks without a GPU: the asm's operand numbers, pair order, shifts and prmt selectors, that A's and B's k
orders agree, the sums of x, the epilogue's columns and tokens. That Triton hands the asm those operands (the
layout's register and lane order) the kernel asserts at its build (`int4_mma_ptx.lane_layout`). The contract's
reference is `quant_reference.wna16_gemm_ref`."""

from __future__ import annotations

import numpy as np
import torch

from longserve.kernels import int4_mma_gemv as kernel
from longserve.kernels import int4_mma_ptx as ptx
from longserve.kernels.ptx_reference import run_ptx


def _step(words, x32, n: int, m: int, col, half: int, g, t, step: int, token0: int):
    """One step of every warp tile for B's token tile from token0 (rows past m - 1 read row m - 1): the kernel's asm
    on the lanes' operands -> (C, sum x), each 4 arrays [tiles, 32 lanes] (C's registers, as uint32 bits)."""
    tiles = col.shape[0]
    ops: dict[int, np.ndarray] = {4 + i: np.zeros((tiles, 32), np.uint32) for i in range(4)}
    for u in range(4):
        j = step * 16 + 4 * t + u
        for base, cols in ((8, col), (12, col + half)):
            ops[base + u] = np.where(cols < n, words[np.minimum(cols, n - 1), j[None, :]], 0).astype(
                np.uint32
            )
        p = [x32[np.minimum(token0 + g, m - 1), step * 64 + 16 * t + 4 * u + q] for q in range(4)]
        xs = {0: (p[0], p[2], ptx.PRMT_LO), 1: (p[0], p[2], ptx.PRMT_HI),
              2: (p[1], p[3], ptx.PRMT_LO), 3: (p[1], p[3], ptx.PRMT_HI)}  # fmt: skip
        for i, (a, b, asm) in xs.items():
            xi = run_ptx(str(asm.value), {1: a, 2: b, 0: np.zeros(32, np.uint32)})[0]
            ops[16 + 4 * i + u] = np.broadcast_to(xi, (tiles, 32)).astype(np.uint32)
    sums_ops = {i: ops[i] for i in range(4, 8)} | {8 + i: ops[16 + i] for i in range(16)}
    return run_ptx(str(ptx.STEP_ASM.value), ops), run_ptx(str(ptx.SUMS_ASM.value), sums_ops)


def emulate(
    x, qweight, scales, zeros, group_size: int, splits: int, bias=None, fp32: bool = False
) -> torch.Tensor:
    """The kernel's result [M, N] in x's dtype (fp32: before that rounding), computed as its warps would (module
    docstring)."""
    m, k = x.shape
    n = qweight.shape[0]
    words = qweight.contiguous().view(torch.int32).numpy().view(np.uint32)  # [N, K / 8]
    x32 = x.contiguous().view(torch.int32).numpy().view(np.uint32)  # [M, K / 2]
    s = scales.float().numpy()
    zq = zeros.float().numpy() + 128.0 if zeros is not None else np.full(s.shape, 136.0, np.float32)
    group = group_size if group_size > 0 else k
    num_steps = k // kernel.K_STEP
    per_split = -(-num_steps // max(1, min(splits, num_steps)))
    # every warp's tile of 16 columns: a program's BLOCK_N = 16 x warps x reps columns, A's rows g of tile (r, w)
    # its columns r 8W + 8w + g, rows g + 8 those + HALF
    block_n = kernel.block_n(m)
    half = block_n // 2
    tiles = (np.arange(0, n, block_n)[:, None] + np.arange(0, half, 8)[None, :]).reshape(-1)
    lanes = np.arange(32)
    g, t = lanes >> 2, lanes & 3
    col = tiles[:, None] + g[None, :]  # [tiles, 32]: A's row g
    # a program's blocks of rows (row_blocks past BLOCK_ROWS), each its B's token tiles: tokens row0 + 8 tile + g
    token0s = [
        (row0 + 8 * tile, min(row0 + kernel.BLOCK_ROWS, m))
        for row0 in range(0, kernel.row_blocks(m) * kernel.BLOCK_ROWS, kernel.BLOCK_ROWS)
        for tile in range(kernel.token_tiles(m))
    ]
    partials = []
    for first in range(0, num_steps, per_split):
        part = np.zeros((m, n), np.float32)
        for token0, block_end in token0s:
            acc = np.zeros((4, len(tiles), 32), np.float32)
            for step in range(first, min(first + per_split, num_steps)):
                c, sums = _step(words, x32, n, block_end, col, half, g, t, step, token0)
                grp = step * kernel.K_STEP // group
                for u in range(4):
                    cols = col + half * (u >> 1)
                    sc = np.where(cols < n, s[np.minimum(cols, n - 1), grp], 0.0).astype(np.float32)
                    zz = zq[np.minimum(cols, n - 1), grp].astype(np.float32)
                    acc[u] += sc * (c[u].view(np.float32) - zz * sums[u].view(np.float32))
            for u in range(4):
                token = np.broadcast_to(token0 + 2 * t + (u & 1), col.shape)
                cols = col + half * (u >> 1)
                keep = (token < block_end) & (cols < n)
                part[token[keep], cols[keep]] = acc[u][keep]
        partials.append(part)
    out = torch.from_numpy(np.sum(np.stack(partials), axis=0, dtype=np.float32))
    if bias is not None:
        out += bias.float()
    return out if fp32 else out.to(x.dtype)
