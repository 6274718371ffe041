"""The fp8 KV cache through the engine on the CPU: close to the fp32-KV run and the same top-1 wherever that
run's margin is large, the scheduling paths (prefix cache on/off, chunked prefill, preemption) equal to each
other, twice the tokens of a 16-bit cache in the same memory, the checkpoint's k_scale/v_scale, and the flag's
bad values refused."""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch
from safetensors.torch import load_file, save_file

from longserve import LLM, SamplingParams
from longserve.config import EngineConfig, SettingsError
from longserve.testing.checkpoints import make_tiny_checkpoint

GREEDY24 = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
# this 2-layer random model amplifies e4m3's 2^-4 relative rounding of K/V (random weights make a flat,
# sensitive distribution): measured over 300+ teacher-forced positions the |logprob| change averages ~0.13
# nats with a maximum under 0.9; these bounds leave room and still fail on a broken read (scales
# dropped, bytes misread: errors of many nats) or a cache that is not fp8 at all (no change)
MEAN_TOL, MAX_TOL, MARGIN = 0.25, 1.5, 1.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def llm(path, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    kw.setdefault("max_total_tokens", 4096)
    return LLM(path, **kw)


def prompts(n=4, shared=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(10, 500, (shared,), generator=g).tolist()
    return [head + torch.randint(10, 500, (5 + 13 * i,), generator=g).tolist() for i in range(n)]


def assert_clean(engine):
    engine.check_integrity()
    engine.flush_cache()
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def test_fp8_logprobs_close_to_fp32_kv_and_same_top1_where_margins_are_large(ckpt):
    ps = prompts(seed=1)
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=2)
    auto = llm(ckpt).generate(ps, sp)
    fp8_llm = llm(ckpt, kv_cache_dtype="fp8")
    assert fp8_llm.engine.runner.kv_cache.k[0].dtype == torch.float8_e4m3fn
    fp8 = fp8_llm.generate(ps, sp)
    diffs, large, agree = [], 0, 0
    for a, b in zip(auto, fp8):
        for i in range(1, len(a.prompt_logprobs)):
            diffs.append(abs(a.prompt_logprobs[i] - b.prompt_logprobs[i]))
            top_a, top_b = a.prompt_top_logprobs[i], b.prompt_top_logprobs[i]
            if top_a[0][1] - top_a[1][1] > MARGIN:
                large += 1
                agree += top_a[0][0] == top_b[0][0]
    assert 1e-3 < statistics.mean(diffs) < MEAN_TOL and max(diffs) < MAX_TOL
    assert large >= 20 and agree == large


@pytest.fixture(scope="module")
def baseline(ckpt):
    """Each prompt alone through the fp8 cache, unchunked, no prefix cache."""
    ps = prompts()
    alone = []
    for p in ps:
        m = llm(ckpt, kv_cache_dtype="fp8", enable_prefix_caching=False, chunked_prefill_size=4096)
        alone.append(m.generate([p], GREEDY24)[0].token_ids)
    return ps, alone


def run_all(path, ps, **kw):
    m = llm(path, kv_cache_dtype="fp8", **kw)
    outs = m.generate(ps, GREEDY24)
    assert_clean(m.engine)
    return [o.token_ids for o in outs], m.engine


@pytest.mark.parametrize("chunk", [7, 64])
def test_fp8_chunked_prefill_equals_unchunked(ckpt, baseline, chunk):
    ps, alone = baseline
    toks, _ = run_all(ckpt, ps, enable_prefix_caching=False, chunked_prefill_size=chunk)
    assert toks == alone


def test_fp8_prefix_cache_on_equals_off(ckpt, baseline):
    ps, alone = baseline
    m = llm(ckpt, kv_cache_dtype="fp8", enable_prefix_caching=True, page_size=4)
    first = [o.token_ids for o in m.generate(ps, GREEDY24)]
    again = m.generate(ps, GREEDY24)  # every prompt's pages now come from the cache, in e4m3
    assert first == alone and [o.token_ids for o in again] == alone
    assert all(o.cached_tokens >= len(p) - 4 for o, p in zip(again, ps))
    assert_clean(m.engine)


def test_fp8_forced_preemption_equals_no_preemption(ckpt, baseline):
    ps, alone = baseline
    toks, engine = run_all(ckpt, ps, enable_prefix_caching=True, max_total_tokens=176, page_size=16)
    assert engine.scheduler.num_preemptions > 0
    assert toks == alone


def test_memory_plan_holds_twice_the_tokens_of_bf16(ckpt, monkeypatch):
    import longserve.platform as platform

    # the same memory budget for both: 1 GiB total and free, 1/256 of it for weights + KV
    monkeypatch.setattr(platform, "available_memory_bytes", lambda device: (2**30, 2**30))
    plans = {}
    for kv in ("auto", "fp8_e4m3"):
        m = LLM(ckpt, dtype="bfloat16", device="cpu", kv_cache_dtype=kv, mem_fraction_static=1 / 256)
        plans[kv] = m.engine.runner.memory_plan
        assert_clean(m.engine)
    auto, fp8 = plans["auto"], plans["fp8_e4m3"]
    assert (auto["kv_cache_dtype"], fp8["kv_cache_dtype"]) == ("bfloat16", "float8_e4m3fn")
    assert auto["kv_bytes_per_token"] == 2 * fp8["kv_bytes_per_token"]
    # page rounding: within one page of exactly twice
    assert abs(fp8["kv_pool_tokens"] - 2 * auto["kv_pool_tokens"]) <= 2 * 16
    assert fp8["kv_pool_bytes"] <= 2**30 / 256


def test_checkpoint_kv_scales_are_used(ckpt, tmp_path):
    """A checkpoint with calibrated scales (self_attn.k_scale / v_scale, as vLLM reads them) loads: the fp8
    cache stores x / scale with them; the 16-bit cache ignores them."""
    import shutil

    path = tmp_path / "scaled"
    shutil.copytree(ckpt, path)
    (weights,) = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    tensors = load_file(path / weights)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(2.0)
    save_file(tensors, path / weights, metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        for name in ("model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale",
                     "model.layers.1.self_attn.kv_scale"):  # fmt: skip
            data["weight_map"][name] = weights
        index.write_text(json.dumps(data))
    m = llm(str(path), kv_cache_dtype="fp8")
    cache = m.engine.runner.kv_cache
    assert (cache.k_scales, cache.v_scales) == ([0.5, 2.0], [0.25, 2.0])
    p = prompts(1)[0]
    out = m.generate([p], GREEDY24)[0].token_ids
    k0 = cache.k[0].float()
    assert k0.abs().max() > 0
    plain = llm(ckpt, kv_cache_dtype="fp8").generate([p], GREEDY24)[0].token_ids
    assert len(out) == len(plain) == 24  # the scaled cache runs (its rounding differs from scale 1.0)
    assert llm(str(path)).engine.runner.kv_cache.k_scales == [1.0, 1.0]  # auto: unused


def test_kv_cache_dtype_values(ckpt):
    assert EngineConfig(model=ckpt, kv_cache_dtype="FP8").kv_cache_dtype == "fp8_e4m3"
    assert EngineConfig(model=ckpt, kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    assert EngineConfig(model=ckpt).kv_cache_dtype == "auto"
    for bad in ("fp8_e5m2", "int8", "bf16"):
        with pytest.raises(SettingsError, match="kv_cache_dtype must be auto"):
            EngineConfig(model=ckpt, kv_cache_dtype=bad)
