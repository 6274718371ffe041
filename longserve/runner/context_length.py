"""The longest prompt + output the engine serves (ModelRunner, once the KV pool is sized): the configured
context_length or the model's max_position_embeddings, bounded by what the pool holds."""

from __future__ import annotations

import logging

from longserve.config import EngineConfig

logger = logging.getLogger("longserve.runner")  # the runner's logger: its start-up lines stay under one name


def resolve_context_length(config: EngineConfig, hf_config, pool_tokens: int) -> int:
    """The longest prompt + output served: config.context_length, else the model's maximum, never more
    than the KV pool holds. An explicit context_length the pool cannot hold is an error."""
    model_max = getattr(hf_config, "max_position_embeddings", None) or 2048
    if config.context_length is not None:
        if config.context_length > pool_tokens:
            raise ValueError(
                f"context_length={config.context_length:,} cannot fit: the KV pool holds only {pool_tokens:,} "
                "tokens; lower context_length, or raise max_total_tokens / mem_fraction_static"
            )
        if config.context_length > model_max:
            logger.warning(
                "context_length=%s exceeds the model's max_position_embeddings=%s; quality may suffer",
                f"{config.context_length:,}",
                f"{model_max:,}",
            )
        return config.context_length
    if model_max > pool_tokens:
        logger.warning(
            "the model allows %s tokens but the KV pool holds %s: the context length is capped at %s",
            f"{model_max:,}",
            f"{pool_tokens:,}",
            f"{pool_tokens:,}",
        )
        return pool_tokens
    return model_max
