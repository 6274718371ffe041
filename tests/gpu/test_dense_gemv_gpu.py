"""The 16-bit decode GEMV (kernels/dense_gemv.py) on the GPU at the Qwen3-30B-A3B and Llama-3.1-8B decode shapes
against F.linear in fp32, with its default tiles and with split-K; deterministic; captured in a CUDA graph and
replayed with new inputs; and an A3B-like engine decoding the same greedy tokens with DENSE_GEMV_MAX_TOKENS on.
Its times against cuBLAS: scripts/gpu/bench_dense_gemv.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = {"a3b_qkv": (5120, 2048), "a3b_o": (2048, 4096), "a3b_router": (128, 2048), "8b_down": (4096, 14336)}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("split", [None, 4])
def test_gemv_matches_f_linear(shape: str, m: int, split: int | None) -> None:
    from longserve.kernels.dense_gemv import dense_gemv

    n, k = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(n + m)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16()
    cfg = {"SPLIT_K": split} if split else None
    ref = F.linear(x.float(), w.float(), b.float())
    out = dense_gemv(x, w, b, config=cfg)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 4e-3  # one bf16 rounding of fp32 sums
    assert torch.equal(dense_gemv(x, w, b, config=cfg), out)


def test_cuda_graph_replays_with_new_inputs() -> None:
    from longserve.kernels.dense_gemv import dense_gemv

    n, k = SHAPES["a3b_qkv"]
    w = (torch.randn(n, k, device="cuda") * k**-0.5).bfloat16()
    x = torch.randn(2, k, device="cuda").bfloat16()
    dense_gemv(x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dense_gemv(x, w)
    for seed in range(3):
        x.copy_(torch.randn(2, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        assert rel_err(out, F.linear(x.float(), w.float())) < 4e-3


def test_a_moe_engine_decodes_the_same_tokens_through_the_gemv(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny Qwen3-MoE in bf16 with CUDA graphs: greedy tokens with the GEMV on for decode equal it off."""
    from longserve import LLM, SamplingParams
    from longserve.kernels import dense_gemv as dg
    from longserve.testing.checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "m", arch="qwen3_moe", num_layers=2)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[3, 17, 29, 4, 11, 40, 2], [5, 8, 13]]
    results = []
    for limit in (0, 8):
        monkeypatch.setattr(dg, "DENSE_GEMV_MAX_TOKENS", limit)
        with LLM(
            path, dtype="float32", device="cuda", max_total_tokens=2048, enable_prefix_caching=False
        ) as llm:
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert results[0] == results[1]
