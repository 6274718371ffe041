"""The int4 tensor-core GEMV (kernels/int4_mma_gemv.py, Gluon + mma.sync; quant_gemv.INT4_MMA_GEMV routes 1-64 rows to
it, past 16 in blocks of 16) on an H200 at the Llama-3.1-8B projections: the reference's product, the CPU emulation's (the same warps, fp32),
deterministic, equal to the CUDA-core kernels' to fp32 summation, replayed by a CUDA graph with new activations, its
counters left at zero; each projection's time against the kernels it would replace, with weights rotated through
~256 MB of copies (HBM, not L2: a decode step reads each weight once)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DENSE = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def int_weight(n: int, k: int, group: int = 128, zp: bool = False, seed: int = 0):
    from longserve.kernels.quant_reference import pack_int_k

    g = torch.Generator(device="cuda").manual_seed(n + k + seed)
    groups = k // (group if group > 0 else k)
    q = torch.randint(0, 16, (n, k), device="cuda", generator=g)
    scales = torch.full((n, groups), (k**-0.5) / (8 / 1.7), device="cuda", dtype=torch.float16)
    scales *= 1 + 0.2 * torch.rand(n, groups, device="cuda", generator=g, dtype=torch.float16)
    zeros = torch.randint(0, 16, (n, groups), device="cuda", generator=g).to(torch.uint8) if zp else None
    return pack_int_k(q, 4), scales, zeros, None


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def gemv(x, w, group, monkeypatch, mma: bool, bias=None):
    from longserve.kernels import quant_gemv

    monkeypatch.setattr(quant_gemv, "INT4_MMA_GEMV", mma)
    monkeypatch.setattr(
        quant_gemv, "INT4_MMA_MIN_ROWS", 1
    )  # the kernel at one row too (the engine keeps int4_gemv's)
    return quant_gemv.wna16_gemv(x, *w, 4, group, bias)


@pytest.mark.parametrize("shape", list(DENSE))
@pytest.mark.parametrize("m", [1, 2, 8, 16, 24, 64])  # past 16: blocks of 16 rows
@pytest.mark.parametrize("zp", [False, True])
def test_the_8b_projections(shape: str, m: int, zp: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from longserve.kernels.int4_mma_gemv import fits
    from longserve.kernels.quant_reference import dequantize_wna16, wna16_gemm_ref

    n, k = DENSE[shape]
    w = int_weight(n, k, zp=zp)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert fits(x, w[0], None, 4, 128)
    out = gemv(x, w, 128, monkeypatch, True)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    exact = x.double() @ dequantize_wna16(*w, 4, 128).double().T
    assert rel_err(out, exact) < 3e-3  # the bf16 output's rounding (RMS ~1.6e-3) and the fp32 sums
    assert rel_err(out, wna16_gemm_ref(x, *w, 4, 128)) < 1e-2
    assert rel_err(out, gemv(x, w, 128, monkeypatch, False)) < 4e-3
    assert torch.equal(gemv(x, w, 128, monkeypatch, True), out)  # deterministic: split order, no atomics
    graph = torch.cuda.CUDAGraph()  # the kernel compiled and ran above: nothing left to warm up
    with torch.cuda.graph(graph):
        replayed = gemv(x, w, 128, monkeypatch, True)
    x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(replayed, x.double() @ dequantize_wna16(*w, 4, 128).double().T) < 3e-3
    from longserve.kernels import split_k as split_k_module

    for counters in split_k_module._SERIAL_LOCKS.values():
        assert int(counters.abs().sum()) == 0  # every tile's counter reset by its last program


@pytest.mark.parametrize(
    ("n", "k", "group", "zp", "bias", "serial"),
    [
        (4096, 4096, -1, False, True, True),  # one group (per channel), bias summed by the last program
        # N not whole programs, two steps a group, splitk_reduce's sum
        (6144 + 48, 4096, 256, True, True, False),
        (512, 1024, 128, False, False, True),  # few programs: one split each
    ],
)
def test_variants_and_the_emulation(n, k, group, zp, bias, serial, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside the exact product, the CPU emulation of the same warps (int4_mma_reference.emulate, fp32 sums in
    another order): equal to the output's bf16 rounding."""
    from longserve.kernels import split_k as split_k_module
    from longserve.kernels.int4_mma_reference import emulate
    from longserve.kernels.quant_reference import dequantize_wna16

    monkeypatch.setattr(split_k_module, "SPLIT_K_SERIAL_REDUCE", serial)
    w = int_weight(n, k, group, zp)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    for m in (1, 5, 12, 40):  # 40: three blocks of rows
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = gemv(x, w, group, monkeypatch, True, b)
        exact = x.double() @ dequantize_wna16(*w, 4, group).double().T + (b.double() if bias else 0)
        assert rel_err(out, exact) < 3e-3
        if n * k <= 4096 * 4096:
            cpu = [t.cpu() if t is not None else None for t in (x, *w[:3], b)]
            emulated = emulate(cpu[0], cpu[1], cpu[2], cpu[3], group, 4, cpu[4]).cuda()
            diff = (out.float() - emulated.float()).abs().max().item()
            assert diff <= 2.0**-7 * emulated.abs().max().item()  # bf16 rounding of the same fp32 sums


