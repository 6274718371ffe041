"""Graceful shutdown: uvicorn's Server, except that the first SIGTERM/SIGINT drains the engine before the
server stops (AsyncEngine.drain: new requests and /health get 503, the requests in flight get up to
--shutdown-timeout seconds, then an error); a second signal stops at once. The signal is not re-raised at
exit (uvicorn's own handler does that), so a drained server exits with status 0."""

from __future__ import annotations

import logging
import signal

import uvicorn

from longserve.server.async_engine import AsyncEngine

logger = logging.getLogger("longserve.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.draining = False

    def handle_exit(self, sig: int, frame) -> None:  # a signal handler, on the main thread
        loop = self.engine.loop
        if self.draining or self.should_exit or loop is None:  # again, or before start-up finished
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        self.draining = True
        name = signal.Signals(sig).name
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain(name)))

    async def _drain(self, signal_name: str) -> None:
        logger.info(
            "%s: shutting down; the %d requests in flight get up to %g s to finish (--shutdown-timeout)",
            signal_name,
            self.engine.num_inflight,
            self.shutdown_timeout,
        )
        try:
            ended = await self.engine.drain(self.shutdown_timeout)
            if ended:
                logger.warning("ended %d unfinished requests with an error", ended)
        finally:
            self.should_exit = True  # uvicorn's main loop polls it every 0.1 s
