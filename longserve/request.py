"""Request: one sequence's state as it moves through the engine.

A request is `num_computed_tokens` chasing `num_tokens` (prompt + generated so far): each step the
scheduler grants it `num_new_tokens`; when the computed count reaches `num_tokens` the step samples one
more token. There is no prefill or decode phase, only how many tokens are left to compute.

Under the overlapped schedule (Engine.step) the token a launched step samples is *pending* until that
step's ids reach the host: it counts in `num_tokens` (the scheduler plans the next step with it), it is not
in `output_token_ids` yet (what callers read), and the next step reads it on the device.
"""

from __future__ import annotations

import enum
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from longserve.sampling_params import SamplingParams


def int64_array(ids: list[int]) -> np.ndarray:
    """A read-only int64 array of the ids; struct.error unless each is an integer that fits (floats, strings and
    None refuse to pack, bools and numpy integers pack). For 32K ids on the CI CPU 0.22 ms, against 0.42 for
    np.fromiter and 0.52 for array.array (np.fromiter and np.array also truncate floats)."""
    return np.frombuffer(struct.pack(f"{len(ids)}q", *ids), dtype=np.int64)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # eos, stop token id or stop string
    LENGTH = "length"  # max_new_tokens or context length
    ABORT = "abort"  # aborted by the caller (client gone, timeout)
    ERROR = "error"  # could not be served (e.g. a prompt larger than the KV pool)


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.perf_counter)
    # group of n > 1 siblings sharing one prompt: siblings wait for the first one's prompt pages
    group_id: str | None = None

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first admission; -1: not yet
    page_ids: list[int] = field(default_factory=list)  # pages holding positions [0, num_computed_tokens)
    cache_node: Any = None  # prefix-cache node this request holds locked (None: none)
    num_tree_pages: int = 0  # leading pages of page_ids already offered to the prefix cache
    state_slot: int | None = (
        None  # a hybrid model's recurrent-state slot while running (cache/state_slots.py)
    )
    # a hybrid model's prefix hit: the state checkpoint its first step copies into state_slot; and the positions
    # where its prompt's chunks end and its state is checkpointed (cache/state_radix_tree.py)
    state_restore: int | None = None
    state_marks: tuple[int, ...] = ()
    # a checkpoint a decode step saved (checkpoint, tokens it covers), attached when the request's generated pages
    # are cached, as it ends (KVCacheManager.track_target)
    state_tracked: tuple[int, int] | None = None
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    error: str | None = None
    error_internal: bool = False  # the error is ours (a failure in the engine), not the request's input

    # timings (time.perf_counter seconds)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    text: Any = None  # detokenizer.TextAssembler when the engine detokenizes (None: token ids only)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    generator: Any = None  # torch.Generator for seeded sampling
    # prompt logprobs (sampling_params.prompt_logprobs), filled chunk by chunk: entry j is prompt position
    # prompt_logprob_start + j (the first is None); see runner/prompt_logprobs.py
    prompt_logprob_start: int = 0
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    prompt_logprob_ranks: list[int | None] = field(default_factory=list)
    # a pooling request (pooling_params.PoolingParams): its prompt's last position yields `pooled` (an
    # embedding or a score) instead of a sampled token
    pooling_params: Any = None
    pooled: Any = None
    # structured.grammar.GrammarMatcher of a constrained output (its own per request, n > 1 siblings too):
    # it has taken every output token (the last one perhaps deferred: applied at its next use, see
    # GrammarMatcher.defer_accept), so a request recomputed after preemption re-feeds nothing
    grammar: Any = None
    # overlapped schedule: 1 while the token a launched step sampled for this request is on its way to the
    # host (it sits at position num_computed_tokens); pending_row: its row among that step's sampled ids;
    # pending_final: that token ends the request whatever it is (max_new_tokens, context length), so no
    # step is planned past it
    num_pending: int = 0
    pending_row: int = 0
    pending_final: bool = False
    # runner.inputs.PageRow: page_ids as an int64 array, kept in step with them by the runner
    page_row: Any = field(default=None, compare=False, repr=False)
    # prompt_token_ids as an int64 array, what the prefix cache compares and keeps (token_array): the one
    # add_request's check builds (engine_checks.check_token_ids), or built on first use
    prompt_array: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens, a pending one included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def next_prompt_logprob_row(self) -> int:
        """The position whose logits give the next missing prompt logprob (token p's come from row p - 1);
        num_prompt_tokens - 1 once all are in (that row samples the first output token)."""
        return self.prompt_logprob_start + max(len(self.prompt_logprobs) - 1, 0)

    @property
    def max_prefix_len(self) -> int:
        """Leading tokens the prefix cache may supply: all but the last (its logits sample), and, while prompt
        logprobs are missing, none of the positions whose logits still have to be computed."""
        limit = self.num_tokens - 1
        if self.sampling_params.prompt_logprobs is not None:
            limit = min(limit, self.next_prompt_logprob_row)
        return limit

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens whose K/V still have to be computed before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids()[start:end] without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_array(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """all_token_ids()[start:end] as int64: a view of the prompt's array while it lies in the prompt."""
        prompt = self.prompt_array
        if prompt is None:
            ids = self.prompt_token_ids
            prompt = self.prompt_array = int64_array(ids)
        n = len(prompt)
        end = n + len(self.output_token_ids) if end is None else end
        if end <= n:
            return prompt[start:end]
        outputs = np.asarray(self.output_token_ids[max(start - n, 0) : end - n], dtype=np.int64)
        return outputs if start >= n else np.concatenate((prompt[start:], outputs))
