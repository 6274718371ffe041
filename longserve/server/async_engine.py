"""AsyncEngine: the engine's step loop in its own thread, bridged to asyncio.

Only the engine thread touches the Engine. Coroutines post typed commands (Add, Abort, Stop, Call, AbortAll)
to it; it runs them between steps and pushes each step's outputs to per-request asyncio queues with one
loop.call_soon_threadsafe per step. A request whose own handling raises (its sampling, its text) ends with
an error alone; an exception in the step itself fails the requests in flight and the loop keeps serving;
every accepted request ends with a result or an error. Admission counts the requests that wait for a
running slot; `drain` stops admission and lets the requests in flight finish before a shutdown.
Metrics and the stats log line are updated on the engine thread after each iteration (StatsTracker).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from longserve.distributed import RankFailure
from longserve.engine import Engine
from longserve.engine_checks import PromptTooLongError
from longserve.outputs import CompletionOutput, EngineStats, RequestOutput, StepStats
from longserve.pooling_params import PoolingParams
from longserve.sampling_params import SamplingParams
from longserve.server.errors import APIError, internal_error
from longserve.server.metrics import ServerMetrics, StatsTracker
from longserve.server.step_log import StepLog
from longserve.siblings import num_candidates
from longserve.tokenization.detokenizer import IncrementalDetokenizer, TextAssembler

logger = logging.getLogger("longserve.server")
SHUTTING_DOWN = "the server is shutting down and takes no new requests"
_CODES = {503: "shutting_down"}


# ---- commands to the engine thread -----------------------------------------------------------------
@dataclass(slots=True)
class Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    future: concurrent.futures.Future
    arrival_time: float
    grammar: Any = None  # the output's compiled grammar (compiled off this thread)


@dataclass(slots=True)
class Abort:
    request_id: str
    reason: str  # the metrics' finished_reason: "abort" or "timeout"


@dataclass(slots=True)
class Stop:
    request_id: str
    index: int  # which of its n completions
    stop: str  # the stop string found in its text


@dataclass(slots=True)
class Call:
    fn: Callable[[Engine], Any]
    future: concurrent.futures.Future


@dataclass(slots=True)
class AbortAll:
    message: str  # what each request's caller is told
    status: int


Command = Add | Abort | Stop | Call | AbortAll


class AsyncEngine:
    def __init__(self, engine: Engine, max_queued_requests: int = 1024) -> None:
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.context_length = engine.context_length
        # the routes check requests' top-logprob counts against these before queueing
        self.max_logprobs, self.vocab_size = engine.max_logprobs, engine.runner.model.vocab_size
        # read-only after construction: admission compares the requests in flight against it
        self.max_running_requests = engine.config.max_running_requests
        self._cv = threading.Condition()
        self._commands: deque[Command] = deque()
        self._queues: dict[str, asyncio.Queue] = {}  # touched on the event loop only
        # requests posted to the engine and not yet reported finished -> their member count (event loop only)
        self._inflight: dict[str, int] = {}
        self._num_inflight = 0  # sum of _inflight's values
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.draining = False  # set by drain(): no new requests
        self.num_waiting = 0  # engine's waiting requests after the last step (engine thread writes)
        self.num_steps = 0
        self.num_step_errors = 0
        self.num_aborted = 0  # requests aborted while in flight (client gone, timeout)
        self.healthy = True
        # Text is assembled here, on the event loop, when the engine leaves it out (detokenize=False):
        # decoding and stop strings never hold up the step loop.
        self._detokenizer = (
            IncrementalDetokenizer(engine.tokenizer)
            if not engine.detokenize and engine.tokenizer is not None
            else None
        )
        self._texts: dict[str, list[TextAssembler]] = {}  # event loop only
        self.stats = StatsTracker(None, 0.0)  # engine thread only; see configure_stats
        self.step_log: StepLog | None = None  # engine thread only; see configure_stats
        self._timed_out: set[str] = set()  # aborted by their deadline (engine thread)

    # ---- lifecycle ------------------------------------------------------------------------------
    def configure_stats(
        self, metrics: ServerMetrics | None, log_stats_interval: float, step_log: str | None = None
    ) -> None:
        """Metrics to update, the stats log interval (0: off) and the step log's path (server/step_log.py;
        None: off). create_app calls it before start()."""
        self.stats = StatsTracker(metrics, log_stats_interval)
        if step_log is not None:
            self.step_log = StepLog(step_log)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="longserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the engine thread, then release the engine (tensor-parallel workers exit). Idempotent.

        A step that does not end within `timeout` (a collective waiting on a rank) is not raced with
        the workers' shutdown message: the workers are killed instead, which ends the step with an error."""
        self.stop(timeout)
        if self._thread is not None and self._thread.is_alive():
            workers = getattr(getattr(self.engine, "runner", None), "workers", None)
            logger.error(
                "the engine thread did not stop within %.0fs (a step is stuck)%s",
                timeout,
                "; killing the tensor-parallel workers" if workers is not None else "",
            )
            if workers is None:
                return
            for proc in workers.procs:
                proc.kill()
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("the engine thread is still stuck; leaving the engine as it is")
                return
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the outputs go to (None before start)."""
        return self._loop

    def fail(self) -> None:
        """Take no more requests (/health answers 503): the engine cannot serve anymore."""
        self.healthy = False

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.healthy

    # ---- API for coroutines ---------------------------------------------------------------------
    def _post(self, command: Command) -> None:
        with self._cv:
            self._commands.append(command)
            self._cv.notify()

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

    # ---- the engine thread ----------------------------------------------------------------------
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

    def _run(self) -> None:
        engine = self.engine
        warm_up = getattr(engine, "warm_up", None)  # runner/warm_up.py, on this thread: before the first step
        if warm_up is not None:
            try:
                warm_up()
            except Exception:  # only slower: unbuilt shapes run in the Triton kernel, variants compile late
                logger.exception("the warm-up failed; the first steps may stall while kernels compile")
        while True:
            idle_start = time.perf_counter()
            with self._cv:
                while not self._commands and not self._stopping and not engine.has_unfinished():
                    self._cv.wait(self.stats.idle_wait())
                    self.stats.maybe_log(engine)  # the last line of a busy spell, once it is due
                if self._stopping:
                    break
                commands = list(self._commands)
                self._commands.clear()
            start = time.perf_counter()
            items: list[tuple[RequestOutput, int | None]] = []
            for command in commands:
                try:
                    self._handle(command, items)
                except Exception:  # an abort that failed: the next step's failure handling cleans up
                    logger.exception("engine command %s failed", type(command).__name__)
            commands_done = time.perf_counter()
            stepped = False
            early: list[tuple[RequestOutput, int | None]] = []  # sent before the step's launch
            if engine.has_unfinished():
                try:
                    outs = engine.step(on_outputs=functools.partial(self._send_early, early))
                    items.extend((out, _status(out)) for out in outs)
                    self.num_steps += 1
                    stepped = True
                except Exception as e:  # the loop must survive any step failure
                    error = internal_error(
                        f"running an engine step; failing the {engine.num_requests} requests in flight"
                    )
                    if isinstance(
                        e, RankFailure
                    ):  # no bug of ours: say what happened, the details go to the log
                        error.message += "; a tensor-parallel rank failed and the server is shutting down"
                    self.num_step_errors += 1
                    items.extend(self._fail_all(error.message, 500))
            step_done = time.perf_counter()
            stats = engine.stats()
            self.num_waiting = stats.num_waiting
            self._observe(stats, engine.last_step_stats if stepped else None, early + items)
            self._send(items)
            if self.step_log is not None:
                self.step_log.record(
                    start, start - idle_start, len(commands), commands_done - start,
                    engine.last_step_stats if stepped else None, len(early), len(items),
                    time.perf_counter() - step_done,
                )  # fmt: skip
        self._send(self._fail_all(SHUTTING_DOWN, 503))
        if self.step_log is not None:
            self.step_log.close()
        self._check_pages()

    def _check_pages(self) -> None:
        """At exit: every page a request held is back (the prefix cache may keep its own)."""
        try:
            self.engine.check_integrity()
        except Exception:
            logger.exception("KV page accounting is broken at shutdown")
            return
        stats = self.engine.stats()
        logger.info(
            "engine stopped: every KV page is back in the pool (%d of %d free, %d cached for reuse)",
            stats.num_free_pages,
            stats.num_total_pages,
            stats.num_reclaimable_cached_pages,
        )

    def _observe(
        self, stats: EngineStats, step: StepStats | None, items: list[tuple[RequestOutput, int | None]]
    ) -> None:
        try:
            self.stats.update(stats, step, items, self._timed_out)
            self.stats.maybe_log(self.engine)
        except Exception:  # metrics must never take the engine down
            logger.exception("updating metrics failed")
        if self._timed_out:
            self._timed_out.difference_update(out.request_id for out, _ in items if out.finished)

    def _send_early(self, sent: list[tuple[RequestOutput, int | None]], outs: list[RequestOutput]) -> None:
        """Engine.step's on_outputs: the earlier step's outputs, to their clients before a slow launch."""
        items = [(out, _status(out)) for out in outs]
        sent.extend(items)
        self._send(items)

    def _send(self, items: list[tuple[RequestOutput, int | None]]) -> None:
        if items and self._loop is not None:
            # the event loop may have closed under us: then nobody is left to tell
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._deliver, items)

    def _handle(self, command: Command, items: list) -> None:
        match command:
            case Add(request_id, prompt_ids, params, fut, arrival_time, grammar):
                if not fut.set_running_or_notify_cancel():  # the caller gave up before we got to it
                    return
                try:
                    kw = {"grammar": grammar} if grammar is not None else {}
                    self.engine.add_request(prompt_ids, params, request_id, arrival_time=arrival_time, **kw)
                except PromptTooLongError as e:
                    fut.set_exception(APIError(400, str(e), param="prompt", code="context_length_exceeded"))
                except ValueError as e:
                    fut.set_exception(APIError(400, str(e)))
                except Exception:
                    fut.set_exception(internal_error(f"queueing request {request_id}", request_id))
                else:
                    fut.set_result(request_id)
            case Abort(request_id, reason):
                out = self.engine.abort(request_id)
                if out is not None:
                    self.num_aborted += 1
                    if reason == "timeout":
                        self._timed_out.add(request_id)
                    items.append((out, None))
            case Stop(request_id, index, stop):
                out = self.engine.stop_at_string(request_id, index, stop)
                if out is not None:
                    items.append((out, None))
            case Call(fn, fut):
                if not fut.set_running_or_notify_cancel():
                    return
                try:
                    fut.set_result(fn(self.engine))
                except Exception as e:
                    fut.set_exception(e)
            case AbortAll(message, status):
                items.extend(self._fail_all(message, status))

    def _fail_all(self, message: str, status: int) -> list[tuple[RequestOutput, int | None]]:
        """Abort every request in flight; each one's caller gets `message` with HTTP `status`."""
        outs = self.engine.abort_all(message)
        if self.engine.broken:  # an abort failed: the engine's state cannot be trusted any more
            self.healthy = False
        return [(out, status) for out in outs]


def _status(out: RequestOutput) -> int | None:
    """The HTTP status of a request that ended with an error: ours (500) or its input's (400)."""
    if not out.error:
        return None
    return 500 if out.error_internal else 400
