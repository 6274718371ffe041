"""Hybrid models (Qwen3.5 dense and MoE, tiny) end to end on a GPU: the Triton Gated DeltaNet kernels (causal
conv, gating, chunked delta rule, one-token steps, gated norm), partial rotary and zero-centered norms, decode
steps replayed as CUDA graphs over the state slots and prompt steps through the piecewise graphs, give the greedy
tokens of the torch reference path (eager) and of transformers (fp32), in chunks and batches that reuse state
slots; at a larger bf16 shape (Qwen3.5's head dims, 64-token chunks crossed) the first token's logprobs stay
within bf16 noise of the reference path's."""

from __future__ import annotations

import json

import pytest
import torch

from longserve import LLM, SamplingParams
from longserve.testing.checkpoints import HYBRID_ARCHS, make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)


def prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(10, 500, (40,), generator=g).tolist()
    return [head + torch.randint(10, 500, (3 + 29 * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3)


def run(path, ps, params=GREEDY, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_total_tokens", 8192)
    with LLM(path, device="cuda", **kw) as llm:
        outs = llm.generate(ps, params)
        llm.engine.check_integrity()
        assert llm.engine.kv.states.num_free == llm.engine.kv.states.num_total
        runner = llm.engine.runner
        # decode steps replay graphs over the state slots, prompt steps the piecewise graphs (each layer's mixer
        # between them over the real rows: runner/piecewise_graph.py); no lone-chunk graphs
        graphs = not kw.get("enforce_eager", False)
        assert runner.extend_graphs is None
        assert (runner.graph_runner is not None) == (runner.piecewise_graphs is not None) == graphs
        assert not graphs or runner.piecewise_graphs.num_runs > 0
    return outs


def reference_path(monkeypatch):
    """Every Gated DeltaNet kernel through its torch reference (models/gated_delta_net.py's `_kernel`)."""
    from longserve.models import gated_delta_net

    monkeypatch.setattr(gated_delta_net, "use_triton", lambda x: False)


def test_triton_kernels_equal_reference_and_hf(ckpt, monkeypatch):
    from longserve.kernels import gated_delta
    from tests.e2e.test_engine import hf_greedy

    calls = []
    real = gated_delta.gated_delta_prefill
    monkeypatch.setattr(gated_delta, "gated_delta_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    ps = prompts()
    triton = [o.token_ids for o in run(ckpt, ps, chunked_prefill_size=48, max_running_requests=4)]
    assert calls, "the Triton delta rule was not used"
    with monkeypatch.context() as m:
        reference_path(m)
        ref = [o.token_ids for o in run(ckpt, ps, attention_backend="torch", enforce_eager=True)]
    assert triton == ref
    assert ref[0] == hf_greedy(ckpt, ps[0], 32)


def test_bf16_first_token_close_to_reference_at_qwen35_head_dims(tmp_path, monkeypatch):
    """Qwen3.5's linear-attention heads (K = V = 128, 16 key / 32 value heads, conv width 4), full attention with
    head_dim 256 and a quarter rotating, dummy bf16 weights: the first token of a 700-token prompt (eleven of the
    delta rule's chunks) and its top logprobs agree with the reference path's within bf16 noise."""
    cfg = {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 4096,
        "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "intermediate_size": 2048,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "initializer_range": 0.05, "torch_dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(10, 4000, (700,), generator=torch.Generator().manual_seed(1)).tolist()
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, logprobs=5)

    def first_token(**kw):
        out = run(str(tmp_path), [ids], sp, load_format="dummy", dtype="bfloat16", **kw)[0]
        return out.token_ids[0], dict(out.outputs[0].top_logprobs[0])

    tok, lps = first_token()
    with monkeypatch.context() as m:
        reference_path(m)
        ref_tok, ref_lps = first_token(attention_backend="torch", enforce_eager=True)
    assert tok in list(ref_lps)[:2] and ref_tok in list(lps)[:2]
    for t, lp in ref_lps.items():
        if t in lps:
            assert abs(lps[t] - lp) < 0.1


def test_prefix_hits_resume_from_state_checkpoints(tmp_path):
    """Prefix caching with the Triton kernels and the decode graphs: a repeated long prompt and the questions of
    one document resume from the states their predecessors saved (copied between slot and checkpoint rows on the
    device), and give the tokens and logprobs of the same prompts computed without the cache."""
    from longserve.cache.manager import MIN_CHECKPOINT_TOKENS

    path = make_tiny_checkpoint(tmp_path, "qwen3_5_moe", seed=3, max_position_embeddings=4096)
    g = torch.Generator().manual_seed(4)
    doc = torch.randint(10, 500, (MIN_CHECKPOINT_TOKENS + 64,), generator=g).tolist()
    q = torch.randint(10, 500, (20,), generator=g).tolist()
    ps = [doc + q, doc + q, doc + q[::-1], doc + q[1:]]
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)

    def each(**kw):
        with LLM(path, device="cuda", dtype="float32", max_total_tokens=8192, page_size=16, **kw) as llm:
            outs = [llm.generate([p], sp)[0] for p in ps]  # one after another: each may hit the one before
            llm.engine.check_integrity()
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], [
            o.cached_tokens for o in outs
        ]

    expected, _ = each(enable_prefix_caching=False)
    got, cached = each()
    # the first prompt is one chunk, which saves its state inside itself on the kernels' last 64-token boundary
    # before its last full page (cache/manager.py IN_STEP_SAVES): the document's end, where the others resume
    saved = (len(ps[0]) - 1) // 16 * 16 // 64 * 64
    assert saved == len(doc) and cached == [0, saved, saved, saved]
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert max(abs(a - b) for (_, x), (_, y) in zip(got, expected) for a, b in zip(x, y)) < 5e-3
