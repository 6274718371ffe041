"""kernels/dense_gemm.py on the GPU: the 16-bit skinny GEMM at the Llama-3.1-8B projections and decode batch sizes
equals F.linear to bf16 rounding (fp32 sums in another order), deterministically, with the serial split-K
reduction bit-equal to the reduction launch, replayed from a CUDA graph for new activations; the seed's narrow
shapes from one row; and engines with it switched on for 16-128 tokens, or for the shapes of a tuned table, give
F.linear's greedy tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.agreement import greedy_steps, sequences_agreeing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# the seed's Qwen3.5-35B-A3B's narrow bf16 products (a tuned table's candidates) from one row: router, shared gate,
# shared gate|up, the three stacked, shared down, the out projections
NARROW = {"router": (256, 2048), "shared_gate": (1, 2048), "shared_gate_up": (1024, 2048), "moe_inputs": (1281, 2048),
          "shared_down": (2048, 512), "out": (2048, 4096)}  # fmt: skip
CASES = [pytest.param(*SHAPES[s], m, id=f"{s}-{m}") for s in SHAPES for m in (16, 64, 128)] + [
    pytest.param(*NARROW[s], m, id=f"narrow-{s}-{m}") for s in NARROW for m in (1, 3, 64)
]


@pytest.mark.parametrize(("n", "k", "m"), CASES)
def test_equals_f_linear(n: int, k: int, m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from longserve.kernels import dense_gemm
    from longserve.kernels import split_k as split_k_module
    from longserve.platform import capture_cuda_graph

    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    monkeypatch.setattr(split_k_module, "SPLIT_K_SERIAL_REDUCE", False)
    got = dense_gemm.dense_gemm(x, w)
    want = F.linear(x.float(), w.float())
    assert ((got.float() - want).abs() <= want.abs() * 2**-7 + 1e-3).all()
    assert torch.equal(dense_gemm.dense_gemm(x, w), got)
    monkeypatch.setattr(split_k_module, "SPLIT_K_SERIAL_REDUCE", True)
    assert torch.equal(dense_gemm.dense_gemm(x, w), got)
    out: dict[str, torch.Tensor] = {}
    graph = capture_cuda_graph(lambda: out.update(y=dense_gemm.dense_gemm(x, w)))
    x.copy_(torch.randn(m, k, device="cuda", generator=g).bfloat16())
    graph.replay()
    assert torch.equal(out["y"], dense_gemm.dense_gemm(x, w))


def switched_on_agrees(tmp_path, monkeypatch: pytest.MonkeyPatch, arch: str, **switches) -> list[int]:
    """A tiny bf16 model's 20 prompts of 40 tokens, with dense_gemm's `switches` set against F.linear: step
    by step while a sequence's tokens agree, each greedy token is one of the other's top 2 and their shared
    logprobs agree to 0.1 (bf16 sums in another order may swap a near tie, as in tests/gpu/test_quant_engine_gpu.py);
    most sequences agree whole. The row counts dense_gemm took."""
    from longserve import SamplingParams
    from longserve.kernels import dense_gemm
    from longserve.testing.checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "m", arch, num_layers=2)
    prompts = [[5 + i + j for j in range(40)] for i in range(20)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)

    want = greedy_steps(path, prompts, params)
    calls: list[int] = []
    real = dense_gemm.dense_gemm
    monkeypatch.setattr(
        dense_gemm, "dense_gemm", lambda x, w, b=None, **kw: calls.append(x.shape[0]) or real(x, w, b, **kw)
    )
    for name, value in switches.items():
        monkeypatch.setattr(dense_gemm, name, value)
    got = greedy_steps(path, prompts, params)
    whole = sequences_agreeing(got, want)
    assert whole >= 15, f"{whole} of 20 sequences agree whole"
    return calls


def test_engine_steps_agree_with_f_linear(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton GEMM serving 16-128 tokens: the decodes at batch 20 take it, the 800-token prefill does not."""
    calls = switched_on_agrees(tmp_path, monkeypatch, "llama", DENSE_GEMM_TRITON_MAX_TOKENS=128)
    assert any(16 <= c <= 128 for c in calls), calls  # the decode graphs' batch sizes (20 replays 24's)


def test_engine_steps_agree_with_tuned_tables(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen2-MoE (router, shared gate and shared expert in bf16) as if this GPU's tuned tables held every
    linear and gated down projection of at most 4,096 outputs (128-row tiles, 2 splits, 3 stages) at decode
    batches: the decodes take it, the prefill does not."""
    tiles = {"BLOCK_N": 128, "SPLIT_K": 2, "num_warps": 4, "num_stages": 3}
    table = lambda m, n, k, device, gated=False: tiles if n <= 4096 and m <= 128 else None  # noqa: E731
    calls = switched_on_agrees(tmp_path, monkeypatch, "qwen2_moe", tuned_dense_config=table)
    assert calls and max(calls) <= 128, calls


@pytest.mark.parametrize("m", [1, 16, 64])
def test_gated_equals_silu_and_mul_then_the_product(m: int) -> None:
    """The 8B's down projection of gate|up (DENSE_GEMM_GATED_MAX_TOKENS): silu_and_mul's product through the same
    kernel bit for bit, F.linear's to bf16 rounding, replayed from a CUDA graph for new activations."""
    from longserve.kernels import dense_gemm
    from longserve.kernels.activation import silu_and_mul
    from longserve.platform import capture_cuda_graph

    n, k = SHAPES["down"]
    g = torch.Generator(device="cuda").manual_seed(m)
    gate_up = torch.randn(m, 2 * k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    got = dense_gemm.dense_gemm(gate_up, w, gated=True)
    assert torch.equal(got, dense_gemm.dense_gemm(silu_and_mul(gate_up), w))
    want = F.linear(silu_and_mul(gate_up).float(), w.float())
    assert ((got.float() - want).abs() <= want.abs() * 2**-7 + 1e-3).all()
    out: dict[str, torch.Tensor] = {}
    graph = capture_cuda_graph(lambda: out.update(y=dense_gemm.dense_gemm(gate_up, w, gated=True)))
    gate_up.copy_(torch.randn(m, 2 * k, device="cuda", generator=g).bfloat16())
    graph.replay()
    assert torch.equal(out["y"], dense_gemm.dense_gemm(gate_up, w, gated=True))


def test_engine_steps_agree_with_the_gated_down_projection(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny bf16 model whose decode batches (1-64 rows) run the down projection gated against silu_and_mul +
    cuBLAS: the greedy steps agree as above (20 prompts decoding together, then one alone)."""
    from longserve import SamplingParams
    from longserve.kernels import dense_gemm
    from longserve.testing.checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "m", "llama", num_layers=2)
    prompts = [[5 + i + j for j in range(40)] for i in range(20)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    want = greedy_steps(path, prompts, params) + greedy_steps(path, prompts[:1], params)
    calls: list[int] = []
    real = dense_gemm.dense_gemm
    monkeypatch.setattr(
        dense_gemm, "dense_gemm", lambda x, w, b=None, **kw: calls.append(x.shape[0]) or real(x, w, b, **kw)
    )
    monkeypatch.setattr(dense_gemm, "DENSE_GEMM_GATED_MAX_TOKENS", 64)
    got = greedy_steps(path, prompts, params) + greedy_steps(path, prompts[:1], params)
    assert 1 in calls and any(16 <= c <= 64 for c in calls), calls  # decode graphs' batch sizes
    whole = sequences_agreeing(got, want)
    assert whole >= 16, f"{whole} of 21 sequences agree whole"
