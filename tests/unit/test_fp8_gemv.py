"""The decode-size FP8 GEMVs (kernels/fp8_gemv.py) under TRITON_INTERPRET=1 against their torch references:
block FP8 (quant_reference.fp8_block_gemm_ref: activations quantized per token-group inside the kernel,
block-scaled e4m3 weights) at M = 1, 3, 8, 16, float32 and bf16 activations, blocks of 32/64/128, split-K with
its fixed-order reduction, bias, N and K not multiples of the tiles; per-channel FP8 (scaled_gemm_ref:
activations quantized per token or per tensor); their selection behind quant_fp8.FP8_GEMV_MAX_TOKENS. Their
compilation for sm90 runs in tests/unit/test_quant_gemv.py (scripts/dev/compile_quant_gemv.py)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from longserve.kernels import fp8_gemv, quant_fp8  # noqa: E402
from longserve.kernels import split_k as split_k_module  # noqa: E402
from longserve.kernels.fp8_gemv import fp8_block_gemv, fp8_channel_gemv, fp8_gemv_config  # noqa: E402
from longserve.kernels.quant_reference import (  # noqa: E402
    FP8_DTYPE,
    fp8_block_gemm_ref,
    per_token_group_quant_fp8_ref,
    scaled_gemm_ref,
)


def weights(n: int, k: int, block: tuple[int, int], seed: int):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 40).clamp(-448, 448).to(FP8_DTYPE)  # [N, K] e4m3
    scales = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 0.002 + 0.0005
    return w, scales


CASES = [  # m, n, k, block, split-K, bias
    (1, 96, 256, (32, 128), 1, False),
    (1, 80, 384, (128, 128), 3, True),  # one scale row for all N; N not a multiple of BLOCK_N
    (3, 70, 200, (32, 64), 2, True),  # K not a multiple of the group: a partial last tile
    (8, 48, 96, (16, 32), 3, False),
    (16, 40, 128, (64, 64), 1, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,n,k,block,split_k,bias", CASES)
def test_gemv_equals_reference(m, n, k, block, split_k, bias, dtype) -> None:
    """fp32: the reference to fp32 rounding (the same e4m3 activations: a GEMV that skipped or mis-rounded the
    activations' quantization would be off by ~1e-2); bf16: within bf16 rounding of it."""
    w, scales = weights(n, k, block, seed=m + n)
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    ref = fp8_block_gemm_ref(x, w, scales, block, b)
    out = fp8_block_gemv(x, w, scales, block, b, config={"SPLIT_K": split_k, "BLOCK_N": 16})
    assert out.dtype == dtype and out.shape == (m, n)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("static", [False, True], ids=["per-token", "per-tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "m,n,k,split_k,bias", [(1, 96, 256, 1, False), (5, 70, 200, 3, True), (16, 40, 384, 2, True)]
)
def test_channel_gemv_equals_reference(m, n, k, split_k, bias, dtype, static) -> None:
    """Per-channel FP8 (compressed-tensors FP8, --quantization fp8): the activations quantized per token (or
    with a static per-tensor scale) outside, the products and both scales inside."""
    g = torch.Generator().manual_seed(m * 7 + k)
    w = (torch.randn(n, k, generator=g) * 40).clamp(-448, 448).to(FP8_DTYPE)
    w_scale = torch.rand(n, generator=g) * 0.002 + 0.0005
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    xq, xs = per_token_group_quant_fp8_ref(x, k, torch.tensor([0.02]) if static else None)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    ref = scaled_gemm_ref(xq, xs, w, w_scale, dtype, b)
    out = fp8_channel_gemv(xq, xs, w, w_scale, dtype, b, config={"SPLIT_K": split_k, "BLOCK_N": 16})
    assert out.dtype == dtype and out.shape == (m, n)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_split_k_is_deterministic_and_equal_to_one_split() -> None:
    w, scales = weights(64, 512, (32, 64), seed=3)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(4))
    one = fp8_block_gemv(x, w, scales, (32, 64), config={"SPLIT_K": 1})
    many = [fp8_block_gemv(x, w, scales, (32, 64), config={"SPLIT_K": 5}) for _ in range(2)]
    assert torch.equal(many[0], many[1])
    torch.testing.assert_close(many[0], one, atol=1e-5, rtol=1e-5)


def test_config_fills_the_gpu_at_decode_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an H200 (132 SMs) the default grid has ~8 programs per SM or more at the Llama-3.1-8B shapes, tiles of
    one activation group."""
    monkeypatch.setattr(split_k_module, "num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        for m in (1, 4, 16):
            cfg = fp8_gemv_config(m, n, k, 128, cuda, "fp8_block_gemv_bk128")
            assert -(-n // cfg["BLOCK_N"]) * cfg["SPLIT_K"] >= 4 * 132, (n, k, m, cfg)
            assert cfg["BLOCK_K"] == 128 and cfg["BLOCK_M"] >= m


def test_the_switch_routes_decode_sizes_to_the_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = fp8_gemv.fp8_block_gemv
    monkeypatch.setattr(
        quant_fp8, "fp8_block_gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw)
    )
    w, scales = weights(32, 128, (16, 32), seed=5)
    monkeypatch.setattr(quant_fp8, "FP8_GEMV_MAX_TOKENS", 4)
    for m in (1, 4, 5):
        x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m))
        out = quant_fp8.fp8_block_linear(x, w, scales, (16, 32))
        torch.testing.assert_close(out, fp8_block_gemm_ref(x, w, scales, (16, 32)), atol=2e-5, rtol=2e-5)
    assert calls == [1, 4]


def test_the_switch_routes_per_channel_decode_sizes_to_the_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = fp8_gemv.fp8_channel_gemv
    monkeypatch.setattr(
        quant_fp8, "fp8_channel_gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw)
    )
    g = torch.Generator().manual_seed(9)
    w = (torch.randn(32, 128, generator=g) * 40).to(FP8_DTYPE)
    w_scale = torch.rand(32, generator=g) * 0.002 + 0.0005
    monkeypatch.setattr(quant_fp8, "FP8_GEMV_MAX_TOKENS", 4)
    for m in (1, 4, 5):
        x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m))
        out = quant_fp8.fp8_scaled_linear(x, w, w_scale)
        xq, xs = per_token_group_quant_fp8_ref(x, 128)
        torch.testing.assert_close(out, scaled_gemm_ref(xq, xs, w, w_scale, x.dtype), atol=2e-5, rtol=2e-5)
    assert calls == [1, 4]