@pytest.mark.parametrize(("n", "k", "zp", "stage_steps"), [(4096, 14336, False, 1), (4096, 14336, True, 2),
                                                      (1536 + 48, 1024, False, 1)])  # fmt: skip
def test_the_gated_down_projection_at_one_row(n, k, zp, stage_steps, monkeypatch: pytest.MonkeyPatch) -> None:
    """silu(gate) * up made inside the kernel (quant_gemv.INT4_MMA_GATED, one row by the ring): the product of
    silu_and_mul's bf16 values (its exp and division, its roundings), so the silu-first route's sums; replayed by a
    CUDA graph with new activations. The 8B down projection, and N not whole programs."""
    from longserve.kernels import gemv_fused, int4_mma_gemv, quant_gemv
    from longserve.kernels.activation import silu_and_mul

    monkeypatch.setattr(quant_gemv, "INT4_MMA_GATED", True)
    monkeypatch.setattr(int4_mma_gemv, "STAGE_STEPS", stage_steps)
    w = int_weight(n, k, zp=zp)
    gate_up = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16) * 2
    inside = gemv_fused.wna16_gated_gemv(gate_up, *w, 4, 128)
    assert inside is not None and inside.shape == (1, n)
    first = gemv(silu_and_mul(gate_up), w, 128, monkeypatch, True)
    assert rel_err(inside, first) < 1e-3
    print(f"\nint4 gated n={n} k={k} zp={zp} steps a slot {stage_steps}: equal to silu first: "
          f"{torch.equal(inside, first)}")  # fmt: skip
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = gemv_fused.wna16_gated_gemv(gate_up, *w, 4, 128)
    gate_up.copy_(torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(replayed, gemv(silu_and_mul(gate_up), w, 128, monkeypatch, True)) < 1e-3
    assert gemv_fused.wna16_gated_gemv(gate_up.repeat(2, 1), *w, 4, 128) is None  # two rows: silu first


@pytest.mark.parametrize(
    ("shape", "gated", "zp"), [("o", False, False), ("down", True, True), ("down", False, False)]
)
def test_the_norm_in_the_epilogue(shape: str, gated: bool, zp: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next RMSNorm in the one-row GEMV's epilogue (gluon_gemv.NORM_EPILOGUE, gemv_fused.wna16_gemv_then_norm):
    the new residual equal to fused_add_rms_norm's after the plain product, bit for bit (the same product, one
    rounding of the sum); the normed row to its rounding (the mean of squares summed in another order); replayed by
    a CUDA graph with new activations and residual, its counter back at zero. The o projection, and the down
    projection with silu(gate) * up made inside (INT4_MMA_GATED) and first."""
    from longserve.kernels import gemv_fused, gluon_gemv, quant_gemv
    from longserve.kernels.activation import silu_and_mul
    from longserve.kernels.norm import fused_add_rms_norm

    monkeypatch.setattr(gluon_gemv, "NORM_EPILOGUE", True)
    monkeypatch.setattr(quant_gemv, "INT4_MMA_GATED", gated)
    n, k = DENSE[shape]
    w = int_weight(n, k, zp=zp)
    x = torch.randn(1, 2 * k if shape == "down" else k, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(1, n, device="cuda", dtype=torch.bfloat16) * 4
    weight = (1 + 0.3 * torch.randn(n, device="cuda")).bfloat16()

    def fused():
        return gemv_fused.wna16_gemv_then_norm(
            x, *w, 4, 128, None, residual, weight, 1e-5, gated=shape == "down"
        )

    def plain():
        y = gemv(silu_and_mul(x) if shape == "down" else x, w, 128, monkeypatch, True)
        return fused_add_rms_norm(y, residual, weight, 1e-5)

    got, want = fused(), plain()
    assert got is not None
    assert torch.equal(got[1], want[1]) or gated  # inside: silu's product may round apart from silu first
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2e-2, atol=2e-2)
    assert rel_err(got[0], want[0]) < 4e-3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fused()
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        residual.copy_(torch.randn_like(residual))
        graph.replay()
        torch.cuda.synchronize()
        want = plain()
        assert rel_err(replayed[1], want[1]) < 1e-3 and rel_err(replayed[0], want[0]) < 4e-3
    assert int(gluon_gemv._NORM_LOCKS[x.device].count_nonzero()) == 0


@pytest.mark.parametrize("m", [1, 8, 16, 32, 64])
def test_times(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each projection at m rows, us, CUDA-core kernels (int4_gemv.py at one row, quant_gemv's general kernel
    above: tl.dot past 4 rows) against the tensor-core one, weights from HBM; printed for gpu_check.sh int4-mma."""
    from longserve.kernels import int4_gemv, int4_mma_gemv
    from longserve.kernels.norm import rms_norm
    from longserve.kernels.tune_gemv import rotating_time_us

    for shape, (n, k) in DENSE.items():
        w = int_weight(n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        # this build (gpu_check.sh runs REPS and STAGES variants through this test alone) right first
        assert rel_err(gemv(x, w, 128, monkeypatch, True), gemv(x, w, 128, monkeypatch, False)) < 4e-3
        times = {
            mma: rotating_time_us(lambda *c, mma=mma, x=x: gemv(x, c, 128, monkeypatch, mma), w)
            for mma in (False, True)
        }
        # as in the decode, each GEMV after a small kernel (its input's RMS norm, PDL-launched as there), the norm's
        # own time taken off: back to back, a GEMV's programs take the places of the last one's as they finish
        norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        norm_us = rotating_time_us(lambda *c, x=x, nw=norm_w: rms_norm(x, nw, 1e-6), w)
        chained = {
            mma: rotating_time_us(
                lambda *c, mma=mma, x=x, nw=norm_w: gemv(rms_norm(x, nw, 1e-6), c, 128, monkeypatch, mma), w
            )
            - norm_us
            for mma in (False, True)
        }
        floor = w[0].numel() / 4.2e6  # bytes at 4.2 TB/s, us
        print(f"\nint4 mma m={m} {shape} reps, stages={int4_mma_gemv.tiling(m)} steps a slot "
              f"{int4_mma_gemv.STAGE_STEPS} prefetch={int4_gemv.INT4_GEMV_PREFETCH}/{int4_mma_gemv.PREFETCH}: cuda cores "
              f"{times[False]:.1f} us, tensor cores {times[True]:.1f} us, HBM floor {floor:.1f} us; after a norm "
              f"({norm_us:.1f} us) {chained[False]:.1f} / {chained[True]:.1f} us")  # fmt: skip
