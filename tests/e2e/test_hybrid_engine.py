"""Hybrid linear/full-attention models (Qwen3.5 dense, Qwen3.5-MoE as the vision-language checkpoint) end to end
through the LLM API on the CPU: 32 greedy tokens equal to transformers' `generate`; a batch, chunks of 1/7/64
tokens, more prompts than state slots, forced preemption and n > 1 each give the tokens of each prompt run alone
(prompts below the state-checkpoint floor: nothing is shared; the hits are tests/e2e/test_hybrid_prefix_cache.py);
every page and state slot comes back (`assert_clean`, whose integrity check covers the slots); an abort mid-prompt
frees its slot."""

from __future__ import annotations

import pytest

from longserve import LLM, SamplingParams
from longserve.cache.state_radix_tree import StateRadixTree
from longserve.testing.checkpoints import HYBRID_ARCHS, make_tiny_checkpoint
from tests.e2e.test_engine import DEVICE, GREEDY32, assert_clean, hf_greedy, prompts


def llm(path, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", DEVICE)
    kw.setdefault("max_total_tokens", 4096)
    return LLM(path, **kw)


def run_all(path, ps, params=GREEDY32, **kw):
    m = llm(path, **kw)
    outs = m.generate(ps, params)
    assert_clean(m.engine)
    assert m.engine.kv.states.num_free == m.engine.kv.states.num_total > 0  # every state slot back
    return [o.token_ids for o in outs], m.engine


def fraction_leaving(monkeypatch):
    """A device of 1 TiB with 1 GiB in use (the weights): f(budget) is the mem_fraction_static that leaves `budget`
    bytes beside them for the states and the KV pool."""
    from longserve import platform

    total, used = 2**40, 2**30
    monkeypatch.setattr(platform, "available_memory_bytes", lambda device: (total, total - used))
    return lambda budget: (used + budget) / total


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_greedy_equals_transformers(tmp_path, arch):
    path = make_tiny_checkpoint(tmp_path, arch, seed=3)
    ids = prompts(1, shared=90)[0]  # past one of the delta rule's 64-token chunks
    expected = hf_greedy(path, ids, 32)
    assert len(set(expected)) > 4, "degenerate reference output: the test would prove little"
    out, engine = run_all(path, [ids], chunked_prefill_size=48)  # the prompt spans two steps
    assert out[0] == expected
    assert isinstance(engine.kv.prefix_cache, StateRadixTree)  # the default: prefix caching on


@pytest.fixture(scope="module")
def hybrid_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_5_moe"), "qwen3_5_moe", seed=5)


@pytest.fixture(scope="module")
def baseline(hybrid_ckpt):
    """Each prompt alone, in one step."""
    ps = prompts()
    alone = [run_all(hybrid_ckpt, [p], chunked_prefill_size=4096)[0][0] for p in ps]
    assert len({tuple(t) for t in alone}) == len(ps)
    return ps, alone


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_batch_and_chunks_equal_each_alone(hybrid_ckpt, baseline, chunk):
    ps, alone = baseline
    # two state slots for four prompts: the later two wait for the first two's slots
    toks, engine = run_all(hybrid_ckpt, ps, chunked_prefill_size=chunk, max_running_requests=2)
    assert toks == alone
    assert engine.kv.states.num_total == 2


def test_forced_preemption_equals_no_preemption(hybrid_ckpt, baseline):
    ps, alone = baseline
    # 12 pages of 16 tokens cannot hold the four requests at once: a preempted one starts again from zero
    toks, engine = run_all(hybrid_ckpt, ps, max_total_tokens=192, page_size=16)
    assert engine.scheduler.num_preemptions > 0
    assert toks == alone


def test_siblings_compute_their_own_prompts(hybrid_ckpt, baseline):
    """n > 1 on prompts below the checkpoint floor (no state saved to share): each sibling computes the prompt,
    same greedy tokens."""
    ps, alone = baseline
    m = llm(hybrid_ckpt)
    params = SamplingParams(n=3, max_new_tokens=32, temperature=0.0, ignore_eos=True)
    out = m.generate(ps[:2], params)
    assert [[c.token_ids for c in o.outputs] for o in out] == [[alone[0]] * 3, [alone[1]] * 3]
    assert_clean(m.engine)


def test_abort_mid_prompt_frees_its_slot(hybrid_ckpt, baseline):
    ps, alone = baseline
    m = llm(hybrid_ckpt, chunked_prefill_size=8, max_running_requests=1)
    engine = m.engine
    engine.add_request(ps[3], GREEDY32, request_id="long")
    engine.step()  # its first chunk: it holds the one slot
    assert engine.kv.states.num_free == 0
    engine.abort("long")
    assert engine.kv.states.num_free == 1
    assert [o.token_ids for o in m.generate([ps[0]], GREEDY32)] == [alone[0]]  # the slot serves afresh
    assert_clean(engine)


def test_state_dtype_follows_the_setting(hybrid_ckpt, baseline):
    """--mamba-ssm-cache-dtype: auto (the model's dtype) by default, bfloat16 halves the delta rule's float32
    states (the convs' inputs stay in the model's dtype); a value it does not know is refused by name."""
    import torch

    ps, alone = baseline
    plans = {}
    for given, expected in (
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("auto", torch.float32),
    ):
        m = llm(hybrid_ckpt, mamba_ssm_cache_dtype=given, max_running_requests=4)
        runner = m.engine.runner
        assert {t.dtype for t in runner.states.ssm} == {expected} and runner.states.conv[
            0
        ].dtype == torch.float32
        plans[given] = runner.memory_plan["state_bytes"]
        out = [o.token_ids for o in m.generate(ps[:1], GREEDY32)]
        if given != "bfloat16":
            assert out == alone[:1]
        assert_clean(m.engine)
    ssm = sum(t.numel() for t in runner.states.ssm)
    assert plans["float32"] - plans["bfloat16"] == 2 * ssm == plans["auto"] - plans["bfloat16"]
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype must be one of auto, float32"):
        llm(hybrid_ckpt, mamba_ssm_cache_dtype="fp8")
    m = llm(
        hybrid_ckpt, dtype="bfloat16", max_running_requests=2
    )  # unset: the model's dtype, as vLLM keeps it
    assert {t.dtype for t in (*m.engine.runner.states.ssm, *m.engine.runner.states.conv)} == {torch.bfloat16}
    # vLLM's --mamba-cache-dtype: the conv state, and the delta rule's unless --mamba-ssm-cache-dtype is given
    for kw, conv, ssm in (
        (dict(mamba_cache_dtype="float32"), torch.float32, torch.float32),
        (dict(mamba_cache_dtype="float32", mamba_ssm_cache_dtype="bfloat16"), torch.float32, torch.bfloat16),
    ):
        m = llm(hybrid_ckpt, dtype="bfloat16", max_running_requests=2, **kw)
        states = m.engine.runner.states
        assert {t.dtype for t in states.conv} == {conv} and {t.dtype for t in states.ssm} == {ssm}
        assert len(m.generate(ps[:2], GREEDY32)[1].token_ids) == 32
        assert_clean(m.engine)
    m = llm(hybrid_ckpt, mamba_cache_dtype="bfloat16", max_running_requests=2)  # a float32 model, bf16 states
    assert {t.dtype for t in (*m.engine.runner.states.ssm, *m.engine.runner.states.conv)} == {torch.bfloat16}
    with pytest.raises(ValueError, match="mamba_cache_dtype must be one of auto, float32"):
        llm(hybrid_ckpt, mamba_cache_dtype="int8")


def test_state_slots_fit_half_the_memory_left(hybrid_ckpt, baseline, monkeypatch, caplog):
    """States that would take more than half the memory the weights leave get fewer slots than --max-num-seqs (a
    warning says so) and requests wait for one; none fitting is a start-up error naming what to change."""
    import logging

    from longserve.runner import state_plan

    ps, alone = baseline
    m = llm(hybrid_ckpt, max_running_requests=4)
    per_slot = m.engine.runner.states.nbytes // 4
    fraction = fraction_leaving(monkeypatch)
    budget = 3.5 * per_slot / state_plan.STATE_SHARE  # what mem_fraction_static leaves beside the weights
    with caplog.at_level(logging.WARNING, logger="longserve.runner"):
        m = llm(hybrid_ckpt, max_running_requests=4, mem_fraction_static=fraction(budget))
    assert m.engine.kv.states.num_total == 3 and "3 recurrent-state slots" in caplog.text
    assert [o.token_ids for o in m.generate(ps, GREEDY32)] == alone  # four prompts over three slots
    assert_clean(m.engine)
    with pytest.raises(
        RuntimeError, match="no memory for one recurrent-state slot.*mamba-ssm-cache-dtype bfloat16"
    ):
        llm(hybrid_ckpt, mem_fraction_static=fraction(100))


def test_mamba_full_memory_ratio_sets_the_states_share(hybrid_ckpt, baseline, monkeypatch, caplog):
    """SGLang's --mamba-full-memory-ratio r: state rows may take r / (1 + r) of the memory the weights leave. With room
    for 8 rows at the default half (r = 1), r = 1/3 (a quarter) leaves room for 4: two running slots and two
    prefix-cache checkpoints, a warning, and four prompts served over the two slots; r = 0 is refused by name."""
    import logging

    from longserve.config import ConfigError

    ps, alone = baseline
    per_slot = (
        llm(hybrid_ckpt, max_running_requests=4).engine.runner.states.nbytes // 8
    )  # slots + checkpoints
    frac = fraction_leaving(monkeypatch)(16.5 * per_slot)  # 8.25 rows at half, 4.1 at a quarter
    m = llm(hybrid_ckpt, max_running_requests=4, mem_fraction_static=frac)
    assert (m.engine.kv.states.num_total, m.engine.runner.num_state_checkpoints) == (4, 4)
    with caplog.at_level(logging.WARNING, logger="longserve.runner"):
        m = llm(hybrid_ckpt, max_running_requests=4, mem_fraction_static=frac, mamba_full_memory_ratio=1 / 3)
    assert (m.engine.kv.states.num_total, m.engine.runner.num_state_checkpoints) == (2, 2)
    assert "2 recurrent-state slots" in caplog.text and "25% of the memory the weights leave" in caplog.text
    assert [o.token_ids for o in m.generate(ps, GREEDY32)] == alone
    assert_clean(m.engine)
    with pytest.raises(ConfigError, match="mamba_full_memory_ratio must be a number > 0"):
        llm(hybrid_ckpt, mamba_full_memory_ratio=0)


def test_warm_up_touches_no_state_slot(hybrid_ckpt, baseline):
    """The warm-up's passes run in slot -1: a request's state (here: every slot's contents) is left as it was."""
    import torch

    ps, alone = baseline
    m = llm(hybrid_ckpt, max_running_requests=2)
    m.generate(ps[:2], GREEDY32)
    states = m.engine.runner.states
    before = [t.clone() for t in (*states.conv, *states.ssm)]
    assert any(float(t.abs().sum()) > 0 for t in before)
    m.engine.runner.warm_up([512])
    assert all(torch.equal(t, b) for t, b in zip((*states.conv, *states.ssm), before))
    assert [o.token_ids for o in m.generate(ps[2:], GREEDY32)] == alone[2:]
    assert_clean(m.engine)


def test_triton_kernels_share_each_steps_chunk_map(hybrid_ckpt, baseline, monkeypatch):
    """The Gated DeltaNet layers on their Triton kernels (interpreted), as on a GPU, prompts in chunks of 32 beside
    decodes: the reference path's tokens, each step's chunk numbering (`chunk_map`, seven small ops) computed
    once and handed to every layer's prefill rather than once a layer, and no gating launch in decode steps."""
    from longserve.kernels import gated_delta, gated_delta_chunk
    from longserve.models import gated_delta_net

    ps, alone = baseline
    monkeypatch.setattr(gated_delta_net, "use_triton", lambda x: True)
    maps, prefills = [], []
    real_map, real_prefill = gated_delta_chunk.chunk_map, gated_delta.gated_delta_prefill
    monkeypatch.setattr(gated_delta_chunk, "chunk_map", lambda *a: maps.append(1) or real_map(*a))
    monkeypatch.setattr(
        gated_delta,
        "gated_delta_prefill",
        lambda *a, **k: prefills.append(k["chunks"]) or real_prefill(*a, **k),
    )
    gatings, real_gating = [], gated_delta.gdn_gating
    monkeypatch.setattr(gated_delta, "gdn_gating", lambda *a: gatings.append(1) or real_gating(*a))
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    toks, engine = run_all(hybrid_ckpt, ps[:2], params, chunked_prefill_size=32)
    assert toks == [a[:6] for a in alone[:2]]
    linear_layers = sum(not layer.attends for layer in engine.runner.model.model.layers)
    assert linear_layers > 1 and maps and len(prefills) == linear_layers * len(maps)
    assert all(c is not None for c in prefills)
    # decode steps gate inside the decode kernel (FUSED_DECODE_GATING): the gating's own launch at prefills only
    assert len(gatings) == len(prefills)


@pytest.mark.parametrize(
    "kw",
    [
        {},  # every slot and as many checkpoints fit
        {"mamba_cache_mode": "none"},  # slots only
        {"max_mamba_cache_size": 3},
        {"mamba_ssm_cache_dtype": "bfloat16", "mamba_full_memory_ratio": 0.25},
        {"scarce": True},  # the states' share holds fewer rows than asked for
    ],
)
def test_bench_latency_plans_the_states_the_engine_allocates(hybrid_ckpt, monkeypatch, kw):
    """bench latency sizes its KV pool after a hybrid model's state rows (latency_plan.hybrid_state_bytes), as the
    engine sizes them (runner/state_plan.py): the same bytes from the same budget, in each of the settings' cases."""
    import json
    import os

    from longserve.bench.latency_plan import dtype_bytes, hybrid_state_bytes

    kw = dict(kw)
    scarce = kw.pop("scarce", False)
    per_row = llm(hybrid_ckpt, max_running_requests=4).engine.runner.states.nbytes // 8
    fraction = fraction_leaving(monkeypatch)
    # scarce: 11 rows at the default half, 5 slots beside 6 checkpoints
    budget = (11 if scarce else 100) * per_row / 0.5
    m = llm(hybrid_ckpt, max_running_requests=8, mem_fraction_static=fraction(budget), **kw)
    with open(os.path.join(hybrid_ckpt, "config.json")) as f:
        cfg = json.load(f)
    config = m.engine.config
    assert (
        hybrid_state_bytes(cfg, config, dtype_bytes(config, cfg), budget, 8) == m.engine.runner.states.nbytes
    )
    if scarce:
        assert m.engine.kv.states.num_total == 5


def test_sglang_state_and_kernel_flags_are_accepted_and_said_to_have_no_effect(hybrid_ckpt, baseline, caplog):
    """SGLang's --mamba-scheduler-strategy and kernel choices from its Qwen3.5 launch lines: the engine starts,
    says at start-up that they change nothing, and gives the same tokens (with its --mamba-track-interval, which
    acts: tests/e2e/test_hybrid_prefix_cache.py); a value SGLang does not know is refused."""
    import logging

    from longserve.config import ConfigError

    ps, alone = baseline
    with caplog.at_level(logging.INFO, logger="longserve"):
        m = llm(
            hybrid_ckpt, mamba_scheduler_strategy="extra_buffer", mamba_track_interval=128,
            linear_attn_backend="flashinfer", mamba_backend="triton",
        )  # fmt: skip
    assert "mamba_scheduler_strategy=extra_buffer (--mamba-scheduler-strategy) has no effect" in caplog.text
    assert "mamba_track_interval" not in caplog.text  # (it acts)
    assert (
        "mamba_backend=triton, linear_attn_backend=flashinfer (SGLang's linear-attention kernel"
        in caplog.text
    )
    assert [o.token_ids for o in m.generate(ps[:2], GREEDY32)] == alone[:2]
    assert_clean(m.engine)
    with pytest.raises(ConfigError, match="mamba_track_interval must be an integer >= 1 .decode tokens"):
        llm(hybrid_ckpt, mamba_track_interval=0)
    with pytest.raises(
        ConfigError, match="linear_attn_prefill_backend must be one of triton, cutedsl, flashinfer"
    ):
        llm(hybrid_ckpt, linear_attn_prefill_backend="cuda")
