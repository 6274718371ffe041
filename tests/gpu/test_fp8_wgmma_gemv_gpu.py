"""The FP8 decode GEMV on the tensor cores (kernels/fp8_wgmma_gemv.py, Gluon: TMA ring + wgmma; quant_fp8 routes block
FP8 to it under FP8_WGMMA_GEMV, per channel under FP8_WGMMA_CHANNEL, the routed experts through moe_fp8_gemv) on an
H200 at the Llama-3.1-8B projections: the reference's product (the same e4m3 activations: fp32 summation order and
the output's rounding), the CUDA-core GEMV's, deterministic, through fp8_block_linear with no host sync and replayed
from a CUDA graph with new activations, the gated down projection (silu * up before it, or inside it:
FP8_WGMMA_GATED), a bias and N not whole tiles, its counters left at zero; each projection's time against what
serves without it, weights rotated through ~256 MB of copies (HBM, not L2: a decode step reads each weight once)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DENSE = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BLOCK = (128, 128)


def fp8_block_weight(n: int, k: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(n * 3 + k + seed)
    w = torch.randn(n, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // 128), k // 128, device="cuda", generator=g) * (2 * k**-0.5) + 1e-3
    return w, scale


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def linear(x, w, scale, monkeypatch, on: bool, bias=None, gated: bool = False, in_kernel: bool = False):
    from longserve.kernels import fp8_wgmma_gemv, quant_fp8

    monkeypatch.setattr(quant_fp8, "FP8_WGMMA_GEMV", on)
    # the kernel at every row count it takes, past the engine's 16 too
    monkeypatch.setattr(quant_fp8, "FP8_WGMMA_MAX_ROWS", fp8_wgmma_gemv.MAX_ROWS)
    monkeypatch.setattr(quant_fp8, "FP8_WGMMA_GATED", in_kernel)  # gated: silu(gate) * up inside the kernel
    return quant_fp8.fp8_block_linear(x, w, scale, BLOCK, bias, gated=gated)


@pytest.mark.parametrize("shape", list(DENSE))
@pytest.mark.parametrize("m", [1, 2, 8, 16, 32])
def test_the_8b_projections(shape: str, m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from longserve.kernels import split_k as split_k_module
    from longserve.kernels.fp8_gemv import fp8_block_gemv
    from longserve.kernels.fp8_wgmma_gemv import fits
    from longserve.kernels.quant_fp8 import fp8_block_gemm_ref
    from longserve.platform import capture_cuda_graph

    n, k = DENSE[shape]
    w, scale = fp8_block_weight(n, k)
    x = torch.randn(
        m, k, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(m)
    )
    assert fits(x, w, scale, BLOCK)
    out = linear(x, w, scale, monkeypatch, True)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    # the same e4m3 activations as the reference's (an activation one e4m3 step off at a rounding boundary, from
    # an approximate fp32 division, moves a row by ~2e-3: fp8_gemv's test)
    assert rel_err(out, fp8_block_gemm_ref(x, w, scale, BLOCK)) < 1e-3
    if m <= 16:
        assert rel_err(out, fp8_block_gemv(x, w, scale, BLOCK)) < 1e-3
    assert torch.equal(linear(x, w, scale, monkeypatch, True), out)  # deterministic: split order, no atomics
    outs: dict[str, torch.Tensor] = {}
    graph = capture_cuda_graph(lambda: outs.update(y=linear(x, w, scale, monkeypatch, True)))
    x.copy_(
        torch.randn(
            m, k, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(7)
        )
    )
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(outs["y"], fp8_block_gemm_ref(x, w, scale, BLOCK)) < 1e-3
    for counters in split_k_module._SERIAL_LOCKS.values():
        assert int(counters.abs().sum()) == 0  # every tile's counter reset by its last program


@pytest.mark.parametrize("m", [1, 5, 24])
def test_bias_ragged_n_and_the_gated_down_projection(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """N not a multiple of a program's 128 rows (TMA's zero fill, the last scale row), a bias (added by the last
    split, or after splitk_reduce past the serial sums' rows), and the down projection fed gate|up (silu * up
    first): each equal to the route without the kernel."""
    from longserve.kernels.activation import silu_and_mul
    from longserve.kernels.quant_fp8 import fp8_block_gemm_ref

    n, k = 6144 + 64, 4096
    w, scale = fp8_block_weight(n, k, seed=1)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = linear(x, w, scale, monkeypatch, True, bias)
    assert rel_err(out, fp8_block_gemm_ref(x, w, scale, BLOCK, bias)) < 1e-3
    n, k = DENSE["down"]
    w, scale = fp8_block_weight(n, k)
    gate_up = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16) * 2
    fused = linear(gate_up, w, scale, monkeypatch, True, gated=True)
    assert rel_err(fused, fp8_block_gemm_ref(silu_and_mul(gate_up), w, scale, BLOCK)) < 1e-3
    # silu(gate) * up made by the kernel as it quantizes (GATED, FP8_WGMMA_GATED): the same bf16 values as
    # silu_and_mul's (its exp and division, its roundings), so the same e4m3 activations and sums
    in_kernel = linear(gate_up, w, scale, monkeypatch, True, gated=True, in_kernel=True)
    ref = fp8_block_gemm_ref(silu_and_mul(gate_up), w, scale, BLOCK)
    assert rel_err(in_kernel, fused) < 1e-3 and rel_err(in_kernel, ref) < 1e-3


@pytest.mark.parametrize("shape", ["qkv", "gate_up", "down"])
@pytest.mark.parametrize("m", [1, 4, 16, 32])
def test_per_channel(shape: str, m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-channel FP8 (`--quantization fp8`, compressed-tensors FP8) through fp8_scaled_linear: the activations
    quantized per token (and with a static per-tensor scale) by per_token_group_quant, then the kernel's
    PER_CHANNEL form; the reference's product of the same e4m3 values, and the route without it."""
    from longserve.kernels import quant_fp8
    from longserve.kernels.quant_reference import per_token_group_quant_fp8_ref, scaled_gemm_ref

    n, k = DENSE[shape]
    w, _ = fp8_block_weight(n, k)
    w_scale = torch.rand(n, device="cuda") * (2 * k**-0.5) + 1e-3
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(quant_fp8, "FP8_WGMMA_CHANNEL_MIN_ROWS", 1)  # the kernel at one row too
    for static in (None, torch.tensor([0.01], device="cuda")):
        monkeypatch.setattr(quant_fp8, "FP8_WGMMA_CHANNEL", True)
        out = quant_fp8.fp8_scaled_linear(x, w, w_scale, static)
        xq, xs = per_token_group_quant_fp8_ref(x, k, static)
        assert rel_err(out, scaled_gemm_ref(xq, xs, w, w_scale, torch.bfloat16)) < 1e-3
        monkeypatch.setattr(quant_fp8, "FP8_WGMMA_CHANNEL", False)
        assert rel_err(out, quant_fp8.fp8_scaled_linear(x, w, w_scale, static)) < 2e-3


