"""`--step-log PATH`: one JSON line per iteration of the engine thread's loop, to find where a served
workload's time goes (the HTTP comparisons against vLLM in benchmarks/RESULTS.md could say how long requests
took, not what the server did meanwhile).

Each line: `t` (s since the log opened, at the iteration's start), `idle_ms` (waiting for work before it),
`commands` and `commands_ms` (requests added, aborts), `step_ms` (Engine.step's wall time) and `wait_ms` (of
which reading a launched step's tokens, i.e. waiting for the device), `read_ms` (when, into the step, its first
such read had the tokens: the end of the step in flight as the host saw it; -1 if none), `prefill` and `decode`
(tokens the step computed), `running`/`waiting` (requests after it), `early` (outputs handed out before a
prefill launch), `outputs`, and `send_ms` (metrics and hand-out to the event loop). A step whose `step_ms` is
much more than its `wait_ms` is bound by the host; a long `idle_ms` while requests wait elsewhere (tokenizing)
shows too.
The first line, `{"opened_unix": ...}`, is the wall-clock time of t = 0 (to line the log up with a client's
timings). The file is written anew at each start; lines are buffered and flushed every second and at exit.
`scripts/probes/step_log_summary.py` sums a log up per workload.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import TextIO

from longserve.outputs import StepStats

logger = logging.getLogger("longserve.server")


class StepLog:
    """Writes the loop's lines (engine thread only)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: TextIO | None = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._t0 = time.perf_counter()
        self._flushed = self._t0
        self._file.write(json.dumps({"opened_unix": time.time()}) + "\n")
        logger.info("step log: one line per engine loop iteration in %s", path)

    def record(
        self,
        start: float,
        idle: float,
        commands: int,
        commands_time: float,
        step: StepStats | None,
        early: int,
        outputs: int,
        send_time: float,
    ) -> None:
        """Times in s (time.perf_counter()); `step`: None when the iteration ran no step."""
        if self._file is None:
            return
        line = {
            "t": round(start - self._t0, 6),
            "idle_ms": round(idle * 1e3, 3),
            "commands": commands,
            "commands_ms": round(commands_time * 1e3, 3),
        }
        if step is not None:
            line.update(
                step_ms=round(step.step_time * 1e3, 3),
                wait_ms=round(step.wait_time * 1e3, 3),
                read_ms=round(step.read_time * 1e3, 3) if step.read_time >= 0 else -1,
                prefill=step.num_prefill_tokens,
                decode=step.num_decode_tokens,
                running=step.num_running,
                waiting=step.num_waiting,
            )
        line.update(early=early, outputs=outputs, send_ms=round(send_time * 1e3, 3))
        try:
            self._file.write(json.dumps(line) + "\n")
            now = time.perf_counter()
            if now - self._flushed >= 1.0:
                self._file.flush()
                self._flushed = now
        except OSError:  # a full disk ends the log, never the serving
            logger.exception("step log %s: writing failed; no more lines", self.path)
            self.close()

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):  # the lines so far are what they are
                self._file.close()
            self._file = None
