"""AsyncEngine: the engine's step loop in its own thread, bridged to asyncio.

Only the engine thread touches the Engine. Coroutines post commands (add, abort, call) to it; it runs them
between steps and pushes each step's outputs to per-request asyncio queues with one
loop.call_soon_threadsafe per step. An exception in a step fails the requests it affected (all those in
flight) with an error and the loop keeps serving; every accepted request ends with a result or an error.
Metrics and the stats log line are updated on the engine thread after each iteration (StatsTracker).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from longserve.detokenizer import IncrementalDetokenizer, TextAssembler
from longserve.engine import Engine, PromptTooLongError
from longserve.outputs import CompletionOutput, RequestOutput
from longserve.sampling_params import SamplingParams
from longserve.server.errors import APIError
from longserve.server.metrics import ServerMetrics, StatsTracker

logger = logging.getLogger("longserve.server")


class AsyncEngine:
    def __init__(self, engine: Engine, max_queued_requests: int = 1024) -> None:
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.context_length = engine.context_length
        self._cv = threading.Condition()
        self._commands: deque[tuple[Any, ...]] = deque()
        self._queues: dict[str, asyncio.Queue] = {}  # touched on the event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._pending_adds = 0  # adds posted, not yet run (event loop side)
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
        self._timed_out: set[str] = set()  # aborted by their deadline (engine thread)

    # ---- lifecycle ------------------------------------------------------------------------------
    def configure_stats(self, metrics: ServerMetrics | None, log_stats_interval: float) -> None:
        """Metrics to update and the stats log interval (0: off). create_app calls it, usually before
        start(); later, the engine thread simply picks up the new tracker at its next iteration."""
        self.stats = StatsTracker(metrics, log_stats_interval)

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

    def fail(self) -> None:
        """Take no more requests (/health answers 503): the engine cannot serve anymore."""
        self.healthy = False

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.healthy

    # ---- API for coroutines ---------------------------------------------------------------------
    def _post(self, *command: Any) -> None:
        with self._cv:
            self._commands.append(command)
            self._cv.notify()

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps (exact stats, cache flushes)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._post("call", fn, fut)
        return await asyncio.wrap_future(fut)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Abort a request; `reason` ("abort" or "timeout") is the metrics' finished_reason."""
        self._post("abort", request_id, reason)

    async def add(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request; returns its id once the engine accepted it. Iterate `stream(id)` next (or
        `release(id)`). APIError: 400 for input the engine refuses, 503 when the queue is full.
        arrival_time (time.perf_counter()): when the server got it; None: now."""
        if arrival_time is None:
            arrival_time = time.perf_counter()
        if not self.is_alive:
            raise APIError(503, "the engine is not running; see the server log")
        if self._pending_adds + self.num_waiting >= self.max_queued_requests:
            raise APIError(
                503,
                f"server busy: {self.max_queued_requests} requests already wait (--max-queued-requests); "
                "retry later",
            )
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues:
            raise APIError(400, f"request id {request_id!r} is already in use", param="rid")
        self._queues[request_id] = asyncio.Queue()
        if self._detokenizer is not None:
            self._texts[request_id] = [
                TextAssembler(self._detokenizer, prompt_ids, params.stop, params.skip_special_tokens)
                for _ in range(params.n)
            ]
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._pending_adds += 1
        self._post("add", request_id, prompt_ids, params, fut, arrival_time)
        try:
            await asyncio.wrap_future(fut)
        except BaseException:
            self.release(request_id)  # cancelled, or refused: the abort is then a no-op
            raise
        finally:
            self._pending_adds -= 1
        return request_id

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
                    raise APIError(status, out.error or "engine error")
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
            texts = self._texts.get(out.request_id)
            if texts is not None:
                for c in out.outputs:
                    self._assemble(out.request_id, c, texts[c.index])
                if out.finished:
                    del self._texts[out.request_id]
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait((out, status))

    def _assemble(self, request_id: str, c: CompletionOutput, text: TextAssembler) -> None:
        """Fill a completion's text and streaming delta; a stop string found here ends it in the engine
        (tokens the engine generated after it are dropped)."""
        if text.stop_hit is None:
            ids = (
                c.token_ids[:-1] if isinstance(c.stop_reason, int) else c.token_ids
            )  # a stop token has no text
            stop = text.add(ids, final=c.finish_reason is not None)
            if stop is not None and c.finish_reason is None:
                self._post("stop", request_id, c.index, stop)
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
        while True:
            with self._cv:
                while not self._commands and not self._stopping and not engine.has_unfinished():
                    self._cv.wait(self.stats.idle_wait())
                    self.stats.maybe_log(engine)  # the last line of a busy spell, once it is due
                if self._stopping:
                    break
                commands = list(self._commands)
                self._commands.clear()
            items: list[tuple[RequestOutput, int | None]] = []
            for command in commands:
                try:
                    self._handle(command, items)
                except Exception:  # an abort that failed: the next step's failure handling cleans up
                    logger.exception("engine command %s failed", command[0])
            stepped = False
            if engine.has_unfinished():
                try:
                    items.extend((out, 400 if out.error else None) for out in engine.step())
                    self.num_steps += 1
                    stepped = True
                except Exception as e:  # the loop must survive any step failure
                    logger.exception(
                        "engine step failed; failing the %d requests in flight", engine.num_requests
                    )
                    self.num_step_errors += 1
                    items.extend(self._fail_all(f"engine step failed: {type(e).__name__}: {e}", 500))
            self.num_waiting = engine.scheduler.num_waiting
            self._observe(stepped, items)
            self._send(items)
        self._send(self._fail_all("the server is shutting down", 503))

    def _observe(self, stepped: bool, items: list[tuple[RequestOutput, int | None]]) -> None:
        try:
            self.stats.update(self.engine, stepped, items, self._timed_out)
            self.stats.maybe_log(self.engine)
        except Exception:  # metrics must never take the engine down
            logger.exception("updating metrics failed")
        if self._timed_out:
            self._timed_out.difference_update(out.request_id for out, _ in items if out.finished)

    def _send(self, items: list[tuple[RequestOutput, int | None]]) -> None:
        if items and self._loop is not None:
            # the event loop may have closed under us: then nobody is left to tell
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._deliver, items)

    def _handle(self, command: tuple[Any, ...], items: list) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt_ids, params, fut, arrival_time = command
            if not fut.set_running_or_notify_cancel():  # the caller gave up before we got to it
                return
            try:
                self.engine.add_request(prompt_ids, params, request_id, arrival_time=arrival_time)
            except PromptTooLongError as e:
                fut.set_exception(APIError(400, str(e), param="prompt", code="context_length_exceeded"))
            except ValueError as e:
                fut.set_exception(APIError(400, str(e)))
            except Exception as e:
                logger.exception("add_request failed")
                fut.set_exception(APIError(500, f"could not queue the request: {e}"))
            else:
                fut.set_result(request_id)
        elif kind == "abort":
            _, request_id, reason = command
            out = self.engine.abort(request_id)
            if out is not None:
                self.num_aborted += 1
                if reason == "timeout":
                    self._timed_out.add(request_id)
                items.append((out, None))
        elif kind == "stop":
            _, request_id, index, stop = command
            out = self.engine.stop_at_string(request_id, index, stop)
            if out is not None:
                items.append((out, None))
        elif kind == "call":
            _, fn, fut = command
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:
                fut.set_exception(e)

    def _fail_all(self, message: str, status: int) -> list[tuple[RequestOutput, int | None]]:
        """Abort every request in flight; each one's caller gets `message` with HTTP `status`."""
        items = []
        for request_id in list(self.engine.groups):
            try:
                out = self.engine.abort(request_id)
            except Exception:  # the engine's state is broken: stop taking requests
                logger.exception("abort of %s failed; the engine is unhealthy", request_id)
                self.healthy = False
                out = RequestOutput(request_id, None, [], [], finished=True)
                self.engine.groups.pop(request_id, None)
            if out is not None:
                out.error = message
                items.append((out, status))
        return items
