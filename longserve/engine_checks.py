"""What the engine checks and decides before anything runs: a request's token ids and limits (a ValueError,
an HTTP 400, before anything is queued), the launch-line settings that have no effect here (one start-up line
each), and whether steps overlap."""

from __future__ import annotations

import logging
import struct
from typing import TYPE_CHECKING, Any

import numpy as np

from longserve.config import EngineConfig
from longserve.config_hybrid import KERNEL_CHOICES
from longserve.models.moe_layout import moe_spec
from longserve.request import int64_array
from longserve.sampling_params import SamplingParams, check_logprobs_limit

if TYPE_CHECKING:
    from longserve.runner.model_runner import ModelRunner

logger = logging.getLogger("longserve.engine")


class PromptTooLongError(ValueError):
    pass


def check_token_ids(token_ids: list, vocab: int) -> np.ndarray:
    """The ids as a read-only int64 array (the request keeps it: Request.prompt_array, what the prefix cache
    compares; siblings share it); ValueError unless every id is an integer in [0, vocab). C-level passes: the
    packing (request.int64_array), then numpy's min/max: ~0.3 ms for 32K ids on the CI CPU, where array.array's
    packing had taken half of a 32K prefix hit's host time (scripts/dev/host_time.py: 1.03 -> 0.77 ms) and
    Python's type/min/max passes ~1.4. Bools are ints here, as in Python (and in the HTTP schema)."""
    try:
        ids = int64_array(token_ids)
    except struct.error:
        ids = None
    if ids is None or (len(ids) and (ids.min() < 0 or ids.max() >= vocab)):
        bad = [t for t in token_ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
    return ids


def log_ignored_settings(config: EngineConfig, hf_config: Any) -> None:
    """One start-up line for each setting accepted from a vLLM/SGLang launch line that has no effect here."""
    if config.trust_remote_code:
        logger.info(
            "trust_remote_code (--trust-remote-code) has no effect: longserve runs only its own model code, "
            "never a checkpoint's Python"
        )
    if config.swap_space is not None:
        logger.info(
            "swap_space=%s GiB (--swap-space) has no effect: longserve recomputes a preempted request's KV "
            "instead of swapping it to the CPU",
            config.swap_space,
        )
    if config.mamba_scheduler_strategy != "auto":
        logger.info(
            "mamba_scheduler_strategy=%s (--mamba-scheduler-strategy) has no effect: a hybrid model's prefix cache "
            "keeps its own state checkpoints on pages of its prompts (--mamba-cache-mode align), with "
            "pages of any size and the overlapped schedule",
            config.mamba_scheduler_strategy,
        )
    kernels = [
        f"{name}={getattr(config, name)}" for name in KERNEL_CHOICES if getattr(config, name) is not None
    ]
    if kernels:
        logger.info(
            "%s (SGLang's linear-attention kernel choices) %s no effect: longserve runs its own Triton kernels",
            ", ".join(kernels),
            "has" if len(kernels) == 1 else "have",
        )
    if (config.enable_expert_parallel or config.ep_size > 1) and moe_spec(hf_config) is None:
        logger.warning(
            "expert parallelism (--enable-expert-parallel / --ep-size %d) has no effect: %s is not a mixture "
            "of experts; its MLPs are split by tensor parallelism (--tp-size %d)",
            config.ep_size,
            ", ".join(getattr(hf_config, "architectures", None) or ["the model"]),
            config.tp_size,
        )


def check_limits(
    token_ids: list[int],
    params: SamplingParams,
    vocab: int,
    context_length: int,
    pooling: bool,
    max_logprobs: int,
) -> None:
    """A prompt that is empty or too long for the context, token ids in the sampling settings past the vocab (a
    ban or a bias on them would index past the logits), or more top logprobs than max_logprobs: ValueError."""
    if not token_ids:
        raise ValueError("the prompt is empty: give at least one character or token")
    check_logprobs_limit(params, max_logprobs)
    if any(t >= vocab for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids must be in [0, {vocab}); got {params.stop_token_ids[:5]}")
    if params.logit_bias and max(params.logit_bias) >= vocab:
        raise ValueError(
            f"logit_bias token ids must be in [0, {vocab}); got {sorted(params.logit_bias)[-5:]}"
        )
    if len(token_ids) >= context_length + pooling:  # pooling: nothing generated
        raise PromptTooLongError(
            f"prompt has {len(token_ids):,} tokens; the context length is {context_length:,} "
            "(the prompt plus at least one generated token must fit)"
        )


def resolve_overlap(setting: bool | None, runner: ModelRunner) -> bool:
    """The overlapped schedule (EngineConfig.overlap_schedule). None: on a GPU at one rank. Under tensor
    parallelism only when asked for (rank 0 sends its sampled ids to the other ranks on the device; tested
    on gloo, not yet measured on GPUs); never for pooling models (nothing to decode)."""
    if runner.pooler is not None:
        if setting:
            logger.info("overlap_schedule has no effect for pooling models: they decode nothing")
        return False
    if setting is not None:
        return setting
    return runner.workers is None and runner.device.type == "cuda"
