"""Start the server: resolve flags/env/file, load the engine, serve with uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from longserve.config import EngineConfig
from longserve.server.config import ServerConfig

logger = logging.getLogger("longserve.server")


def build_server(engine_config: EngineConfig, server_config: ServerConfig):
    """The FastAPI app over a freshly loaded engine (its step thread starts with the app)."""
    from longserve.engine import Engine
    from longserve.server.app import create_app
    from longserve.server.async_engine import AsyncEngine
    from longserve.server.state import ServerState
    from longserve.tokenization.pool import MAX_CHARS_PER_TOKEN, TokenizerPool

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
                max_chars=MAX_CHARS_PER_TOKEN * engine.context_length,
                chat_template=engine_config.chat_template_text,
            ),
        )
        return create_app(state)
    except BaseException:
        engine.close()  # its tensor-parallel workers stop with it
        raise


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a port already in use fails at once, with the
    port and the flag to change it, instead of after minutes of loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restarts reuse TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        shown = f"[{host}]" if ":" in host else host
        raise OSError(
            f"cannot listen on {shown}:{port}: {e.strerror or e}; is another server running there? "
            "Choose another port with --port (or another address with --host)"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serve until SIGINT/SIGTERM (drained, exit code 0) or until a tensor-parallel rank dies (1). The
    engine is closed on every way out, so no worker process outlives the server."""
    import uvicorn

    from longserve.server import logsafe
    from longserve.server.shutdown import DrainingServer

    host, port = server_config.host, server_config.port
    sock = bind_socket(host, port)
    shown = f"[{host}]" if ":" in host else host
    # the bound port, before the minutes of loading: `--port 0` takes one the kernel picks, and whoever
    # started the server (longserve.testing.server_process) reads it here, with no window for a race
    logger.info("listening on http://%s:%d; loading the model", shown, sock.getsockname()[1])
    try:
        app = build_server(engine_config, server_config)
    except BaseException:
        sock.close()
        raise
    async_engine = app.state.longserve.engine
    logger.info(
        "serving %s on http://%s:%d (OpenAI API under /v1, SGLang /generate)",
        engine_config.model,
        shown,
        sock.getsockname()[1],
    )
    config = uvicorn.Config(
        app,
        log_level=server_config.log_level,
        access_log=server_config.log_requests,
        timeout_graceful_shutdown=5,  # after the drain: only responses still being written are left
    )
    server = DrainingServer(config, async_engine, server_config.shutdown_timeout)
    logsafe.install()  # uvicorn.Config set up its loggers' handlers: now every handler escapes client strings
    failures = _stop_on_rank_failure(server, async_engine)
    try:
        server.run(sockets=[sock])
    finally:
        async_engine.close()  # usually done already at the app's lifespan end; idempotent
        sock.close()
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


def run_from_args(args: argparse.Namespace) -> NoReturn:
    from longserve.server.args import resolve

    engine_config, server_config = resolve(args)
    logging.getLogger().setLevel(server_config.log_level.upper())
    code = serve(engine_config, server_config)
    # The server is down and its engine closed (tensor-parallel workers reaped, every request ended). Skip
    # the interpreter's teardown: native threads can still run then (gloo's, after the process group was
    # left; the tokenizers' pool), and a two-rank server once exited -6 (abort) there after a clean drain on a
    # busy machine. The exit status must be the server's own.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m longserve.launch_server ...`: the same flags as `longserve serve`."""
    from longserve.server.args import build_parser

    parser = build_parser(prog="python -m longserve.launch_server")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_from_args(args)
    except (ValueError, OSError, RuntimeError) as e:
        from longserve.server.args import cli_message

        print(f"error: {cli_message(e)}", file=sys.stderr)  # settings named as this command's flags
        return 2


if __name__ == "__main__":
    sys.exit(main())
