"""The engine thread's side of AsyncEngine (server/async_engine.py): the step loop in its own thread.

Only this thread touches the Engine. Coroutines post typed commands (Add, Abort, Stop, Call, AbortAll) to it; it
runs them between steps and hands each step's outputs to the event loop with one loop.call_soon_threadsafe per step
(AsyncEngine._deliver, there). An exception in the step itself fails the requests in flight and the loop keeps
serving. Metrics and the stats log line are updated here after each iteration (StatsTracker).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from longserve.distributed import RankFailure
from longserve.engine import Engine
from longserve.engine_checks import PromptTooLongError
from longserve.outputs import EngineStats, RequestOutput, StepStats
from longserve.sampling_params import SamplingParams
from longserve.server.errors import APIError, internal_error
from longserve.server.metrics import ServerMetrics, StatsTracker
from longserve.server.step_log import StepLog

__all__ = ["SHUTTING_DOWN", "Abort", "AbortAll", "Add", "Call", "Command", "EngineLoop", "Stop"]

logger = logging.getLogger("longserve.server")
SHUTTING_DOWN = "the server is shutting down and takes no new requests"


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


class EngineLoop:
    """The engine, its thread and what only that thread writes (the commands' queue is shared under a condition)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cv = threading.Condition()
        self._commands: deque[Command] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.num_waiting = 0  # engine's waiting requests after the last step (engine thread writes)
        self.num_steps = 0
        self.num_step_errors = 0
        self.num_aborted = 0  # requests aborted while in flight (client gone, timeout)
        self.healthy = True
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

    def _post(self, command: Command) -> None:
        with self._cv:
            self._commands.append(command)
            self._cv.notify()

    def _deliver(self, items: list[tuple[RequestOutput, int | None]]) -> None:
        """On the event loop: a step's outputs to their requests (AsyncEngine's)."""
        raise NotImplementedError

    # ---- the engine thread ----------------------------------------------------------------------
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
