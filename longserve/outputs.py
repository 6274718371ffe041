"""Plain data passed between layers: scheduler -> runner -> engine -> caller, and the engine's snapshot
(EngineStats) that the server and its metrics read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from longserve.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens whose K/V this step computes, starting at request.num_computed_tokens
    samples: bool  # this chunk reaches the request's last token: the step samples its next token
    # a hybrid model's state checkpoint this step saves into (KVCacheManager.checkpoint_target): the state after
    # the chunk's first `state_save_at` tokens (inside the step), or None: after the whole chunk
    state_save: int | None = None
    state_save_at: int | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decodes first, then prefill chunks
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def samples(self) -> bool:
        """Whether the step samples a token (a mid-prompt chunk does not)."""
        return any(s.samples for s in self.scheduled)


@dataclass
class RunnerOutput:
    """One sampled token per scheduled request with `samples=True`, in scheduling order."""

    sampled_token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # request id -> error message: requests whose own sampling failed (their token is a placeholder)
    failed: dict[str, str] = field(default_factory=dict)
    # a pooling model's step: each request's embedding (floats) or score (one float), in the same order
    pooled: list[list[float] | float | None] | None = None
    # request id -> runner.prompt_logprobs.PromptLogprobs: this step's rows of the prompt logprobs it asked for
    prompt_logprobs: dict[str, Any] | None = None


LAZY: Any = object()  # a CompletionOutput field made by its source on first read


class _Lazy:
    """A CompletionOutput field whose value may be LAZY: then `source.<name>()` makes it on first read."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = getattr(obj, self.slot)
        if value is LAZY:
            value = getattr(obj._source, self.name)()
            setattr(obj, self.slot, value)
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj, self.slot, value)


class CompletionOutput:
    """One completion of a RequestOutput: fields as a dataclass's, read and written alike. The engine makes
    one per completion per step, and most are never read whole (LLM.generate reads only the last; a stream
    reads the new tokens and text), so the lists and texts may be LAZY: made on first read by `source`
    (engine_outputs.CompletionSource) as of the step that made the output. Building them eagerly (copies of
    every request's whole output each step) was 1.2 ms cumulative under cProfile of a 2.8 ms decode step at
    batch 64, 0.5 ms lazily (scripts/dev/host_time.py, CI CPU)."""

    __slots__ = (
        "index", "finish_reason", "stop_reason", "_text", "_token_ids", "_logprobs", "_top_logprobs",
        "_cumulative_logprob", "_new_text", "_new_token_ids", "_source",
    )  # fmt: skip
    _FIELDS = (
        "index", "text", "token_ids", "finish_reason", "stop_reason", "logprobs", "top_logprobs",
        "cumulative_logprob", "new_text", "new_token_ids",
    )  # fmt: skip
    text = _Lazy()
    token_ids = _Lazy()
    logprobs = _Lazy()
    top_logprobs = _Lazy()
    cumulative_logprob = _Lazy()  # sum of `logprobs` (known when logprobs or best_of were asked)
    new_text = _Lazy()  # streaming deltas since the previous RequestOutput for this request
    new_token_ids = _Lazy()

    def __init__(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        finish_reason: str | None,  # "stop" | "length" | "abort" | "error" | None while running
        stop_reason: int | str | None = None,
        logprobs: list[float] | None = None,
        top_logprobs: list[list[tuple[int, float]]] | None = None,
        cumulative_logprob: float | None = None,
        new_text: str = "",
        new_token_ids: list[int] | None = None,
        source: Any = None,
    ) -> None:
        self.index = index
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self._text = text
        self._token_ids = token_ids
        self._logprobs = logprobs
        self._top_logprobs = top_logprobs
        self._cumulative_logprob = cumulative_logprob
        self._new_text = new_text
        self._new_token_ids = [] if new_token_ids is None else new_token_ids
        self._source = source

    def __eq__(self, other: object) -> bool:
        if type(other) is not CompletionOutput:
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in self._FIELDS)

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass it replaces

    def __repr__(self) -> str:
        return f"CompletionOutput({', '.join(f'{f}={getattr(self, f)!r}' for f in self._FIELDS)})"


@dataclass
class RequestOutput:
    """What the caller sees of one prompt. `outputs` has n entries; `.text` etc. read the first."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    cached_tokens: int = 0
    # seconds; None until known
    ttft: float | None = None
    e2e_latency: float | None = None
    queue_time: float | None = None
    prefill_time: float | None = None
    error: str | None = None
    error_internal: bool = False  # the error is ours (HTTP 500), not the request's input (400)
    pooled: list[float] | float | None = None  # a pooling request's embedding or score, once finished
    # prompt logprobs (SamplingParams.prompt_logprobs), once the whole prompt is computed: entry j is prompt
    # position prompt_logprob_start + j; the first entry (and its top and rank) is None, as in vLLM
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None  # the top prompt_logprobs
    prompt_logprob_ranks: list[int | None] | None = None  # 1 + tokens more likely than the prompt's own
    prompt_logprob_start: int = 0

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


@dataclass
class StepStats:
    """Counters of one engine step, for logs and metrics."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_preempted: int = 0
    kv_usage: float = 0.0
    step_time: float = 0.0  # the step() call's wall time, s
    wait_time: float = 0.0  # of which waiting for the device (reading a launched step's tokens), s
    # when the step's first read of a launched step's tokens ended (the step in flight when overlapped, its own
    # otherwise), s after the call's start; -1: none read. What a read-to-read device time needs
    # (scripts/probes/prompt_step_fit.py): with the early read it falls inside the launch
    read_time: float = -1.0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's state at one moment, read on the thread that drives it (Engine.stats()); the server's
    /server_info, /metrics and stats log read this rather than the scheduler or the KV cache."""

    num_running: int  # requests (n > 1: each completion) scheduled for steps
    num_waiting: int  # requests queued for admission, preempted ones included
    num_unfinished_requests: int  # user requests not yet finished (n > 1 counts once)
    page_size: int  # tokens per KV page
    num_total_pages: int
    num_free_pages: int  # on the free list now
    num_cached_pages: int  # held by the prefix cache (some may be in use by requests too)
    num_used_pages: int  # held by requests in flight; pages only the prefix cache holds count as reclaimable
    kv_usage: float  # num_used_pages / num_total_pages
    # since the engine started
    num_prefix_query_tokens: int  # prompt tokens of admitted requests, looked up in the prefix cache
    num_prefix_hit_tokens: int  # of those, tokens found there
    num_preemptions: int
    num_short_first_steps: int  # steps that served short requests before a long prefill (short-first)

    @property
    def max_total_num_tokens(self) -> int:
        return self.num_total_pages * self.page_size

    @property
    def num_reclaimable_cached_pages(self) -> int:
        """Cached pages no request holds: eviction would free them."""
        return self.num_total_pages - self.num_used_pages - self.num_free_pages
