"""Mixture-of-experts models end to end on the CPU through the LLM API: 32 greedy tokens equal to
transformers' `generate` for Qwen3-MoE, Qwen2-MoE and Mixtral (the experts of one checkpoint stacked, of the
others one tensor each; tests/model checks both layouts give the same logits), and every scheduling path
(prefix cache on/off, chunk sizes 1/7/64, forced preemption, a batch) gives the tokens of each prompt run
alone, on Mixtral (its sliding window of 8 meets chunk boundaries and cached prefixes); the memory plan
counts the experts."""

from __future__ import annotations

import pytest

from longserve import LLM, SamplingParams
from longserve.testing.checkpoints import MOE_ARCHS, make_tiny_checkpoint
from tests.e2e.test_engine import DEVICE, GREEDY32, assert_clean, hf_greedy, prompts


def llm(path, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", DEVICE)
    kw.setdefault("max_total_tokens", 4096)
    return LLM(path, **kw)


@pytest.mark.parametrize(
    ("arch", "layout"), list(zip(MOE_ARCHS, ["stacked", "per_expert", "per_expert"], strict=True))
)
def test_greedy_equals_transformers(tmp_path, arch, layout):
    path = make_tiny_checkpoint(tmp_path, arch, seed=3, expert_layout=layout)
    ids = prompts(1, shared=24)[0]
    expected = hf_greedy(path, ids, 32)
    assert len(set(expected)) > 4, "degenerate reference output: the test would prove little"
    engine_llm = llm(path, page_size=16, chunked_prefill_size=16)  # the prompt spans two chunks
    out = engine_llm.generate(ids, GREEDY32)[0]
    assert out.token_ids == expected
    assert_clean(engine_llm.engine)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mixtral"), "mixtral", seed=5)


def run_all(path, ps, params=GREEDY32, **kw):
    m = llm(path, **kw)
    outs = m.generate(ps, params)
    assert_clean(m.engine)
    return [o.token_ids for o in outs], m.engine


@pytest.fixture(scope="module")
def baseline(moe_ckpt):
    """Each prompt alone, unchunked, no prefix cache."""
    ps = prompts()
    alone = [run_all(moe_ckpt, [p], enable_prefix_caching=False, chunked_prefill_size=4096)[0][0] for p in ps]
    assert len({tuple(t) for t in alone}) == len(ps)
    return ps, alone


def test_batch_equals_each_alone(moe_ckpt, baseline):
    ps, alone = baseline
    assert run_all(moe_ckpt, ps, enable_prefix_caching=False, chunked_prefill_size=4096)[0] == alone


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_unchunked(moe_ckpt, baseline, chunk):
    ps, alone = baseline
    assert run_all(moe_ckpt, ps, enable_prefix_caching=False, chunked_prefill_size=chunk)[0] == alone


def test_prefix_cache_on_equals_off(moe_ckpt, baseline):
    ps, alone = baseline
    m = llm(moe_ckpt, enable_prefix_caching=True, page_size=4)
    first = [o.token_ids for o in m.generate(ps, GREEDY32)]
    again = m.generate(ps, GREEDY32)  # every prompt is cached now
    assert first == alone and [o.token_ids for o in again] == alone
    assert all(o.cached_tokens >= len(p) - 4 for o, p in zip(again, ps))
    assert_clean(m.engine)


def test_forced_preemption_equals_no_preemption(moe_ckpt, baseline):
    ps, alone = baseline
    for caching in (False, True):  # 12 pages of 16 tokens cannot hold the four requests at once
        toks, engine = run_all(
            moe_ckpt, ps, enable_prefix_caching=caching, max_total_tokens=192, page_size=16
        )
        assert engine.scheduler.num_preemptions > 0
        assert toks == alone


def test_memory_plan_counts_the_experts(moe_ckpt):
    """The start-up line and /server_info's "memory" (ModelRunner.memory_plan) split the experts out."""
    m = llm(moe_ckpt, max_total_tokens=1024, page_size=16)
    runner = m.engine.runner
    plan = runner.memory_plan
    experts = [mod for mod in runner.model.modules() if hasattr(mod, "required_shards")]
    assert plan["moe_layers"] == len(experts) > 0
    assert plan["expert_weight_bytes"] == sum(p.numel() * 4 for e in experts for p in e.parameters())
    assert (
        plan["weight_bytes"]
        == sum(p.numel() * 4 for p in runner.model.parameters())
        > plan["expert_weight_bytes"]
    )
    assert (
        plan["kv_pool_tokens"] == 1024 and plan["requests_at_full_context"] == 1024 / plan["context_length"]
    )
    assert f"MoE layers of {plan['num_experts']} experts" in runner.describe()


def test_triton_alignment_batch_equals_each_alone(moe_ckpt, baseline, monkeypatch):
    """The MoE layers on their Triton path (fused_moe, as on CUDA; interpreted here) with the one-launch Triton
    alignment switched on (kernels/moe_align.py's MOE_TRITON_ALIGN_MAX_PAIRS): a batch of the four prompts,
    chunked, gives each prompt's tokens run alone on the torch reference. 8 tokens, not 32: the interpreted
    kernels made this CI's slowest test (51 s on the 2-core machine), and the chunks and the first decode
    batches are where the alignment's row counts vary."""
    pytest.importorskip("triton")
    from longserve.kernels import moe_align as align_mod
    from longserve.models import moe as moe_mod

    calls = []
    real = align_mod.moe_align
    monkeypatch.setattr(align_mod, "moe_align", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(align_mod, "MOE_TRITON_ALIGN_MAX_PAIRS", 4096)
    monkeypatch.setattr(moe_mod, "use_triton", lambda t: True)  # as for CUDA tensors with triton
    ps, alone = baseline
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    out = run_all(moe_ckpt, ps, params, enable_prefix_caching=False, chunked_prefill_size=64)[0]
    assert out == [a[:8] for a in alone]
    assert calls, "the Triton alignment did not run"
