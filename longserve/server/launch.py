"""Start the server: resolve flags/env/file, load the engine, serve with uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import sys
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
    if engine.tokenizer is None:
        raise ValueError(f"the server needs a tokenizer; none found in {engine_config.tokenizer_path!r}")
    state = ServerState(
        engine_config=engine_config,
        server_config=server_config,
        engine=AsyncEngine(engine, server_config.max_queued_requests),
        tokenizers=TokenizerPool(engine_config.tokenizer_path, server_config.tokenizer_workers),
    )
    return create_app(state)


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    import uvicorn

    app = build_server(engine_config, server_config)
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
    uvicorn.Server(config).run()
    return 0


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
