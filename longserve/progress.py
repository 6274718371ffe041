"""Progress lines for the long steps of start-up that log nothing until they end (the CUDA graphs' capture, the
cuDNN attention plans): on an H100 (fiftieth session) the seed's Qwen3.5-35B-A3B captured its piecewise graphs
in 17.1 s with no line between the one before and the one after, long enough to look hung."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

# seconds between two progress lines of one operation
EVERY_SECONDS = 3.0


class Progress:
    """'<what>: <done> of <total>' on `logger` at most every `every` seconds as `step(done)` is called; nothing
    for an operation shorter than that (its own closing line says it all)."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        total: int,
        every: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.logger, self.what, self.total, self.clock = logger, what, total, clock
        self.every = EVERY_SECONDS if every is None else every
        self.last = clock()

    def step(self, done: int) -> None:
        now = self.clock()
        if now - self.last >= self.every and done < self.total:
            self.logger.info("%s: %d of %d", self.what, done, self.total)
            self.last = now
