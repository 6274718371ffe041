"""The int4 tensor-core GEMV (int4_mma_gemv.py) emulated warp by warp on the CPU: its own inline PTX strings run by a
small interpreter of the five instructions they use (lop3, shr, mov, prmt, mma.sync.m16n8k16 bf16), on the operands
each lane holds by the kernel's layout (lanes (g, t): columns g and g + 8 of a 16-column tile, words 4t .. 4t + 3 of a
step; token g's activations), then the kernel's epilogue and split-K sum. What it checks without a GPU: the asm's
operand numbers, pair order, shifts and prmt selectors, that A's and B's k orders agree, the sums of x, the
epilogue's columns and tokens. That Triton hands the asm those operands (the layout's register and lane order) the
kernel asserts at its build (`_lane_layout`). The contract's reference is `quant_reference.wna16_gemm_ref`."""

from __future__ import annotations

import re

import numpy as np
import torch

from longserve.kernels import int4_mma_gemv as kernel

_OPERAND = re.compile(r"\$(\d+)")


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    out = np.zeros_like(a)
    for i in range(8):  # minterm i of (a, b, c), a the high bit: LUT bit i (a = 0xF0, b = 0xCC, c = 0xAA)
        if lut >> i & 1:
            out |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
    return out


def _prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    both = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum((both[(sel >> (4 * i)) & 7] << np.uint32(8 * i)) for i in range(4)).astype(np.uint32)


