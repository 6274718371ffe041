"""The scheduler's settings (SchedulerConfig), derived from the engine's in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from longserve.config import EngineConfig

# "short-first": a short request has at most 1/SHORT_PREFILL_DIVISOR of the step budget left to compute
SHORT_PREFILL_DIVISOR = 8


@dataclass(frozen=True)
class SchedulerConfig:
    token_budget: int  # chunked_prefill_size / max_num_batched_tokens
    max_running_requests: int
    max_prefill_chunk: int | None = None
    # prompt tokens of a step while one request's prompt is all the work there is; None: token_budget
    lone_prefill_chunk_size: int | None = None
    chunk_granule: int = 1  # a prompt's chunks end on a multiple where they can (the attention backend's)
    short_prefill_tokens: int = 0  # waiting requests with this few tokens to compute go before a long prefill
    short_lookahead: int = 4  # waiting requests looked at for that (each: a read-only prefix-cache walk)
    # with decodes in the step and a short queue, waiting prompts are admitted until the step holds this many
    # prompt tokens (the first always); 0: up to the budget (fcfs, vLLM's)
    admit_tokens_beside_decodes: int = 0
    context_length: int | None = None  # a request ends when it has this many tokens (the runner's limit)

    @classmethod
    def from_engine_config(
        cls,
        config: EngineConfig,
        context_length: int | None = None,
        lone_prefill_chunk_size: int | None = None,
        chunk_granule: int = 1,
    ) -> SchedulerConfig:
        """The scheduler's settings, all derived here from the engine's (the one place that does);
        context_length and lone_prefill_chunk_size: the runner's, resolved against the KV pool and the model
        (runner/step_tokens.py); chunk_granule: its attention backend's chunk_granule."""
        short = config.schedule_policy == "short-first"
        share = max(1, config.chunked_prefill_size // SHORT_PREFILL_DIVISOR) if short else 0
        return cls(
            token_budget=config.chunked_prefill_size,
            max_running_requests=config.max_running_requests,
            max_prefill_chunk=config.max_prefill_chunk,
            lone_prefill_chunk_size=lone_prefill_chunk_size,
            chunk_granule=chunk_granule,
            short_prefill_tokens=share,
            admit_tokens_beside_decodes=share,
            context_length=context_length,
        )
