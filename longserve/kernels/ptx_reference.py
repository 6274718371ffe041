"""The PTX that the Gluon GEMV on the tensor cores inlines (int4_mma_gemv.py), run warp by warp in numpy: a small
interpreter of the instructions it uses (lop3, shr, mov, prmt, mma.sync.m16n8k16 .bf16 with the PTX ISA's fragment
layouts), on operands given per lane. The kernel's CPU emulation (int4_mma_reference.py) runs the kernel's own asm
strings through it, so a wrong operand number, selector or shift in the asm shows as a wrong product without a GPU."""

from __future__ import annotations

import re

import numpy as np

__all__ = ["run_ptx"]


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
    """mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 over a warp: registers [..., 32 lanes] as the PTX ISA lays the
    fragments (lane = 4 g + t): A {a0,a1} row g k 2t..2t+1, {a2,a3} row g+8, {a4,a5} row g k 2t+8.., {a6,a7} row g+8
    k 2t+8..; B {b0,b1} k 2t..2t+1 column g, {b2,b3} k 2t+8..; C c0,c1 row g columns 2t, 2t+1, c2,c3 row g+8.
    Products exact, sums in float64 rounded once to fp32."""
    batch = a[0].shape[:-1]
    am, bm, cm = np.zeros((*batch, 16, 16)), np.zeros((*batch, 16, 8)), np.zeros((*batch, 16, 8))
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

    for stmt in (s.strip().lstrip("{ ").strip() for s in asm.replace("\n", " ").split(";")):
        if not stmt or stmt == "}" or stmt.startswith((".reg", "//")):  # the block's braces, declarations
            continue
        op, rest = stmt.split(None, 1)
        if op.startswith("mma.sync"):
            parts = re.findall(r"\{[^}]*\}", rest)
            d, a, b, c = (group(p) for p in parts)
            shape = next(iter(operands.values())).shape
            a, b, c = (
                [np.broadcast_to(np.asarray(val(x), np.uint32), shape) for x in regs_] for regs_ in (a, b, c)
            )
            if ".bf16" not in op or ".m16n8k16" not in op:
                raise ValueError(f"run_ptx: no rule for {op!r}")
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
