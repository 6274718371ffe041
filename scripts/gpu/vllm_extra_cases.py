"""vLLM's side of the cases issue 19 adds to the anchor scripts (../shared/anchors: bench_vllm.py, vllm_decode.py):
a 32K cached prefix + 1024 (and + 64) new tokens, and decode at batch 16 with 8K contexts. Offline `LLM`, dummy
Llama-3.1-8B shape (the model folder bench_vllm.py writes), the anchors' engine settings and measures:
prefix hit = wall of a 1-token generate whose first 32768 tokens are cached (best of 3 fresh suffixes);
decode ITL = (wall(161 tokens) - wall(33 tokens)) / 128 over prompts already in the prefix cache, and vLLM's own
per-request figure from the same 161-token runs (its RequestStateStats, logged with disable_log_stats=False:
(last_token_ts - first_token_ts) / (tokens - 1), engine-core timestamps, no prefill in it), the median request.
The stats cost vLLM some host time per step, in every figure here (the anchors' bench_vllm.py and vllm_decode.py
run with them off, as vLLM's LLM defaults): compare their shared cases before reading a ratio from these.

    PYTHONPATH=/tmp/site python3 scripts/gpu/vllm_extra_cases.py   # after bench_vllm.py wrote the model
"""

import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.environ.get("VLLM_SITE", "/tmp/site"))
for key, value in (("VLLM_USE_FLASHINFER_SAMPLER", "0"), ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
                   ("HF_HUB_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1")):  # fmt: skip
    os.environ.setdefault(key, value)

from vllm import LLM, SamplingParams  # noqa: E402

llm = LLM(model="/tmp/llama31_8b_dummy", load_format="dummy", dtype="bfloat16", max_model_len=131072,
          enable_prefix_caching=True, gpu_memory_utilization=0.85, seed=0, disable_log_stats=False,
          attention_config={"backend": "FLASH_ATTN", "flash_attn_version": 3})  # fmt: skip
rng = random.Random(1)


def ids(n):
    return [rng.randrange(1000, 120000) for _ in range(n)]


engine_itls_ms = []  # the last wall()'s per-request decode ITLs by vLLM's own timestamps


def wall(prompts, k):
    sp = SamplingParams(max_tokens=k, min_tokens=k, ignore_eos=True, temperature=0)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    elapsed = time.perf_counter() - t
    engine_itls_ms.clear()
    for out in outs:
        m = out.metrics
        if m is not None and m.num_generation_tokens > 1:
            engine_itls_ms.append((m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1) * 1e3)
    return elapsed


wall([ids(256)], 8)  # warm up
prefix = ids(32768)
wall([prefix + ids(16)], 1)  # the prefix into the cache
for new in (64, 1024):
    runs = [wall([prefix + ids(new)], 1) for _ in range(3)]
    print(json.dumps({"engine": "vllm-0.24.0", "case": "prefix_hit", "cached": 32768, "new": new,
                      "wall_s": round(min(runs), 5), "runs_s": [round(r, 5) for r in runs]}), flush=True)  # fmt: skip
cold = wall([ids(32768)], 1)
print(
    json.dumps({"engine": "vllm-0.24.0", "case": "cold_control", "tokens": 32768, "wall_s": round(cold, 4)})
)
# ITL as the difference of two long generations over cached prompts, (wall(K2) - wall(K1)) / (K2 - K1): both walls
# include the same prefill, which cancels (with wall(1) as the base, as vllm_decode.py has it, vLLM's batch-64
# figure moved from 13.68 to 10.85 ms between two scripts in one call, 2026-12-02, because the 1-token walls
# varied from 0.54 to 0.88 s). It did not settle it: 10.27 ms by the walls against 13.43 by vllm_decode.py in one
# call (2026-12-03, 0949067), where a step must read 50.4 GB (16 GB of weights, 64 x 4096 tokens of K/V at 128 KB):
# 4.9 TB/s at 10.27 ms, over the H200's 4.8 peak. Hence vLLM's own timestamps beside it (itl_engine_ms).
for bs, ctx in [(16, 8192), (1, 32768), (64, 4096)]:
    ps = [ids(ctx) for _ in range(bs)]
    wall(ps, 1)  # prefill into the cache
    k1, k2 = 33, 161
    w1 = min(wall(ps, k1) for _ in range(2))
    w2s, engine = [], []
    for _ in range(2):
        w2s.append(wall(ps, k2))
        engine.append(statistics.median(engine_itls_ms) if engine_itls_ms else None)
    w2 = min(w2s)
    print(json.dumps({"engine": "vllm-0.24.0", "case": "decode_itl", "batch": bs, "context": ctx,
                      "itl_ms": round((w2 - w1) / (k2 - k1) * 1e3, 3), "k": [k1, k2], "walls_s": [round(w1, 4), round(w2, 4)],
                      "itl_engine_ms": [None if e is None else round(e, 3) for e in engine]}), flush=True)  # fmt: skip
