"""Scheduler: continuous batching under a per-step budget of prompt tokens (pure Python, no torch).

Each step: running requests that decode (one token left) go first, then running prefill chunks, then
waiting requests are admitted FCFS while budget, `max_running_requests` and pages allow. The budget counts
prompt tokens; decodes ride on top of it, at most as many again (SGLang's mixed chunks; vLLM counts them in):
cut by the decodes beside it, a 16K prompt in chunks of 8K took a third step for its last few tokens, so
every conversation opening behind another waited one more 8K step for its first token (the seventeenth
session's HTTP call, RESULTS.md), and its second chunk's prefix was not a multiple of the chunk. A long prompt
spreads over several steps (`max_prefill_chunk` caps one request's share of a step). When pages run
out, the most recently admitted request not yet scheduled this step is preempted by recompute: its
pages are released (its computed full pages stay in the prefix cache) and it goes back to the front
of the queue. A prompt that is all the work there is (no decodes, nothing waiting) may take
`lone_prefill_chunk_size` tokens a step instead (fewer steps, each paying its fixed costs once: a quantized
MoE dequantizes every expert a step), fewer past that many computed tokens (sched/chunk_size.py: no more attention
work a step than the first lone chunk's); the pool short of pages for that, a usual chunk.

Short prefills first (`short_prefill_tokens` > 0, the engine's "short-first" policy): while a long prompt
is being prefilled chunk by chunk, a waiting request with at most that many tokens left to compute once its
cached prefix is attached (a conversation's next turn, a short question) would wait for every remaining
chunk (a 128K prompt: seconds); arriving just after a long one, it would share that one's first, full step.
Such requests are admitted in a step of their own, with the decodes, and the long prefill (running, or
waiting ahead of them) goes on the next step; it is never put off two steps in a row, so under a stream of
short requests it still gets every other step.

Arrivals beside decodes a share at a time (short-first too, `admit_tokens_beside_decodes`): when prompts arrive
close together while others decode, a step admits the first of them, then more only until it holds 1/8 of the
budget in prompt tokens; the next step takes the next (a step that serves short requests before a long prefill
takes all of them). Taken all at once, each of them waits for all of their prefill (and a decoding request's gap
is the whole step); one after another, the first answers after its own and the last after about as long as
before. Not when the queue is long (more than LIGHT_QUEUE_BUDGETS steps' budgets of prompt tokens) or many
requests decode (more than LIGHT_QUEUE_MAX_DECODES, whose rows each share-sized step pays): then full steps keep
the throughput.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque

from longserve.cache.manager import KVCacheManager
from longserve.outputs import ScheduledRequest, SchedulerOutput
from longserve.request import FinishReason, Request, RequestStatus
from longserve.sched.chunk_size import aligned_chunk, bounded_lone_chunk
from longserve.sched.config import SchedulerConfig

# Beside decodes, waiting prompts are admitted one budget share at a time (the module's docstring) only while they
# hold at most this many steps' budgets of tokens. The random HTTP workload's arrivals (RESULTS.md seventeenth
# session) replayed through a model of the overlapped loop with the 8B's step times (scripts/probes/
# sim_admission.py --synthetic): TTFT P95 123 -> 107 ms, mean 60 -> 57, P50 and the time to finish unchanged;
# Poisson arrivals at 12-20 requests/s alike (P95 -9 to -11%, mean -6 to -12%); 400 prompts at once: full steps
# 8.6 s mean TTFT, one share a step 9.9 s, so a long queue fills the steps (with 1 budget here instead of 2, P95
# at 20/s 299 ms against 265). Not yet measured on the GPU.
LIGHT_QUEUE_BUDGETS = 2
# ... and while at most this many requests decode: each share-sized step pays its decode rows and a prompt step's
# fixed cost, once per prompt. The random HTTP workload (8/s) never had more than 15 decodes beside a prompt
# (median 5); the same model recalibrated on that call's step log (RESULTS.md nineteenth session) put Poisson
# 16/s at a mean TTFT of 171 ms one prompt a step against 139 with full steps, and this bound changes nothing at
# 8/s. Not measured on the GPU.
LIGHT_QUEUE_MAX_DECODES = 16


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        # a hybrid model's prefix cache checkpoints decoding requests' states (KVCacheManager.track_target)
        self._tracks = kv.prefix_cache.keeps_states
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # the first member of each n > 1 group: its siblings wait until its prompt is computed
        self.group_leaders: dict[str, Request] = {}
        # counters (for stats and metrics)
        self.num_preemptions = 0
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_deferred_prefill_steps = 0  # steps that served short requests before a long prefill
        self._deferred = False  # the last step put the long prefills off

    # ---- queue management -----------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id!r}"
        self.requests[req.request_id] = req
        if req.group_id is not None:
            self.group_leaders.setdefault(req.group_id, req)
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish_request(self, req: Request, reason: FinishReason) -> None:
        """Remove a request (finished, aborted or failed) and release its pages."""
        if req.status == RequestStatus.FINISHED:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        # an aborted or failed request may have uncomputed tail pages; cache only what was computed
        self.kv.release(req, cache=True)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finished_time = time.perf_counter()
        del self.requests[req.request_id]
        if req.group_id is not None and self.group_leaders.get(req.group_id) is req:
            del self.group_leaders[req.group_id]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.release(req, cache=True)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- one step -------------------------------------------------------------------------------
    def _chunk(self, req: Request, budget: int) -> int:
        """A usual chunk of the budget, ending on the chunk granule where it can (sched/chunk_size.py)."""
        cfg, left = self.config, req.num_remaining_tokens
        n = min(left, budget)
        if cfg.max_prefill_chunk is not None:
            n = min(n, max(1, cfg.max_prefill_chunk))
        n = aligned_chunk(n, req.num_computed_tokens, left, cfg.token_budget, cfg.chunk_granule)
        return self.kv.chunk_end(req, n)  # a hybrid model's state checkpoints: on the marks

    def _fit(self, req: Request, n: int) -> int:
        """A lone prompt's chunk (past token_budget), bounded by its computed tokens (sched/chunk_size.py),
        allocated now if the pool has room, else a usual step's chunk, which the caller allocates as any other."""
        cfg = self.config
        budget = cfg.token_budget
        if n > budget:
            n = bounded_lone_chunk(
                n, req.num_computed_tokens, cfg.lone_prefill_chunk_size, budget, cfg.chunk_granule
            )
            n = self.kv.chunk_end(req, n)
            if n > budget and not self.kv.allocate(req, n):
                return self._chunk(req, budget)
        return n

    def _prompt_budget(self) -> int:
        """The step's prompt tokens: lone_prefill_chunk_size while one request is all there is (a prompt being
        prefilled or waiting, no decodes beside it, no other waiting), else token_budget."""
        lone = self.config.lone_prefill_chunk_size
        if lone is not None and len(self.running) + len(self.waiting) == 1:
            return max(lone, self.config.token_budget)
        return self.config.token_budget

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # the step's prompt tokens; its decodes ride on top, at most token_budget (the module's docstring)
        budget = step_budget = self._prompt_budget()
        decode_room = self.config.token_budget
        scheduled_ids: set[str] = set()
        shorts = self._shorts_first()  # non-empty: this step serves them and puts the long prefills off
        self._deferred = bool(shorts)
        self.num_deferred_prefill_steps += self._deferred

        # 1. running requests: decodes first, each class in admission order. A decode whose last page has
        # room needs no allocation: that test inline, rather than a sort and the general path's calls, took
        # schedule() from 1.0 to 0.4 ms cumulative under cProfile at batch 64 (scripts/dev/host_time.py)
        page_size = self.kv.page_size
        num_decodes = 0
        decodes, prefills = [], []
        for req in self.running:
            if req.pending_final:  # the token in flight ends it: nothing to plan past it
                continue
            left = (
                len(req.prompt_token_ids)
                + len(req.output_token_ids)
                + req.num_pending
                - req.num_computed_tokens
            )
            (decodes if left <= 1 else prefills).append(req)
        for req in itertools.chain(decodes, prefills):
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            computed = req.num_computed_tokens
            decode = computed + 1 == len(req.prompt_token_ids) + len(req.output_token_ids) + req.num_pending
            if decode:
                if decode_room <= 0:
                    continue
                if computed < len(req.page_ids) * page_size:  # its last page has room
                    track = self.kv.track_target(req) if self._tracks else None
                    out.scheduled.append(ScheduledRequest(req, 1, True, track))
                    scheduled_ids.add(req.request_id)
                    decode_room -= 1
                    num_decodes += 1
                    continue
                n = 1
            elif shorts or budget <= 0:
                continue  # a prefill chunk: next step
            else:
                n = self._fit(req, self._chunk(req, budget))
            while not self.kv.allocate(req, n):
                victim = self._pick_victim(exclude=scheduled_ids)
                if victim is None:
                    n = 0
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    n = 0
                    break
            if n == 0:
                continue
            out.scheduled.append(self._scheduled(req, n))
            scheduled_ids.add(req.request_id)
            if decode:  # one whose last page was full
                decode_room -= 1
                num_decodes += 1
            else:
                budget -= n

        # 2. admit waiting requests (not in a step that had to preempt: memory is short); beside decodes, one
        # share of the budget at a time while the queue is short (the module's docstring), except in a step
        # that serves short ones before a long prefill: it is theirs, all of them go
        if not out.preempted:
            cap = math.inf if shorts else self._admission_cap(num_decodes)
            prompt_tokens = step_budget - budget  # running chunks'
            admitted = 0
            for req in shorts or list(self.waiting):
                if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                    break
                if admitted and prompt_tokens >= cap:
                    break
                if self._blocked_by_sibling(req):
                    continue
                # a short one's chunk stays short even if eviction took part of its prefix since the peek
                n = self._admit(req, min(budget, self.config.short_prefill_tokens) if shorts else budget)
                if n == 0:
                    break  # no pages even for this one: keep FCFS order, retry next step
                out.scheduled.append(self._scheduled(req, n))
                budget -= n
                prompt_tokens += n
                admitted += 1
        return out

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        """n more tokens of a running request; sampling if they reach its end, and (a hybrid model) saving its
        state into a checkpoint where they pass or end on one of its marks, or, a decode, every
        --mamba-track-interval tokens."""
        samples = req.num_computed_tokens + n == req.num_tokens
        if n == 1 and samples and req.num_computed_tokens >= req.num_prompt_tokens:  # a decode
            return ScheduledRequest(req, 1, True, self.kv.track_target(req) if self._tracks else None)
        save = self.kv.checkpoint_target(req, n)
        return ScheduledRequest(req, n, samples, *(save or (None, None)))

    def _admission_cap(self, num_decodes: int) -> float:
        """Prompt tokens up to which this step admits waiting requests beyond the first: the configured share
        when the step carries decodes (at most LIGHT_QUEUE_MAX_DECODES) and the queue holds at most
        LIGHT_QUEUE_BUDGETS budgets, else none."""
        share = self.config.admit_tokens_beside_decodes
        if not share or not num_decodes or num_decodes > LIGHT_QUEUE_MAX_DECODES:
            return math.inf
        # a waiting request counts whole (its cached prefix is found at admission): a queue of questions over
        # a cached document reads as long, and fills the step as before
        limit, queued = LIGHT_QUEUE_BUDGETS * self.config.token_budget, 0
        for req in self.waiting:
            queued += req.num_remaining_tokens
            if queued > limit:
                return math.inf
        return share

    def _shorts_first(self) -> list[Request]:
        """Waiting requests (of the first few) with at most short_prefill_tokens left to compute, when there
        is long prefill work besides them (a running request mid-prefill, or a long one waiting among the
        first few) and the last step did not already put it off; else []."""
        limit = self.config.short_prefill_tokens
        if not limit or self._deferred or not self.waiting:
            return []
        if len(self.running) >= self.config.max_running_requests:
            return []
        long_work = any(r.num_remaining_tokens > 1 for r in self.running)
        if not long_work and len(self.waiting) == 1:
            # nothing to put off whatever its length: no prefix walk (a 32K-token prompt's is ~0.5 ms on the
            # CI CPU, and admission walks it again; probe_hit.py on an H200 host: schedule 1.7 of a 14.4 ms hit)
            return []
        shorts = []
        for req in itertools.islice(self.waiting, self.config.short_lookahead):
            if self._blocked_by_sibling(req):
                continue
            if req.num_tokens - self.kv.peek_prefix_len(req) <= limit:
                shorts.append(req)
            else:
                long_work = True
        return shorts if long_work else []

    def _pick_victim(self, exclude: set[str]) -> Request | None:
        """The most recently admitted running request not yet scheduled this step."""
        for req in reversed(self.running):
            if req.request_id not in exclude:
                return req
        return None

    def _blocked_by_sibling(self, req: Request) -> bool:
        """A sibling of an n > 1 request waits for its leader's prompt pages, to share them (not where prompts
        are never shared: a hybrid model's recurrent state without prefix caching)."""
        if req.group_id is None or not self.kv.shares_prompts:
            return False
        leader = self.group_leaders.get(req.group_id)
        if leader is None or leader is req:
            return False
        return leader.num_computed_tokens < leader.num_prompt_tokens

    def _admit(self, req: Request, budget: int) -> int:
        """Attach cached pages, allocate the first chunk and move to running; 0 if pages ran short."""
        first_admission = req.num_cached_tokens < 0
        leader = self.group_leaders.get(req.group_id) if req.group_id is not None else None
        if self.kv.siblings_fork and leader is not None and leader is not req and leader.page_ids:
            hit = self.kv.fork_prefix(req, leader)
        else:
            hit = self.kv.match_prefix(req)
        n = self._fit(req, self._chunk(req, budget))
        if not self.kv.allocate(req, n):
            self.kv.release(req, cache=False)
            req.num_computed_tokens = 0
            return 0
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        if first_admission:
            req.num_cached_tokens = hit
            req.first_scheduled_time = time.perf_counter()
            self.num_prefix_query_tokens += req.num_prompt_tokens
            self.num_prefix_hit_tokens += hit
        return n

    def advance(self, out: SchedulerOutput) -> None:
        """Once the step is launched: computed counts move on, and the token each sampling row will get is
        pending (Request.num_pending) until `commit` hands it over. The overlapped schedule plans the next
        step between the two; otherwise `update` does both at once."""
        row = 0
        limit = self.config.context_length
        for s in out.scheduled:
            req = s.request
            if req.status is RequestStatus.FINISHED:  # ended while the step before ran (overlapped)
                row += s.samples
                if s.state_save is not None:
                    self.kv.state_saved(req, s.state_save)  # dropped: its pages are gone
                continue
            req.num_computed_tokens += s.num_new_tokens
            if req.state_restore is not None:  # (a test, not a call, for every request of a decode step)
                self.kv.state_restored(req)
            if req.num_computed_tokens <= req.num_prompt_tokens:
                # prompt pages are shared as soon as they are computed (a later step reads them after this
                # one's writes: one stream); generated ones when the request ends (release), not every page
                # a decode fills: a re-insert walks the whole sequence
                self.kv.cache_computed(req)
            if s.state_save is not None:  # its state after these tokens (or the first state_save_at of them)
                at = s.state_save_at
                covers = None if at is None else req.num_computed_tokens - s.num_new_tokens + at
                self.kv.state_saved(req, s.state_save, covers)
            if s.samples:
                req.num_pending += 1
                req.pending_row = row
                row += 1
                outputs = len(req.output_token_ids) + req.num_pending
                max_new = req.sampling_params.max_new_tokens
                req.pending_final = (max_new is not None and outputs >= max_new) or (
                    limit is not None and req.num_tokens >= limit
                )

    def commit(self, out: SchedulerOutput, sampled_token_ids: list[int]) -> list[tuple[int, Request, int]]:
        """Append the sampled tokens of an advanced step; returns (row, request, token) for each request that
        took one, in scheduling order. A request that ended (stop, abort) while the step ran drops its
        token; one preempted meanwhile keeps it (it recomputes it with the rest)."""
        rows = [s.request for s in out.scheduled if s.samples]
        assert len(rows) == len(sampled_token_ids), "runner returned a token count unlike the sampling rows'"
        new_tokens: list[tuple[int, Request, int]] = []
        for i, (req, token) in enumerate(zip(rows, sampled_token_ids)):
            if req.status is RequestStatus.FINISHED:
                continue
            req.num_pending -= 1
            if not req.num_pending:
                req.pending_final = False
            req.output_token_ids.append(token)
            new_tokens.append((i, req, token))
        return new_tokens

    def update(self, out: SchedulerOutput, sampled_token_ids: list[int]) -> list[tuple[int, Request, int]]:
        """`advance` and `commit` at once: a step run to its end before the next is planned."""
        self.advance(out)
        return self.commit(out, sampled_token_ids)
