"""Start the server: resolve flags/env/file, load the engine, serve with uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Sequence

from longserve.config import EngineConfig, ServerConfig

logger = logging.getLogger("longserve.server")


def build_server(engine_config: EngineConfig, server_config: ServerConfig):
    """The FastAPI app over a freshly loaded engine (its step thread starts with the app)."""
    from longserve.engine import Engine
    from longserve.server.app import create_app
    from longserve.server.async_engine import AsyncEngine
    from longserve.server.state import ServerState
    from longserve.server.tokenize import TokenizerPool

    engine = Engine(engine_config, detokenize=False)  # the AsyncEngine assembles text on the event loop
    try:
        if engine.tokenizer is None:
            raise ValueError(f"the server needs a tokenizer; none found in {engine_config.tokenizer_path!r}")
        state = ServerState(
            engine_config=engine_config,
            server_config=server_config,
            engine=AsyncEngine(engine, server_config.max_queued_requests),
            tokenizers=TokenizerPool(
                engine_config.tokenizer_path,
                server_config.tokenizer_workers,
                server_config.tokenizer_prefix_cache_size,
            ),
        )
        return create_app(state)
    except BaseException:
        engine.close()  # its tensor-parallel workers stop with it
        raise


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serve until SIGINT/SIGTERM (exit code 0) or until a tensor-parallel rank dies (1). The engine is
    closed on every way out, so no worker process outlives the server."""
    import uvicorn

    app = build_server(engine_config, server_config)
    async_engine = app.state.longserve.engine
    host, port = server_config.host, server_config.port
    shown = f"[{host}]" if ":" in host else host
    logger.info(
        "serving %s on http://%s:%d (OpenAI API under /v1, SGLang /generate)",
        engine_config.model,
        shown,
        port,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=server_config.log_level,
        access_log=server_config.log_requests,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    failures = _stop_on_rank_failure(server, async_engine)
    try:
        server.run()
    finally:
        async_engine.close()  # usually done already at the app's lifespan end; idempotent
    if failures:
        logger.error("exiting with status 1: a tensor-parallel rank died (logged above)")
        return 1
    return 0


def _stop_on_rank_failure(server, async_engine) -> list[str]:
    """Make a dead tensor-parallel rank stop the server (the engine cannot run a step without it): one
    clear log line, no new requests, uvicorn shuts down; requests in flight fail with 500 at the engine's
    next step. Returns the list the failure is recorded in (empty while all is well)."""
    failures: list[str] = []
    workers = getattr(getattr(async_engine.engine, "runner", None), "workers", None)
    if workers is None:
        return failures
    lock = threading.Lock()

    def on_failure(message: str) -> None:  # on the tp watchdog thread
        with lock:
            if failures:
                return
            if server.should_exit:  # already on its way down (SIGTERM to the whole process group, say)
                logger.warning("%s (while the server was shutting down)", message)
                return
            failures.append(message)
        logger.critical("%s; shutting down the server", message)
        async_engine.fail()
        server.should_exit = True  # uvicorn's main loop polls it every 0.1 s

    workers.on_failure = on_failure  # fires even for a rank that died before this line
    return failures


def run_from_args(args: argparse.Namespace) -> int:
    from longserve.server.args import resolve

    engine_config, server_config = resolve(args)
    logging.getLogger().setLevel(server_config.log_level.upper())
    return serve(engine_config, server_config)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m longserve.launch_server ...`: the same flags as `longserve serve`."""
    from longserve.server.args import build_parser

    parser = build_parser(prog="python -m longserve.launch_server")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_from_args(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
