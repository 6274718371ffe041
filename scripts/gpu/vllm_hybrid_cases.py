"""vLLM 0.24 against longserve on a hybrid (Gated DeltaNet + full attention) model, one GPU, offline: cold TTFT at
8K / 32K, a 32K cached prefix + 64 new tokens, decode at batch 1 over a 32K context. vLLM 0.24 serves Qwen3.5 only
as its vision-language model (`Qwen3_5MoeForConditionalGeneration`), so both engines run Qwen3-Next
(`Qwen3NextForCausalLM`, the same decoder layers: 3 of 4 linear attention, head dim 256, 2 KV heads, experts of
512 with a shared one), at Qwen3-Next-80B-A3B's sizes with 12 of its 48 layers (38.7 GB of experts: one H100 holds
them beside either engine's cache), or with `--dense` all 48 layers with dense MLPs (the slim vLLM anchor ships no
MoE kernels: vLLM's MoE model fails in its first forward), dummy weights, token-id prompts. vLLM measures as the anchors' scripts do: the
wall of a 1-token generate, best of 3 fresh prompts; decode ITL = (wall(161) - wall(33)) / 128 over a cached
prompt. vLLM caches a hybrid's prefix in its "align" mode (the default with prefix caching on), so its hit starts
from the last state it kept: the cached token count is printed beside each hit.

    python3 scripts/gpu/vllm_hybrid_cases.py --write-config DIR [--dense]  # DIR/config.json only (longserve's side)
    PYTHONPATH=/tmp/site python3 scripts/gpu/vllm_hybrid_cases.py DIR      # vLLM's side on that folder
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from longserve.bench.configs import BUILTIN_CONFIGS

LAYERS = 12
# Qwen3-Next-80B-A3B's text decoder: Qwen3.5-35B-A3B's layers (longserve/bench/configs.py) with 512 experts, top 10,
# Qwen3's vocabulary and plain rotary (no mrope sections), 12 layers
CONFIG = {
    **BUILTIN_CONFIGS["qwen3.5-35b-a3b"],
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "num_hidden_layers": LAYERS,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    * (LAYERS // 4),
    "full_attention_interval": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "intermediate_size": 5120,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "vocab_size": 151936,
    "rope_theta": 10000000.0,
    "partial_rotary_factor": 0.25,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


# the same decoder with dense MLPs in all 48 layers (Qwen3-Next's `mlp_only_layers`, intermediate 5120): the slim vLLM
# anchor ships no MoE kernels (`_moe_C`), so this is the hybrid shape both engines can run (GDN and attention layers
# as the MoE model's; 6.5 GB of bf16 weights)
DENSE_LAYERS = 48
DENSE_CONFIG = {
    **CONFIG,
    "num_hidden_layers": DENSE_LAYERS,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    * (DENSE_LAYERS // 4),
    "mlp_only_layers": list(range(DENSE_LAYERS)),
}


def write_config(folder: str, dense: bool = False) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(DENSE_CONFIG if dense else CONFIG, f, indent=1)


def vllm_cases(folder: str) -> None:
    site = os.environ.get("VLLM_SITE", "/tmp/site")
    sys.path.insert(0, site)
    # vLLM inspects the model class in a subprocess of its own (registry.py): the site must be on its path too
    os.environ["PYTHONPATH"] = os.pathsep.join([site, *filter(None, [os.environ.get("PYTHONPATH")])])
    for key, value in (("VLLM_USE_FLASHINFER_SAMPLER", "0"), ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
                       ("HF_HUB_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1")):  # fmt: skip
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams

    global MODEL
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    dense = len(cfg.get("mlp_only_layers") or []) == cfg["num_hidden_layers"]
    MODEL = f"qwen3-next {cfg['num_hidden_layers']} layers, {'dense MLPs' if dense else 'MoE'}"
    if dense:
        # vLLM 0.24's Qwen3-Next refuses a decoder with no MoE layer when it sets its expert-parallel bookkeeping
        # ("No Qwen3Next layer found in the model.layers.", forty-eighth session's call): with none there is nothing
        # to keep, so that one step is skipped (the engine core runs in this process:
        # VLLM_ENABLE_V1_MULTIPROCESSING=0 above); the forward is vLLM's own
        from vllm.model_executor.models import qwen3_next

        def no_experts(self) -> None:
            self.expert_weights, self.moe_layers, self.num_moe_layers = [], [], 0

        qwen3_next.QwenNextMixtureOfExperts.set_moe_parameters = no_experts
    t0 = time.perf_counter()
    llm = LLM(model=folder, load_format="dummy", dtype="bfloat16", max_model_len=40960, skip_tokenizer_init=True,
              enable_prefix_caching=True, gpu_memory_utilization=0.85, seed=0)  # fmt: skip
    emit(case="engine_ready", seconds=round(time.perf_counter() - t0, 1))
    rng = random.Random(1)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 150000) for _ in range(n)]

    def wall(prompt: list[int], k: int) -> tuple[float, int]:
        sp = SamplingParams(max_tokens=k, min_tokens=k, ignore_eos=True, temperature=0, detokenize=False)
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        return time.perf_counter() - t, int(out.num_cached_tokens or 0)

    wall(ids(256), 8)  # warm up
    for n in (8192, 32768):
        wall(ids(n), 1)
        runs = [wall(ids(n), 1)[0] for _ in range(3)]
        emit(case=f"cold-{n}", wall_s=round(min(runs), 5), runs_s=[round(r, 5) for r in runs])
    prefix = ids(32768)
    wall(prefix + ids(64), 1)  # the prefix (and what vLLM keeps of its states) into the cache
    hits = [wall(prefix + ids(64), 1) for _ in range(3)]
    emit(case="prefix-32768:64", wall_s=round(min(h[0] for h in hits), 5),
         runs_s=[round(h[0], 5) for h in hits], cached_tokens=[h[1] for h in hits])  # fmt: skip
    p = ids(32768)
    wall(p, 1)  # prefill into the cache
    w1 = min(wall(p, 33)[0] for _ in range(2))
    w2 = min(wall(p, 161)[0] for _ in range(2))
    emit(
        case="decode-b1-c32768", itl_ms=round((w2 - w1) / 128 * 1e3, 3), walls_s=[round(w1, 4), round(w2, 4)]
    )


MODEL = "qwen3-next"  # with the folder's layer count and MLPs (vllm_cases)


def emit(**kw: object) -> None:
    print(json.dumps({"engine": "vllm-0.24.0", "model": MODEL, **kw}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write-config"]:
        write_config(sys.argv[2], dense="--dense" in sys.argv[3:])
    else:
        vllm_cases(sys.argv[1])