@pytest.mark.parametrize("proj", ["gate_up", "down"])
@pytest.mark.parametrize("tokens", [1, 8])
def test_routed_experts(proj: str, tokens: int) -> None:
    """MoE decode at the A3B shape (routed_gemv: a (token, k) pair a program column, its expert's weights by TMA):
    each pair's row against the reference's product and fp8_gemv's routed GEMV (the CUDA cores), partials summed."""
    from longserve.kernels.fp8_gemv import fp8_routed_gemv
    from longserve.kernels.fp8_wgmma_gemv import fits_routed, routed_gemv
    from longserve.kernels.quant_fp8 import fp8_block_gemm_ref

    e, top_k = 128, 8
    n, k = (1536, 2048) if proj == "gate_up" else (2048, 768)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    w = torch.randn(e, n, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
    s = torch.rand(e, n // 128, k // 128, device="cuda", generator=g) * 2 * k**-0.5 + 1e-3
    div = top_k if proj == "gate_up" else 1  # gate+up: x a token's row; down: a pair's
    x = torch.randn(tokens * top_k // div, k, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.randint(0, e, (tokens * top_k,), device="cuda", dtype=torch.int32, generator=g)
    assert fits_routed(x, w, s, BLOCK)

    def summed(out: torch.Tensor) -> torch.Tensor:
        return out.float().sum(0) if out.dim() == 3 else out.float()  # split-K partials [S, P, N]

    # a row's activation one e4m3 step off at a rounding boundary (the approximate fp32 division) moves that row by
    # ~2e-3, and at one token there are 8 rows: 1.66e-3 measured (2026-12-05); fp8_gemv's test bounds a row at 5e-3
    out = summed(routed_gemv(x, w, s, ids, div, 32))
    ref = torch.cat(
        [
            fp8_block_gemm_ref(x[p // div : p // div + 1], w[i], s[i], BLOCK)
            for p, i in enumerate(ids.tolist())
        ]
    )
    assert rel_err(out, ref) < 5e-3
    assert rel_err(out, summed(fp8_routed_gemv(x, w, s, BLOCK, ids, div))) < 5e-3


@pytest.mark.parametrize(("shape", "in_kernel"), [("o", False), ("down", True), ("down", False)])
def test_the_norm_in_the_epilogue(shape: str, in_kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next RMSNorm in the one-row GEMV's epilogue (gluon_gemv.NORM_EPILOGUE,
    gemv_fused.fp8_block_linear_then_norm): the new residual equal to fused_add_rms_norm's after the plain product,
    bit for bit; the normed row to its rounding; replayed by a CUDA graph with new activations and residual, its
    counter back at zero. The o projection, and the down projection with silu(gate) * up inside and first."""
    from longserve.kernels import gemv_fused, gluon_gemv
    from longserve.kernels.norm import fused_add_rms_norm

    monkeypatch.setattr(gluon_gemv, "NORM_EPILOGUE", True)
    n, k = DENSE[shape]
    w, scale = fp8_block_weight(n, k)
    gated = shape == "down"
    x = torch.randn(1, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(1, n, device="cuda", dtype=torch.bfloat16) * 4
    weight = (1 + 0.3 * torch.randn(n, device="cuda")).bfloat16()

    def fused():
        return gemv_fused.fp8_block_linear_then_norm(
            x, w, scale, BLOCK, None, residual, weight, 1e-5, gated=gated
        )

    def plain():
        y = linear(x, w, scale, monkeypatch, True, gated=gated, in_kernel=in_kernel)
        return fused_add_rms_norm(y, residual, weight, 1e-5)

    want = plain()  # sets FP8_WGMMA_GATED as in_kernel says
    got = fused()
    assert got is not None and torch.equal(got[1], want[1])
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
        assert torch.equal(replayed[1], want[1]) and rel_err(replayed[0], want[0]) < 4e-3
    assert int(gluon_gemv._NORM_LOCKS[x.device].count_nonzero()) == 0


@pytest.mark.parametrize("m", [1, 8, 16, 32])
def test_times(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each projection at m rows, us, what serves without the kernel (fp8_gemv.py at one row, cuBLAS's block-scaled
    GEMM or the Triton block GEMM above) against it, weights from HBM; printed for gpu_check.sh fp8-wgmma."""
    from longserve.kernels import fp8_wgmma_gemv, quant_fp8
    from longserve.kernels.tune_gemv import rotating_time_us

    monkeypatch.setattr(quant_fp8, "FP8_WGMMA_CHANNEL_MIN_ROWS", 1)

    def channel_linear(x, w, w_scale, on):
        monkeypatch.setattr(quant_fp8, "FP8_WGMMA_CHANNEL", on)
        return quant_fp8.fp8_scaled_linear(x, w, w_scale)

    for shape, (n, k) in DENSE.items():
        w = fp8_block_weight(n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w_channel = torch.rand(n, device="cuda") * (2 * k**-0.5) + 1e-3  # per channel, beside the blocks
        # this build (gpu_check.sh runs the variants through this test alone) right first
        assert rel_err(linear(x, *w, monkeypatch, True), linear(x, *w, monkeypatch, False)) < 2e-3
        times = {
            on: rotating_time_us(lambda *c, on=on, x=x: linear(x, *c, monkeypatch, on), w)
            for on in (False, True)
        }
        channel = {
            on: rotating_time_us(lambda wq, _, on=on, x=x, ws=w_channel: channel_linear(x, wq, ws, on), w)
            for on in (False, True)
        }
        floor = w[0].numel() / 4.2e6  # bytes at 4.2 TB/s, us
        print(f"\nfp8 wgmma m={m} {shape} stages={fp8_wgmma_gemv.STAGES} "
              f"imprecise={quant_fp8.FP8_DOT_MAX_IMPRECISE_ACC}: without {times[False]:.1f} us, "
              f"wgmma {times[True]:.1f} us (per channel {channel[False]:.1f} / {channel[True]:.1f}), "
              f"HBM floor {floor:.1f} us")  # fmt: skip
