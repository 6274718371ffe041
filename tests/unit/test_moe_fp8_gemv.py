"""Block-FP8 experts at decode sizes through the routed GEMVs (kernels/moe_fp8_gemv.py), under the interpreter:
the reference's result (fused_moe_ref with the FP8 experts dequantized per block and the activations quantized
per group), with and without split-K partials, each pair reading its own expert; the switch in fused_moe takes
the path up to its token count and not past it, nor for experts it does not take."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from longserve.kernels import fused_moe as fused_moe_mod  # noqa: E402
from longserve.kernels import moe_fp8_gemv as mod  # noqa: E402
from longserve.kernels.moe_reference import fused_moe_ref, route_topk  # noqa: E402
from tests.unit.test_quant_kernels import TOL, gen, moe_case  # noqa: E402


@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (3, 2), (4, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [None, 2])
def test_equals_the_reference(num_tokens: int, top_k: int, dtype: torch.dtype, split: int | None) -> None:
    w13, w2, quant = moe_case("fp8-block", seed=31 + num_tokens)  # 4 experts, H 64, I 32, 16x16 blocks
    x = torch.randn(num_tokens, 64, generator=gen(32)).to(dtype)
    weights, ids = route_topk(torch.randn(num_tokens, 4, generator=gen(33 + num_tokens)), top_k, True)
    ref = fused_moe_ref(x, w13, w2, weights.to(dtype), ids, quant=quant)
    config = None if split is None else {"SPLIT_K": split, "BLOCK_N": 16}  # gate+up: 4 K tiles, down: 2
    out = mod.moe_fp8_gemv(x, w13, w2, weights.to(dtype), ids, quant, torch.empty_like(x), config)
    torch.testing.assert_close(out, ref, atol=TOL[dtype] * 10, rtol=TOL[dtype])


def test_each_pair_reads_its_own_expert() -> None:
    """One token routed to experts 3 and 0 (in that order): swapping two experts' weights and scales changes
    the result exactly as it changes the reference's."""
    w13, w2, quant = moe_case("fp8-block", seed=41)
    x = torch.randn(1, 64, generator=gen(42))
    ids = torch.tensor([[3, 0]], dtype=torch.int32)
    weights = torch.tensor([[0.75, 0.25]])
    got = mod.moe_fp8_gemv(x, w13, w2, weights, ids, quant, torch.empty_like(x))
    torch.testing.assert_close(
        got, fused_moe_ref(x, w13, w2, weights, ids, quant=quant), atol=1e-4, rtol=1e-5
    )
    swapped = torch.tensor([[0, 3]], dtype=torch.int32)
    w2_swapped = fused_moe_ref(x, w13, w2, weights.flip(1), swapped, quant=quant)
    torch.testing.assert_close(got, w2_swapped, atol=1e-4, rtol=1e-5)  # the same pairs, listed the other way
    other = mod.moe_fp8_gemv(
        x, w13, w2, weights, torch.tensor([[3, 1]], dtype=torch.int32), quant, torch.empty_like(x)
    )
    assert not torch.allclose(other, got)


def test_the_switch_picks_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    w13, w2, quant = moe_case("fp8-block", seed=51)
    calls = []
    real = fused_moe_mod.moe_fp8_gemv
    monkeypatch.setattr(
        fused_moe_mod, "moe_fp8_gemv", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k)
    )
    monkeypatch.setattr(fused_moe_mod, "FP8_MOE_GEMV_MAX_TOKENS", 4)
    for n in (1, 4, 5):
        x = torch.randn(n, 64, generator=gen(52 + n))
        weights, ids = route_topk(torch.randn(n, 4, generator=gen(60 + n)), 2, True)
        out = fused_moe_mod.fused_moe(x, w13, w2, weights, ids, quant=quant)
        torch.testing.assert_close(
            out, fused_moe_ref(x, w13, w2, weights, ids, quant=quant), atol=1e-4, rtol=1e-5
        )
    assert calls == [1, 4]  # 5 tokens: the grouped path
    _, _, per_channel = moe_case("fp8-channel", seed=51)
    assert not mod.moe_fp8_gemv_supported(per_channel, 64, 32)  # no activation group: the general path
    assert mod.moe_fp8_gemv_supported(quant, 64, 32) and not mod.moe_fp8_gemv_supported(quant, 64, 40)