def _bf16_pairs(reg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A b32 register's two bf16 halves as float64 (low, high)."""
    lo = ((reg & 0xFFFF) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    hi = (reg & 0xFFFF0000).astype(np.uint32).view(np.float32).astype(np.float64)
    return lo, hi


def _mma(a: list[np.ndarray], b: list[np.ndarray], c: list[np.ndarray]) -> list[np.ndarray]:
    """mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 over a warp: registers [..., 32 lanes] as the PTX ISA lays
    the fragments (lane = 4 g + t): A {a0,a1} row g k 2t..2t+1, {a2,a3} row g+8, {a4,a5} row g k 2t+8.., {a6,a7}
    row g+8 k 2t+8..; B {b0,b1} k 2t..2t+1 column g, {b2,b3} k 2t+8..; C c0,c1 row g columns 2t, 2t+1, c2,c3 row
    g+8. Products exact, sums in float64 rounded once to fp32."""
    batch = a[0].shape[:-1]
    am = np.zeros((*batch, 16, 16))
    bm = np.zeros((*batch, 16, 8))
    cm = np.zeros((*batch, 16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for reg, (row, k) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            am[..., row, k], am[..., row, k + 1] = _bf16_pairs(a[reg][..., lane])
        for reg, k in enumerate((2 * t, 2 * t + 8)):
            bm[..., k, g], bm[..., k + 1, g] = _bf16_pairs(b[reg][..., lane])
        for reg, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
            cm[..., row, col] = c[reg][..., lane].view(np.float32)
    dm = (am @ bm + cm).astype(np.float32)
    d = [np.zeros(a[0].shape, np.uint32) for _ in range(4)]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for reg, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
            d[reg][..., lane] = dm[..., row, col].view(np.uint32)
    return d


def run_ptx(asm: str, operands: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Run the kernel's asm over warps: operands $i as uint32 arrays [..., 32 lanes] (floats as their bits); the
    outputs written into the same dict."""
    regs: dict[str, np.ndarray] = {}

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok.startswith("$"):
            return operands[int(tok[1:])]
        if tok in regs:
            return regs[tok]
        return np.uint32(int(tok, 0))

    def put(tok: str, v: np.ndarray) -> None:
        tok = tok.strip()
        if tok.startswith("$"):
            operands[int(tok[1:])] = np.broadcast_to(v, next(iter(operands.values())).shape).astype(np.uint32)
        else:
            regs[tok] = v

    def group(s: str) -> list[str]:
        return s.strip().strip("{}").split(",")

    for stmt in (s.strip() for s in asm.replace("\n", " ").split(";")):
        if not stmt or stmt in ("{", "}") or stmt.startswith((".reg", "{ .reg")) or stmt.startswith("//"):
            continue
        stmt = stmt.lstrip("{ ").strip()
        if stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        if op.startswith("mma.sync"):
            parts = re.findall(r"\{[^}]*\}", rest)
            d, a, b, c = (group(p) for p in parts)
            shape = next(iter(operands.values())).shape
            a, b, c = (
                [np.broadcast_to(np.asarray(val(x), np.uint32), shape) for x in regs_] for regs_ in (a, b, c)
            )
            out = _mma(a, b, c)
            for name, v in zip(d, out):
                put(name, v)
            continue
        args = [x.strip() for x in rest.split(",")]
        if op == "lop3.b32":
            put(args[0], _lop3(val(args[1]), val(args[2]), val(args[3]), int(args[4], 0)))
        elif op == "shr.u32":
            put(args[0], val(args[1]) >> np.uint32(int(args[2], 0)))
        elif op == "mov.b32":
            put(args[0], np.uint32(int(args[1], 0)))
        elif op == "prmt.b32":
            put(args[0], _prmt(val(args[1]), val(args[2]), int(args[3], 0)))
        else:
            raise ValueError(f"run_ptx: no rule for {op!r}")
    return operands


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
    tiles = np.arange(
        0, n, 16
    )  # every warp's tile of 16 columns (the kernel's programs hold 16 x warps x reps)
    lanes = np.arange(32)
    g, t = lanes >> 2, lanes & 3
    col = tiles[:, None] + g[None, :]  # [tiles, 32]: A's row g
    partials = []
    for first in range(0, num_steps, per_split):
        acc = np.zeros((4, len(tiles), 32), np.float32)
        for step in range(first, min(first + per_split, num_steps)):
            ops: dict[int, np.ndarray] = {}
            for i in range(4):
                ops[4 + i] = np.zeros((len(tiles), 32), np.uint32)
            for u in range(4):
                j = step * 16 + 4 * t + u
                for base, cols in ((8, col), (12, col + 8)):
                    ops[base + u] = np.where(cols < n, words[np.minimum(cols, n - 1), j[None, :]], 0).astype(
                        np.uint32
                    )
                p = [x32[np.minimum(g, m - 1), step * 64 + 16 * t + 4 * u + q] for q in range(4)]
                xs = {0: (p[0], p[2], kernel._PRMT_LO), 1: (p[0], p[2], kernel._PRMT_HI),
                      2: (p[1], p[3], kernel._PRMT_LO), 3: (p[1], p[3], kernel._PRMT_HI)}  # fmt: skip
                for i, (a, b, asm) in xs.items():
                    xi = run_ptx(str(asm.value), {1: a, 2: b, 0: np.zeros(32, np.uint32)})[0]
                    ops[16 + 4 * i + u] = np.broadcast_to(xi, (len(tiles), 32)).astype(np.uint32)
            sums_ops = {i: ops[i] for i in range(4, 8)} | {8 + i: ops[16 + i] for i in range(16)}
            sums = run_ptx(str(kernel._SUMS_ASM.value), sums_ops)
            c = run_ptx(str(kernel._STEP_ASM.value), ops)
            grp = step * kernel.K_STEP // group
            for u in range(4):
                cols = col + 8 * (u >> 1)
                inside = cols < n
                sc = np.where(inside, s[np.minimum(cols, n - 1), grp], 0.0).astype(np.float32)
                zz = zq[np.minimum(cols, n - 1), grp].astype(np.float32)
                cu, su = c[u].view(np.float32), sums[u].view(np.float32)
                acc[u] += sc * (cu - zz * su)
        part = np.zeros((m, n), np.float32)
        for u in range(4):
            token = np.broadcast_to(2 * t + (u & 1), col.shape)
            cols = col + 8 * (u >> 1)
            keep = (token < m) & (cols < n)
            part[token[keep], cols[keep]] = acc[u][keep]
        partials.append(part)
    out = torch.from_numpy(np.sum(np.stack(partials), axis=0, dtype=np.float32))
    if bias is not None:
        out += bias.float()
    return out if fp32 else out.to(x.dtype)
