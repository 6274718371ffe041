"""EngineConfig's hybrid-model (Qwen3.5, Qwen3-Next) state settings, checked as one: mamba_ssm_cache_dtype,
mamba_cache_dtype, mamba_cache_mode, max_mamba_cache_size, mamba_full_memory_ratio, mamba_track_interval, and
SGLang's mamba_scheduler_strategy / kernel choices, accepted with no effect (vLLM's and SGLang's names). Called from
EngineConfig.__post_init__ (longserve/config.py) with its `need`, so a refusal is the same ConfigError naming the
same settings; it imports nothing of config.py, which imports it. runner/state_plan.py acts on them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# a hybrid model's linear-attention state (attention/recurrent_state.py): auto is the model's dtype (vLLM's)
MAMBA_SSM_DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's --mamba-cache-mode: align, states saved where chunks end on the marks a hybrid model's prefix cache sets
# (cache/state_radix_tree.py); none, no states kept (a hybrid model shares no prefix). vLLM's "all" (a state at
# every block) is not offered: refused by name
MAMBA_CACHE_MODES = ("align", "none")
# SGLang's --mamba-scheduler-strategy values: accepted, no effect (longserve's hybrid prefix cache is its own)
MAMBA_SCHEDULER_STRATEGIES = ("auto", "no_buffer", "extra_buffer")
# SGLang's kernel choices for a hybrid model's linear attention (--mamba-backend; --linear-attn-backend and its
# decode / prefill overrides): accepted, no effect (longserve runs its own Triton kernels, kernels/gated_delta*.py)
KERNEL_CHOICES = {
    "mamba_backend": ("triton", "flashinfer"),
    "linear_attn_backend": ("triton", "cutedsl", "flashinfer"),
    "linear_attn_decode_backend": ("triton", "cutedsl", "flashinfer"),
    "linear_attn_prefill_backend": ("triton", "cutedsl", "flashinfer"),
}


def check_hybrid_settings(config: Any, need: Callable[..., None]) -> None:
    for name in ("mamba_ssm_cache_dtype", "mamba_cache_dtype"):
        value = getattr(config, name)
        need(
            value in MAMBA_SSM_DTYPES,
            f"{name} must be one of {', '.join(MAMBA_SSM_DTYPES)}; got {value!r}",
            name,
        )
    need(
        config.max_mamba_cache_size is None
        or (isinstance(config.max_mamba_cache_size, int) and config.max_mamba_cache_size >= 1),
        f"max_mamba_cache_size must be an integer >= 1; got {config.max_mamba_cache_size!r}",
        "max_mamba_cache_size",
    )
    need(
        config.mamba_cache_mode in MAMBA_CACHE_MODES,
        f"mamba_cache_mode must be align or none (states saved on pages of the prompts, or none "
        f"kept); got {config.mamba_cache_mode!r}",
        "mamba_cache_mode",
    )
    need(
        config.mamba_scheduler_strategy in MAMBA_SCHEDULER_STRATEGIES,
        f"mamba_scheduler_strategy must be one of {', '.join(MAMBA_SCHEDULER_STRATEGIES)} (SGLang's; no effect "
        f"here); got {config.mamba_scheduler_strategy!r}",
        "mamba_scheduler_strategy",
    )
    for name, choices in KERNEL_CHOICES.items():
        value = getattr(config, name)
        need(
            value is None or value in choices,
            f"{name} must be one of {', '.join(choices)} (SGLang's; no effect here); got {value!r}",
            name,
        )
    interval = config.mamba_track_interval
    need(
        isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1,
        f"mamba_track_interval must be an integer >= 1 (decode tokens between a hybrid model's state "
        f"checkpoints); got {interval!r}",
        "mamba_track_interval",
    )
    ratio = config.mamba_full_memory_ratio
    need(
        ratio is None
        or (isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0 < ratio < float("inf")),
        f"mamba_full_memory_ratio must be a number > 0 (the states' memory to the KV pool's); got {ratio!r}",
        "mamba_full_memory_ratio",
    )
