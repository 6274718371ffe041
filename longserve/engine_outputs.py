"""The RequestOutputs the engine returns each step, the n siblings they report on, and its stats snapshot.

Every step the engine reports on every request that progressed, but callers read little of each report:
LLM.generate reads only the last; a stream reads the new tokens and the new text; a benchmark reads
nothing. So a report copies nothing: its completions' token ids, logprobs and text are read on demand
from a CompletionSource, as of the step that made them (the request's lists only grow: a count taken at
the step still names the same entries later). On the CI CPU (scripts/dev/host_time.py, batch 64 x 4K
contexts, cProfile) building the reports took 1.2 ms of a 2.8 ms decode step, copying each request's whole
output every step; 0.5 ms now.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from longserve.outputs import LAZY, CompletionOutput, EngineStats, RequestOutput
from longserve.request import Request
from longserve.runner import prompt_logprobs
from longserve.sampling_params import SamplingParams
from longserve.siblings import chosen_members
from longserve.tokenization.detokenizer import DeferredText

if TYPE_CHECKING:
    from longserve.cache.manager import KVCacheManager
    from longserve.sched.scheduler import Scheduler


class Group:
    """The n siblings of one user request (n == 1: a group of one)."""

    __slots__ = ("request_id", "prompt", "members", "last_emitted", "n", "show_logprobs", "ranked")

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        members: list[Request],
        params: SamplingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.members = members  # best_of > n: best_of candidates (siblings.py)
        self.last_emitted: list[int] = [0] * len(members)  # tokens already reported per member
        params = params or members[0].sampling_params  # the caller's (a candidate's may differ)
        self.n = params.n  # completions returned
        self.show_logprobs = params.logprobs is not None  # best_of turns them on for ranking only
        # best_of > n: the completions are chosen when every candidate has finished
        self.ranked = len(members) > self.n

    @property
    def done(self) -> bool:
        members = self.members
        if len(members) == 1:
            return members[0].is_finished
        return all(r.is_finished for r in members)


class CompletionSource:
    """A completion's lists and text as of one step, made when first read: the request's token ids,
    logprobs and top logprobs up to their lengths at that step, and the text of its DeferredText up to the
    adds recorded by then."""

    __slots__ = ("req", "num_tokens", "first_new", "num_logprobs", "num_top", "text_span")

    def __init__(self, req: Request, first_new: int) -> None:
        self.req = req
        self.num_tokens = len(req.output_token_ids)
        self.first_new = first_new
        # counted apart: a token that failed after its logprob was taken leaves one more logprob
        self.num_logprobs = len(req.logprobs)
        self.num_top = len(req.top_logprobs)
        self.text_span: tuple[int, int] = (0, 0)

    def token_ids(self) -> list[int]:
        return self.req.output_token_ids[: self.num_tokens]

    def new_token_ids(self) -> list[int]:
        return self.req.output_token_ids[self.first_new : self.num_tokens]

    def logprobs(self) -> list[float]:
        return self.req.logprobs[: self.num_logprobs]

    def top_logprobs(self) -> list[list[tuple[int, float]]]:
        return self.req.top_logprobs[: self.num_top]

    def cumulative_logprob(self) -> float:
        return float(sum(self.req.logprobs[: self.num_logprobs]))

    def text(self) -> str:
        return self.req.text.text_at(self.text_span[1])

    def new_text(self) -> str:
        return self.req.text.delta_of(self.text_span)


def completion_output(req: Request, index: int, first_new: int, show_logprobs: bool) -> CompletionOutput:
    """Completion `index` of a report: member `req`, whose tokens from `first_new` on are new."""
    source = CompletionSource(req, first_new)
    text = req.text
    if text is None:  # the caller assembles the text
        full = new = ""
    elif type(text) is DeferredText:
        source.text_span = text.mark()
        full = new = LAZY
    else:  # a TextAssembler, fed as the request ran (stop strings)
        full, new = text.text, text.delta(req.is_finished)
    wanted = req.sampling_params.logprobs
    shown = wanted if show_logprobs else None
    return CompletionOutput(
        index,
        full,
        LAZY,
        req.finish_reason.value if req.finish_reason else None,
        req.stop_reason,
        logprobs=LAZY if shown is not None else None,
        top_logprobs=LAZY if shown else None,
        cumulative_logprob=LAZY if wanted is not None else None,
        new_text=new,
        new_token_ids=LAZY,
        source=source,
    )


def request_output(group: Group) -> RequestOutput:
    """This step's report on `group`: each shown member's completion (best_of: the n best, once all have
    ended), errors, prompt logprobs once complete, and the timings; records what each member has reported."""
    finished = group.done
    members = group.members
    # best_of: the n best candidates, once all have ended (before that, none)
    if not group.ranked:
        shown: Sequence[int] = range(len(members))
    else:
        shown = chosen_members(members, group.n) if finished else []
    completions = []
    for index, i in enumerate(shown):
        req = members[i]
        completions.append(completion_output(req, index, group.last_emitted[i], group.show_logprobs))
        group.last_emitted[i] = len(req.output_token_ids)
    first = members[0]
    if len(members) == 1:
        error, error_internal = first.error or None, bool(first.error_internal)
    else:
        error = "; ".join(r.error for r in members if r.error) or None
        error_internal = any(r.error_internal for r in members)
    out = RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=completions,
        finished=finished,
        cached_tokens=max(first.num_cached_tokens, 0),
        error=error,
        error_internal=error_internal,
        pooled=first.pooled,
    )
    if first.sampling_params.prompt_logprobs is not None and prompt_logprobs.is_complete(first):
        # the request's own lists: complete, so no later step appends to them
        out.prompt_logprobs = first.prompt_logprobs
        out.prompt_top_logprobs = first.prompt_top_logprobs
        out.prompt_logprob_ranks = first.prompt_logprob_ranks
        out.prompt_logprob_start = first.prompt_logprob_start
    if first.first_token_time is not None:
        out.ttft = first.first_token_time - first.arrival_time
    if first.first_scheduled_time is not None:
        out.queue_time = first.first_scheduled_time - first.arrival_time
        if first.first_token_time is not None:
            out.prefill_time = first.first_token_time - first.first_scheduled_time
    if finished:
        end = max(r.finished_time or 0.0 for r in members)
        out.e2e_latency = end - first.arrival_time
    return out


def engine_stats(sched: Scheduler, kv: KVCacheManager, num_unfinished: int) -> EngineStats:
    """Engine.stats: the scheduler's queues and counters and the KV pool's pages, in O(1)."""
    total, reclaimable = kv.num_total_pages, kv.num_reclaimable_pages
    return EngineStats(
        num_running=sched.num_running,
        num_waiting=sched.num_waiting,
        num_unfinished_requests=num_unfinished,
        page_size=kv.page_size,
        num_total_pages=total,
        num_free_pages=kv.num_free_pages,
        num_cached_pages=kv.num_cached_pages,
        num_used_pages=total - reclaimable,
        kv_usage=kv.usage(),
        num_prefix_query_tokens=sched.num_prefix_query_tokens,
        num_prefix_hit_tokens=sched.num_prefix_hit_tokens,
        num_preemptions=sched.num_preemptions,
        num_short_first_steps=sched.num_deferred_prefill_steps,
    )
