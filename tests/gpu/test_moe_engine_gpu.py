"""MoE models end to end on a GPU: the Triton fused-MoE path (with CUDA graphs for decode and short prefill
chunks) gives the greedy tokens of the torch reference path and of transformers (fp32) for Qwen3-MoE,
Qwen2-MoE and Mixtral; in bf16 at a larger random shape its first-token logprobs stay within bf16 noise of
the reference's; expert parallelism's dispatch (expert_map) waits on no host sync; with two GPUs, TP=2 and
expert parallelism over 2 ranks (NCCL) give TP=1's tokens."""

from __future__ import annotations

import json

import pytest
import torch

from longserve import LLM, SamplingParams
from longserve.testing.checkpoints import MOE_ARCHS, make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)


def prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(10, 500, (40,), generator=g).tolist()
    return [head + torch.randint(10, 500, (3 + 17 * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module", params=MOE_ARCHS)
def ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3)


def run(path, ps, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_total_tokens", 8192)
    with LLM(path, device="cuda", **kw) as llm:
        outs = llm.generate(ps, GREEDY)
        llm.engine.check_integrity()
        graphs = llm.engine.runner.graph_runner is not None
    return [o.token_ids for o in outs], graphs


def reference_path(monkeypatch):
    """The experts through fused_moe_ref (the torch reference) instead of the Triton kernel."""
    from longserve.models import moe

    monkeypatch.setattr(moe, "use_triton", lambda x: False)


def test_triton_moe_and_cuda_graphs_equal_reference_and_hf(ckpt, monkeypatch):
    from longserve.kernels import fused_moe as kernel_mod
    from tests.e2e.test_engine import hf_greedy

    ps = prompts()
    calls = []
    real = kernel_mod.fused_moe
    monkeypatch.setattr(kernel_mod, "fused_moe", lambda *a, **k: calls.append(1) or real(*a, **k))
    triton, graphs = run(ckpt, ps, chunked_prefill_size=32, page_size=16)  # Triton attention and MoE, graphs
    assert graphs and calls, "the Triton MoE kernel and decode graphs were not used"
    with monkeypatch.context() as m:
        reference_path(m)
        ref, _ = run(ckpt, ps, attention_backend="torch", enforce_eager=True)
    assert triton == ref
    assert ref[0] == hf_greedy(ckpt, ps[0], 32)
    cached, _ = run(ckpt, ps + ps)  # the second half hits the prefix cache
    assert cached == ref + ref


def test_bf16_first_token_close_to_reference_at_a_larger_shape(tmp_path, monkeypatch):
    """Random Qwen3-MoE of 64 experts top-8, expert intermediate 384: the fused kernel rounds as the reference."""
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 1024,
        "intermediate_size": 2048, "moe_intermediate_size": 384, "num_experts": 64, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 64, "vocab_size": 4096, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "tie_word_embeddings": False, "initializer_range": 0.05, "torch_dtype": "bfloat16",
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ids = prompts(1)[0] * 8
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, logprobs=5)

    def first_token(**kw):
        with LLM(str(tmp_path), load_format="dummy", device="cuda", max_total_tokens=4096, **kw) as llm:
            out = llm.generate(ids, sp)[0]
        return out.token_ids[0], dict(out.outputs[0].top_logprobs[0])

    tok, lps = first_token()
    with monkeypatch.context() as m:
        reference_path(m)
        ref_tok, ref_lps = first_token(attention_backend="torch", enforce_eager=True)
    assert tok in list(ref_lps)[:2] and ref_tok in list(lps)[:2]
    for t, lp in ref_lps.items():
        if t in lps:
            assert abs(lps[t] - lp) < 0.1


def test_expert_parallel_dispatch_has_no_host_sync():
    """The expert_map path (remote pairs aligned as one extra expert, cut off on the device) never waits."""
    from longserve.kernels.fused_moe import fused_moe, fused_moe_ref, route_topk

    gen = torch.Generator(device="cuda").manual_seed(0)
    e, k, h, inter, local = 128, 8, 2048, 768, 64
    w13 = (torch.randn(local, 2 * inter, h, device="cuda", generator=gen) * h**-0.5).bfloat16()
    w2 = (torch.randn(local, h, inter, device="cuda", generator=gen) * inter**-0.5).bfloat16()
    emap = torch.full((e,), -1, dtype=torch.int32, device="cuda")
    emap[64:] = torch.arange(local, dtype=torch.int32, device="cuda")  # rank 1 of ep=2
    for tokens in (1, 64, 4096):
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=gen)
        w, ids = route_topk(torch.randn(tokens, e, device="cuda", generator=gen), k, True)
        w = w.bfloat16()
        out = fused_moe(x, w13, w2, w, ids, expert_map=emap)  # compiles
        ref = fused_moe_ref(x, w13, w2, w, ids, expert_map=emap)
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < 1e-2, rel
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fused_moe(x, w13, w2, w, ids, expert_map=emap)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_tp2_and_expert_parallel_equal_tp1_on_two_gpus(tmp_path, arch):
    path = make_tiny_checkpoint(tmp_path, arch, seed=3)
    ps = prompts(4)
    expected, _ = run(path, ps, chunked_prefill_size=64)
    tp2, graphs = run(path, ps, chunked_prefill_size=64, tp_size=2)
    ep2, _ = run(path, ps, chunked_prefill_size=64, tp_size=2, enable_expert_parallel=True)
    assert graphs and tp2 == expected and ep2 == expected


def test_stacked_moe_inputs_keep_the_tokens(tmp_path, monkeypatch):
    """Qwen2-MoE (a gated shared expert): the router, shared gate and shared gate|up as one GEMM at every step
    size (moe_block.STACKED_INPUTS_MAX_TOKENS; decode graphs and pieces captured with it) give the tokens of
    the separate GEMMs, fp32."""
    from longserve.models import moe_block

    path = make_tiny_checkpoint(tmp_path, "qwen2_moe", seed=3)
    ps = prompts()
    separate, _ = run(path, ps)
    monkeypatch.setattr(moe_block, "STACKED_INPUTS_MAX_TOKENS", 1 << 20)
    calls = []
    stacked = moe_block.SparseMoeBlock._stacked
    monkeypatch.setattr(
        moe_block.SparseMoeBlock, "_stacked", lambda self, x: calls.append(1) or stacked(self, x)
    )
    got, graphs = run(path, ps)
    assert graphs and calls and got == separate
