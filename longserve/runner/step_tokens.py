"""How many prompt tokens a lone prompt's step takes (ModelRunner, once the model is built): the configured
lone_prefill_chunk_size, else the model's own choice, which shrinks at warm-up to what the device holds beside the
KV pool; and the largest step, which warm-up plans for."""

from __future__ import annotations

import logging

from torch import nn

from longserve.config import EngineConfig
from longserve.models.quantization import dequantizes_each_step

logger = logging.getLogger("longserve.runner")  # the runner's logger: its start-up lines stay under one name

# A lone prompt's step, when not configured, for a model whose prefill dequantizes its weights once a step.
# Measured on an H100 in one call (RESULTS.md, thirty-eighth session, 3352078), cold 32K in steps of 8K / 16K /
# 32K: the Qwen3-30B-A3B shape in int4 (GPTQ g128) 1.240 / 1.160 / 1.111 s, in bf16 1.121 / 1.101 / 1.088 s; the
# Llama-3.1-8B shape in bf16 1.213 -> 1.199 s (32K) and 10.28 -> 10.23 s (128K) in steps of 32K. Only the
# dequantizing model gains more than an arrival loses by waiting behind a 32K step, so only it takes one. (The
# bf16 8B again, forty-first session: 32K 1.2050 -> 1.1887 s; 128K 10.21 -> 16.05 s, its chunks past 32K, bounded
# since, at shapes no plan was built for, in Triton. Forty-second, in cuDNN pieces: 32K 1.1955 -> 1.1860 s, 128K
# 10.17 -> 10.36 s, int4 9.53 -> 9.66 s, the chunks ending off the prefix granule; on it since: not yet measured.)
DEQUANT_LONE_PREFILL_CHUNK = 32768
# The devices where a model takes that step by itself: a GPU's, where it was measured and where warm-up runs the
# step first (shrinking it to what fits). On a CPU nothing checks it before a prompt comes, and a 32K step of an 8B
# holds ~4x the activations of an 8K one (GiBs of host memory) for no measured gain.
DEQUANT_LONE_DEVICES = ("cuda",)


def resolve_lone_prefill_chunk(config: EngineConfig, model: nn.Module, device_type: str) -> int | None:
    """config.lone_prefill_chunk_size when set, else DEQUANT_LONE_PREFILL_CHUNK for a model whose weights are
    dequantized each step (models/quantization.py) on a device of DEQUANT_LONE_DEVICES, else None (the usual
    budget)."""
    if config.lone_prefill_chunk_size is not None:
        return config.lone_prefill_chunk_size
    chosen = device_type in DEQUANT_LONE_DEVICES and dequantizes_each_step(model)
    if chosen and config.chunked_prefill_size < DEQUANT_LONE_PREFILL_CHUNK:
        logger.info(
            "a lone prompt takes steps of %s tokens: this model's weights are dequantized once a step "
            "(--lone-prefill-chunk-size %s keeps the usual budget)",
            f"{DEQUANT_LONE_PREFILL_CHUNK:,}",
            config.chunked_prefill_size,
        )
        return DEQUANT_LONE_PREFILL_CHUNK
    return None


def max_step_prompt_tokens(config: EngineConfig, lone_prefill_chunk_size: int | None) -> int:
    """The most prompt tokens one step holds (a lone prompt's, else a usual step's)."""
    return max(config.chunked_prefill_size, lone_prefill_chunk_size or 0)


def optional_past(config: EngineConfig, lone: int | None, tensor_parallel: bool) -> int | None:
    """Warm-up's passes past this many tokens may run out of device memory (runner/warm_up.py): those of the
    model's own lone step, not of a configured one (refused at start-up, named), and in one process only (the
    ranks of a tp run must all run the same passes)."""
    chosen = config.lone_prefill_chunk_size is None and lone is not None
    return config.chunked_prefill_size if chosen and not tensor_parallel else None


def lone_step_that_fits(config: EngineConfig, lone: int, fits: int) -> int | None:
    """The model's lone step shrunk to the `fits` tokens warm-up ran (None: the usual steps), said in the log."""
    usual = config.chunked_prefill_size
    logger.warning(
        "a lone prompt's step of %s tokens does not fit beside the KV pool (out of device memory at warm-up): "
        "%s; lower --mem-fraction-static to leave it room",
        f"{lone:,}",
        f"steps of {fits:,} tokens instead" if fits > usual else f"the usual steps of {usual:,} tokens",
    )
    return fits if fits > usual else None
