"""kernels/swiglu_gemm.py under TRITON_INTERPRET=1 on the CPU: the gate/up GEMM with silu(gate) * up in its epilogue
equals silu_and_mul of the same kernel's gate|up bit for bit (the epilogue rounds as the unfused path), and that
gate|up equals the reference product to fp16 rounding (fp32 sums in another order); ragged row and column tiles,
every schedule (flattened, warp-specialized, the epilogue stored in halves). Taken from 1K tokens a step, never on the CPU."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from longserve.kernels import swiglu_gemm  # noqa: E402
from longserve.kernels.activation import silu_and_mul  # noqa: E402
from longserve.kernels.activation_reference import swiglu_gemm_ref  # noqa: E402
from longserve.models.linear_method import UnquantizedLinearMethod  # noqa: E402

TILE = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "STAGES": 2, "num_warps": 4}


def operands(m: int, hidden: int, inter: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    # fp16: the interpreter reads bf16 through a tensor descriptor wrongly (the probe found; the GPU test runs bf16)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g).half()
    w13 = (torch.randn(2 * inter, hidden, generator=g) / hidden**0.5).half()
    return x, w13


SCHEDULES = [{}, {"ws": True}, {"flat": True}, {"subtile": True}, {"flat": True, "subtile": True}]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: "+".join(s) or "plain")
@pytest.mark.parametrize("m,hidden,inter", [(64, 64, 64), (80, 96, 96)])  # 80: a ragged row tile
def test_fused_equals_silu_and_mul_of_the_plain_product(
    m: int, hidden: int, inter: int, schedule: dict
) -> None:
    x, w13 = operands(m, hidden, inter)
    cfg = {**TILE, **schedule}
    plain = swiglu_gemm.swiglu_gemm(x, w13, fused=False, cfg=cfg)
    ref = (x.float() @ w13.float().T).half()
    assert plain.shape == (m, 2 * inter)
    assert ((plain.float() - ref.float()).abs() <= ref.float().abs() * 2**-9 + 1e-3).all()
    fused = swiglu_gemm.swiglu_gemm(x, w13, cfg=cfg)
    assert fused.shape == (m, inter)
    assert torch.equal(fused, silu_and_mul(plain))
    torch.testing.assert_close(fused, swiglu_gemm_ref(x, w13), atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("subtile", [False, True])
def test_a_ragged_column_tile_stores_only_the_intermediate_columns(subtile: bool) -> None:
    """I = 40 with 32-column tiles: the last tile's gate columns 40..63 are up rows' products, never stored, and
    its up rows past 2I read as zeros (stored in halves: the second half lies wholly past I)."""
    x, w13 = operands(48, 64, 40, seed=1)
    fused = swiglu_gemm.swiglu_gemm(x, w13, cfg={**TILE, "subtile": subtile})
    assert fused.shape == (48, 40)
    torch.testing.assert_close(fused, swiglu_gemm_ref(x, w13), atol=2e-3, rtol=2e-2)
    with pytest.raises(ValueError, match="multiple of BLOCK_N"):
        swiglu_gemm.swiglu_gemm(x, w13, fused=False, cfg=TILE)


def test_only_steps_past_the_threshold_and_never_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w13 = operands(256, 64, 64)
    # measured: at 512 tokens it lost to cuBLAS + silu_and_mul, so 256 rows stay with them
    assert swiglu_gemm.SWIGLU_GEMM_MIN_TOKENS > 256
    assert not swiglu_gemm.swiglu_gemm_serves(x, w13)
    monkeypatch.setattr(swiglu_gemm, "SWIGLU_GEMM_MIN_TOKENS", 1)
    assert not swiglu_gemm.swiglu_gemm_serves(x, w13)  # a CPU tensor
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(w13, requires_grad=False)
    assert UnquantizedLinearMethod().apply_swiglu(layer, x, None) is None  # the MLP runs gate|up, then SiLU
