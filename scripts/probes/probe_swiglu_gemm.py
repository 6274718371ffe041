"""Would a gate/up GEMM that writes silu(gate) * up from its epilogue beat cuBLAS's GEMM plus our SiLU kernel?

A dense MLP's prefill today: cuBLAS writes gate|up [T, 2I] in bf16, then kernels/activation.py's silu_and_mul reads
it back and writes silu(gate) * up [T, I]. At the Llama-3.1-8B shape (I 14336) that round trip is ~114 KB a token a
layer: at a cold 32K prompt ~120 GB, ~40 ms at an H100's ~2.9 TB/s, about what separates longserve's cold 32K from
0.95 of vLLM's on an H100 (1.2248 against 1.2446 s, RESULTS.md thirty-sixth session). A GEMM whose programs hold a
gate tile and the matching up tile (as fused_moe's gate+up kernel does) writes only the product, but it must
run at cuBLAS's rate to gain: at 32K the gate/up GEMM is ~10.5 ms a layer, so each 1% slower costs ~3.4 ms.

This probe times, at the 8B MLP shape and each T: cuBLAS's gate|up alone, cuBLAS plus silu_and_mul (what runs
today), and kernels/swiglu_gemm.py's persistent Triton GEMM over TMA descriptors (Hopper), plain (gate|up out, the
apples-to-apples GEMM) and fused (the product out), over a few tiles; it checks the fused output against the
unfused path's. The best tile goes into SWIGLU_GEMM_CONFIG.

    python3 scripts/probes/probe_swiglu_gemm.py --tokens 8192,32768            # a GPU: the table
    TRITON_INTERPRET=1 python3 scripts/probes/probe_swiglu_gemm.py --check     # the CPU: tiny shapes, the values

Rounding as the unfused path: each accumulator rounded to bf16, silu in fp32 rounded to bf16, times up, rounded.
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch

from longserve.kernels.swiglu_gemm import swiglu_gemm


def gate_up(x: torch.Tensor, w13: torch.Tensor, fused: bool, cfg: dict) -> torch.Tensor:
    """x [T, H] @ w13 [2I, H]^T: silu(gate) * up [T, I] (fused) or gate|up [T, 2I] (kernels/swiglu_gemm.py)."""
    return swiglu_gemm(x, w13, fused=fused, cfg=cfg)


def unfused(x: torch.Tensor, w13: torch.Tensor) -> torch.Tensor:
    from longserve.kernels.activation_reference import silu_and_mul_ref

    if x.is_cuda:
        from longserve.kernels.activation import silu_and_mul

        return silu_and_mul(x @ w13.T)
    return silu_and_mul_ref((x.float() @ w13.float().T).to(x.dtype))


CONFIGS = [
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "STAGES": 3, "num_warps": 8},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "STAGES": 4, "num_warps": 8},
    {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "STAGES": 4, "num_warps": 4},
    {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "STAGES": 5, "num_warps": 8},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "STAGES": 4, "num_warps": 4},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "STAGES": 3, "num_warps": 8, "ws": True},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "STAGES": 3, "num_warps": 8, "flat": True},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "STAGES": 4, "num_warps": 8, "flat": True},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "STAGES": 4, "num_warps": 8, "subtile": True},
    {
        "BLOCK_M": 128,
        "BLOCK_N": 128,
        "BLOCK_K": 64,
        "STAGES": 4,
        "num_warps": 8,
        "flat": True,
        "subtile": True,
    },
]


def check() -> None:
    """Tiny shapes (the interpreter on the CPU, or a GPU): fused equals silu_and_mul of the plain kernel's gate|up,
    and the plain kernel equals the reference GEMM rounded to the dtype (fp32 sums in another order: close)."""
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16  # the interpreter reads bf16 descriptors wrong
    for (m, h, inter), ws in itertools.product(((64, 64, 64), (80, 128, 96)), (False, True)):
        x = torch.randn(m, h, device=dev).to(dtype)
        w13 = (torch.randn(2 * inter, h, device=dev) / h**0.5).to(dtype)
        cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "STAGES": 2, "num_warps": 4, "ws": ws}
        plain = gate_up(x, w13, False, cfg)
        ref = (x.float() @ w13.float().T).to(dtype)
        assert torch.allclose(plain.float(), ref.float(), atol=2e-2, rtol=2e-2), (plain - ref).abs().max()
        from longserve.kernels.activation import silu_and_mul  # the Triton kernel (interpreted on the CPU)

        fused, want = gate_up(x, w13, True, cfg), silu_and_mul(plain)
        assert torch.equal(fused, want), (fused.float() - want.float()).abs().max()
        print(
            f"check {m} x {h} -> {inter} ({dtype}, ws {ws}): plain ~ reference, fused == silu_and_mul(plain)"
        )


def bench_tokens(t: int, w13: torch.Tensor, hidden: int) -> None:
    from triton.testing import do_bench

    x = torch.randn(t, hidden, device="cuda").to(torch.bfloat16)
    flop = 2.0 * t * hidden * w13.shape[0]

    def timed(fn) -> float:
        return do_bench(fn, warmup=50, rep=300, return_mode="median")

    def show(name: str, ms: float) -> None:
        print(f"  T {t:>6} {name:<60} {ms:8.3f} ms ({flop / ms / 1e9:6.0f})")

    show("cuBLAS gate|up", timed(lambda: x @ w13.T))
    base = timed(lambda: unfused(x, w13))
    show("cuBLAS gate|up + silu_and_mul (today)", base)
    want = unfused(x, w13)
    for cfg in CONFIGS:
        name = "{BLOCK_M}x{BLOCK_N}x{BLOCK_K} s{STAGES} w{num_warps}".format(**cfg) + "".join(
            f" {switch}" for switch in ("ws", "flat", "subtile") if cfg.get(switch)
        )
        try:
            plain = timed(lambda c=cfg: gate_up(x, w13, False, c))
            fused = timed(lambda c=cfg: gate_up(x, w13, True, c))
        except Exception as exc:  # out of shared memory, ...: the next tile
            print(f"  T {t:>6} {name}: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        diff = (gate_up(x, w13, True, cfg).float() - want.float()).abs().max().item()
        show(f"Triton plain {name}", plain)
        show(f"Triton fused {name} ({fused / base:.3f}x today, max diff {diff:.3g})", fused)


def bench(tokens: list[int], hidden: int, inter: int) -> None:
    torch.manual_seed(0)
    w13 = (torch.randn(2 * inter, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}, gate/up {hidden} -> 2 x {inter}, bf16; ms (TFLOP/s of the GEMM)")
    for t in tokens:
        bench_tokens(t, w13, hidden)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="8192,32768")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--check", action="store_true", help="tiny shapes only (TRITON_INTERPRET=1 on a CPU)")
    args = parser.parse_args()
    if args.check or os.environ.get("TRITON_INTERPRET") == "1":
        check()
        return
    check()
    bench([int(t) for t in args.tokens.split(",")], args.hidden, args.intermediate)


if __name__ == "__main__":
    main()
