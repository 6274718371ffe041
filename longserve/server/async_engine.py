"""AsyncEngine: the engine's step loop in its own thread (server/engine_loop.py), bridged to asyncio.

Coroutines post typed commands to the engine thread; each step's outputs come back to per-request asyncio queues
with one loop.call_soon_threadsafe per step. A request whose own handling raises (its sampling, its text) ends with
an error alone; an exception in the step itself fails the requests in flight and the loop keeps serving; every
accepted request ends with a result or an error. Admission counts the requests that wait for a running slot;
`drain` stops admission and lets the requests in flight finish before a shutdown.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from longserve.engine import Engine
from longserve.outputs import CompletionOutput, RequestOutput
from longserve.pooling_params import PoolingParams
from longserve.sampling_params import SamplingParams
from longserve.server.engine_loop import SHUTTING_DOWN, Abort, AbortAll, Add, Call, EngineLoop, Stop
from longserve.server.errors import APIError, internal_error
from longserve.siblings import num_candidates
from longserve.tokenization.detokenizer import IncrementalDetokenizer, TextAssembler

__all__ = ["SHUTTING_DOWN", "AsyncEngine"]

_CODES = {503: "shutting_down"}


class AsyncEngine(EngineLoop):
    def __init__(self, engine: Engine, max_queued_requests: int = 1024) -> None:
        super().__init__(engine)
        self.max_queued_requests = max_queued_requests
        self.context_length = engine.context_length
        # the routes check requests' top-logprob counts against these before queueing
        self.max_logprobs, self.vocab_size = engine.max_logprobs, engine.runner.model.vocab_size
        # read-only after construction: admission compares the requests in flight against it
        self.max_running_requests = engine.config.max_running_requests
        self._queues: dict[str, asyncio.Queue] = {}  # touched on the event loop only
        # requests posted to the engine and not yet reported finished -> their member count (event loop only)
        self._inflight: dict[str, int] = {}
        self._num_inflight = 0  # sum of _inflight's values
        self.draining = False  # set by drain(): no new requests
        # Text is assembled here, on the event loop, when the engine leaves it out (detokenize=False):
        # decoding and stop strings never hold up the step loop.
        self._detokenizer = (
            IncrementalDetokenizer(engine.tokenizer)
            if not engine.detokenize and engine.tokenizer is not None
            else None
        )
        self._texts: dict[str, list[TextAssembler]] = {}  # event loop only

    # ---- API for coroutines ---------------------------------------------------------------------
    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps (exact stats, cache flushes)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._post(Call(fn, fut))
        return await asyncio.wrap_future(fut)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Abort a request; `reason` ("abort" or "timeout") is the metrics' finished_reason."""
        self._post(Abort(request_id, reason))

    @property
    def num_queued(self) -> int:
        """Requests (counting each of n completions) that wait for a running slot, or, when the KV pool is
        what holds them back, for pages (the engine's waiting queue after the last step)."""
        return max(self._num_inflight - self.max_running_requests, self.num_waiting, 0)

    def inflight_ids(self) -> list[str]:
        """Ids of the requests accepted and not yet finished (event loop side)."""
        return list(self._inflight)

    @property
    def num_inflight(self) -> int:
        """Requests accepted and not yet finished (event loop side)."""
        return len(self._inflight)

    async def add(
        self,
        prompt_ids: list[int],
        params: SamplingParams | PoolingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        grammar: Any = None,
    ) -> str:
        """Queue a request; returns its id once the engine accepted it. Iterate `stream(id)` next (or
        `release(id)`). APIError: 400 for input the engine refuses, 503 when the queue is full or the server
        is shutting down. arrival_time (time.perf_counter()): when the server got it; None: now."""
        if arrival_time is None:
            arrival_time = time.perf_counter()
        if self.draining:
            raise APIError(503, SHUTTING_DOWN, code="shutting_down")
        if not self.is_alive:
            raise APIError(503, "the engine is not running; see the server log")
        if self.num_queued >= self.max_queued_requests:
            raise APIError(
                503,
                f"server busy: {self.max_queued_requests} requests already wait for a running slot "
                "(--max-queued-requests); retry later",
            )
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues or request_id in self._inflight:
            raise APIError(400, f"request id {request_id!r} is already in use", param="rid")
        self._queues[request_id] = asyncio.Queue()
        if self._detokenizer is not None and isinstance(params, SamplingParams):  # pooling: no text
            self._texts[request_id] = [
                TextAssembler(
                    self._detokenizer,
                    prompt_ids,
                    params.stop,
                    params.skip_special_tokens,
                    keep_stop=params.no_stop_trim,
                )
                for _ in range(params.n)
            ]
        fut: concurrent.futures.Future = concurrent.futures.Future()
        # best_of > n runs best_of engine requests; a pooling request is one
        members = num_candidates(params) if isinstance(params, SamplingParams) else 1
        self._inflight[request_id] = members
        self._num_inflight += members
        self._post(Add(request_id, prompt_ids, params, fut, arrival_time, grammar))
        try:
            await asyncio.wrap_future(fut)
        except BaseException:
            self._forget(request_id)  # refused, or cancelled before the engine took it: never in flight
            self.release(request_id)  # cancelled after it did: the abort ends it
            raise
        return request_id

    def _forget(self, request_id: str) -> None:
        self._num_inflight -= self._inflight.pop(request_id, 0)

    async def drain(self, timeout: float) -> int:
        """Take no new requests (503, /health too), wait up to `timeout` seconds for those in flight to
        finish, then end the rest with a 503 error (an error event in a stream). Returns how many were
        ended so; their pages go back to the pool."""
        self.draining = True
        end = time.monotonic() + timeout
        while self._inflight and time.monotonic() < end:
            await asyncio.sleep(0.05)
        left = len(self._inflight)
        if left:
            self._post(
                AbortAll(
                    f"the server is shutting down: the request did not finish within the {timeout:g} s "
                    "it was given (--shutdown-timeout)",
                    503,
                )
            )
            end = time.monotonic() + 10  # the engine thread ends them after its current step
            while self._inflight and time.monotonic() < end:
                await asyncio.sleep(0.02)
        return left

    async def stream(self, request_id: str, deadline: float | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of an added request until it finishes; aborts it if the caller stops early.
        APIError: 504 past `deadline` (a time.monotonic() value), 500 when a step failed."""
        queue = self._queues[request_id]
        finished = False
        reason = "abort"
        try:
            while True:
                timeout = None if deadline is None else deadline - time.monotonic()
                try:
                    out, status = await asyncio.wait_for(queue.get(), timeout)
                except TimeoutError:
                    reason = "timeout"
                    raise APIError(
                        504, "request timed out (--request-timeout) and was aborted", code="timeout"
                    ) from None
                finished = out.finished
                if status is not None:
                    raise APIError(status, out.error or "engine error", code=_CODES.get(status))
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.release(request_id, reason)
            self._queues.pop(request_id, None)

    def release(self, request_id: str, reason: str = "abort") -> None:
        """Forget a request and abort it in the engine (a no-op once it finished)."""
        self._queues.pop(request_id, None)
        self._texts.pop(request_id, None)
        self.abort(request_id, reason)

    # ---- the event loop's side of each step's outputs -------------------------------------------
    def _deliver(self, items: list[tuple[RequestOutput, int | None]]) -> None:
        for out, status in items:
            if out.finished:
                self._forget(out.request_id)
            texts = self._texts.get(out.request_id)
            try:
                if texts is not None:
                    for c in out.outputs:
                        self._assemble(out.request_id, c, texts[c.index])
            except Exception:  # this request's text: it alone ends with an error
                error = internal_error(f"assembling the text of request {out.request_id}", out.request_id)
                out.error, status = error.message, error.status
                if not out.finished:
                    self.abort(out.request_id)
            if out.finished or status is not None:
                self._texts.pop(out.request_id, None)
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait((out, status))

    def _assemble(self, request_id: str, c: CompletionOutput, text: TextAssembler) -> None:
        """Fill a completion's text and streaming delta; a stop string found here ends it in the engine
        (tokens the engine generated after it are dropped)."""
        if text.stop_hit is None:
            # a stop token has no text, unless no_stop_trim keeps it
            ids = c.token_ids[:-1] if isinstance(c.stop_reason, int) and not text.keep_stop else c.token_ids
            stop = text.add(ids, final=c.finish_reason is not None)
            if stop is not None and c.finish_reason is None:
                self._post(Stop(request_id, c.index, stop))
        if text.stop_hit is not None:
            n, first_new = text.num_tokens_at_stop, len(c.token_ids) - len(c.new_token_ids)
            c.token_ids = c.token_ids[:n]
            c.new_token_ids = c.token_ids[first_new:]
            if c.logprobs is not None:
                c.logprobs = c.logprobs[:n]
            if c.top_logprobs is not None:
                c.top_logprobs = c.top_logprobs[:n]
            if c.finish_reason is not None:
                c.finish_reason, c.stop_reason = "stop", text.stop_hit
        c.text = text.text
        c.new_text = text.delta(c.finish_reason is not None)
