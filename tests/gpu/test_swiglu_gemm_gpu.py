"""kernels/swiglu_gemm.py on the GPU: at the Llama-3.1-8B MLP shape the gate/up GEMM with silu(gate) * up in its
epilogue equals silu_and_mul of its own gate|up bit for bit, that gate|up equals F.linear to bf16 rounding (fp32
sums in another order), the product equals cuBLAS + silu_and_mul to the same rounding, a CUDA graph replays it for
new activations; and an engine with it switched on for prefill steps gives cuBLAS's greedy tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.agreement import greedy_steps, sequences_agreeing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
        reason="needs a Hopper GPU",
    ),
]


@pytest.mark.parametrize("m", [300, 2048])
def test_equals_cublas_and_silu_and_mul(m: int) -> None:
    from longserve.kernels.activation import silu_and_mul
    from longserve.kernels.swiglu_gemm import SWIGLU_GEMM_CONFIG, swiglu_gemm
    from longserve.platform import capture_cuda_graph

    hidden, inter = 4096, 14336
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, hidden, device="cuda", generator=g).bfloat16()
    w13 = (torch.randn(2 * inter, hidden, device="cuda", generator=g) * hidden**-0.5).bfloat16()
    plain = swiglu_gemm(x, w13, fused=False)
    want = F.linear(x.float(), w13.float())
    assert ((plain.float() - want).abs() <= want.abs() * 2**-7 + 1e-3).all()
    fused = swiglu_gemm(x, w13)
    assert torch.equal(fused, silu_and_mul(plain))
    cublas = silu_and_mul(x @ w13.T).float()
    assert ((fused.float() - cublas).abs() <= cublas.abs() * 2**-6 + 2e-3).all()
    assert torch.equal(swiglu_gemm(x, w13), fused)  # deterministic
    for schedule in (
        {"ws": True},
        {"flat": True},
        {"subtile": True, "STAGES": 4},
        {"flat": True, "subtile": True},
        {"STAGES": 4},
    ):
        other = swiglu_gemm(x, w13, cfg={**SWIGLU_GEMM_CONFIG, **schedule})
        assert torch.equal(other, fused), schedule  # the same sums in the same order, another schedule
    out: dict[str, torch.Tensor] = {}
    graph = capture_cuda_graph(lambda: out.update(y=swiglu_gemm(x, w13)))
    x.copy_(torch.randn(m, hidden, device="cuda", generator=g).bfloat16())
    graph.replay()
    assert torch.equal(out["y"], swiglu_gemm(x, w13))


def test_engine_steps_agree_with_cublas(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny bf16 model with the fused kernel serving its prefill steps (4 prompts of 200 tokens) against cuBLAS +
    silu_and_mul: while a sequence's tokens agree each greedy token is one of the other's top 2 and their shared
    logprobs agree to 0.1 (bf16 sums in another order may swap a near tie); most sequences agree whole."""
    from longserve import SamplingParams
    from longserve.kernels import swiglu_gemm
    from longserve.testing.checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "m", "llama", num_layers=2)
    prompts = [[5 + (7 * i + 3 * j) % 200 for j in range(200)] for i in range(4)]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)

    want = greedy_steps(path, prompts, params)
    calls: list[int] = []
    real = swiglu_gemm.swiglu_gemm
    monkeypatch.setattr(
        swiglu_gemm, "swiglu_gemm", lambda x, w, **kw: calls.append(x.shape[0]) or real(x, w, **kw)
    )
    monkeypatch.setattr(swiglu_gemm, "SWIGLU_GEMM_MIN_TOKENS", 129)
    got = greedy_steps(path, prompts, params)
    assert any(c >= 200 for c in calls), calls  # the prefill steps took it
    whole = sequences_agreeing(got, want)
    assert whole >= 3, f"{whole} of 4 sequences agree whole"
