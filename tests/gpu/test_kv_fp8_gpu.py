"""The fp8 (e4m3) KV cache on a GPU: the Triton kernels (extend, decode, split-K) on e4m3 pages with bf16
queries against their references; the engine's Triton backend with CUDA graphs (decode and prefill chunks),
chunked prefill and prefix hits against the torch reference backend on the same fp8 cache; and the fp8 run
against the auto (16-bit) KV run of the same checkpoint."""

from __future__ import annotations

import statistics

import pytest
import torch

from longserve import LLM, SamplingParams
from longserve.attention import KVCache, build_metadata
from longserve.testing.checkpoints import make_tiny_checkpoint
from tests.gpu.test_engine_gpu import prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gpu_fp8"), "qwen3", num_layers=3)


def run(path, ps, **kw):
    llm = LLM(path, dtype=kw.pop("dtype", "float32"), device="cuda", max_total_tokens=8192, **kw)
    outs = llm.generate(ps, GREEDY)
    llm.engine.check_integrity()
    return [o.token_ids for o in outs], llm


def test_triton_fp8_graphs_chunks_prefix_hits_equal_reference_fp8(ckpt):
    ps = prompts()
    ref, _ = run(ckpt, ps, kv_cache_dtype="fp8", attention_backend="torch", enforce_eager=True)
    eager, _ = run(ckpt, ps, kv_cache_dtype="fp8", attention_backend="triton", enforce_eager=True,
                   chunked_prefill_size=32)  # fmt: skip
    graphs, llm = run(ckpt, ps, kv_cache_dtype="fp8", attention_backend="triton", chunked_prefill_size=32,
                      page_size=16)  # fmt: skip
    assert llm.engine.runner.graph_runner is not None and llm.engine.runner.kv_cache.k[0].dtype == FP8
    assert eager == ref
    assert graphs == ref
    cached, _ = run(
        ckpt, ps + ps, kv_cache_dtype="fp8", attention_backend="triton"
    )  # second half: prefix hits
    assert cached == ref + ref


def test_bf16_fp8_kv_close_to_auto_kv(ckpt):
    ps = prompts(4, seed=3)
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=2)
    res = {}
    for kv in ("auto", "fp8"):
        llm = LLM(ckpt, dtype="bfloat16", device="cuda", attention_backend="triton", max_total_tokens=8192,
                  kv_cache_dtype=kv)  # fmt: skip
        res[kv] = llm.generate(ps, sp)
    diffs, large, agree = [], 0, 0
    for a, b in zip(res["auto"], res["fp8"]):
        for i in range(1, len(a.prompt_logprobs)):
            diffs.append(abs(a.prompt_logprobs[i] - b.prompt_logprobs[i]))
            if a.prompt_top_logprobs[i][0][1] - a.prompt_top_logprobs[i][1][1] > 1.0:
                large += 1
                agree += a.prompt_top_logprobs[i][0][0] == b.prompt_top_logprobs[i][0][0]
    assert statistics.mean(diffs) < 0.3 and max(diffs) < 2.0  # see tests/e2e/test_kv_fp8_engine.py
    assert large > 0 and agree == large


@pytest.mark.parametrize("splits", [1, 4])
def test_fp8_kernels_bf16_equal_references(splits):
    from longserve.kernels.decode_attention import decode_attention, decode_attention_ref
    from longserve.kernels.extend_attention import extend_attention, extend_attention_ref

    g = torch.Generator(device="cuda").manual_seed(splits)
    page_size, hq, hkv, d = 16, 32, 8, 128
    prefix_lens, query_lens = [0, 700, 2000], [300, 64, 1]
    seq = [p + q for p, q in zip(prefix_lens, query_lens)]
    need = [-(-s // page_size) for s in seq]
    perm = torch.randperm(sum(need) + 2, device="cuda", generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    meta = build_metadata(prefix_lens, query_lens, tables, page_size, "cuda")
    cache = KVCache(1, sum(need) + 2, page_size, hkv, d, FP8, "cuda")
    cache.set_scales([0.05], [0.02])
    k_all = torch.randn(sum(seq), hkv, d, device="cuda", generator=g, dtype=torch.bfloat16) * 4
    v_all = torch.randn(sum(seq), hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    slots = build_metadata([0, 0, 0], seq, tables, page_size, "cuda").slot_mapping
    cache.store(0, slots, k_all, v_all)
    q = torch.randn(sum(query_lens), hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    args = (q, cache.k[0], cache.v[0], meta.query_start_loc, meta.prefix_lens, meta.seq_lens, meta.page_table,
            page_size, meta.max_query_len, d**-0.5)  # fmt: skip
    out = extend_attention(*args, num_splits=splits, k_scale=0.05, v_scale=0.02)
    ref = extend_attention_ref(*args, k_scale=0.05, v_scale=0.02)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    qd = torch.randn(3, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    seq_t = torch.tensor(seq, dtype=torch.int32, device="cuda")
    dargs = (qd, cache.k[0], cache.v[0], seq_t, meta.page_table, page_size, d**-0.5, None, splits)
    out = decode_attention(*dargs, k_scale=0.05, v_scale=0.02)
    ref = decode_attention_ref(*dargs, k_scale=0.05, v_scale=0.02)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
