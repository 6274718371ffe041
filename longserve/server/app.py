"""The FastAPI app: API-key check, error handlers, the generation routes, the admin endpoints
(/health, /model_info, /server_info, /flush_cache, /tokenize, /detokenize) and Prometheus /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from longserve import __version__
from longserve.engine import Engine
from longserve.server import (
    openapi,
    routes_admin,
    routes_generate,
    routes_openai,
    routes_pooling,
    routes_responses,
)
from longserve.server.async_engine import SHUTTING_DOWN
from longserve.server.errors import APIError, install_error_handlers
from longserve.server.metrics import ServerMetrics
from longserve.server.protocol import DetokenizeRequest, TokenizeRequest, parse_body
from longserve.server.state import QUEUED_SCOPE_KEY, ServerState, get_state

OPEN_PATHS = frozenset({"/health", "/ping"})  # liveness probes (/ping: SageMaker's) need no key
GENERATION_PATHS = frozenset(
    {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/rerank", "/rerank"}
    | {"/v2/rerank", "/v1/score", "/score", "/v1/responses"}
)


class APIKeyMiddleware:
    """Every path but /health and /ping needs `Authorization: Bearer KEY` (or `x-api-key: KEY`); plain ASGI, so
    streaming responses and disconnect detection pass through untouched."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"")
        key = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        if not key:
            error = APIError(
                401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        elif not hmac.compare_digest(key, self.api_key):
            error = APIError(401, "invalid API key", code="invalid_api_key")
        else:
            return await self.app(scope, receive, send)
        await error.response()(scope, receive, send)


class RejectedRequestsMiddleware:
    """Counts generation calls answered 4xx or 503 before their requests reached the engine as
    finished_reason="rejected" (the engine accounts for the rest); plain ASGI, it reads the status line."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app = app
        self.rejected = metrics.finished["rejected"]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)

        async def send_counting(message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                if (400 <= status < 500 or status == 503) and not scope.get(QUEUED_SCOPE_KEY):
                    self.rejected.inc()
            await send(message)

        await self.app(scope, receive, send_counting)


def _kv_stats(engine: Engine, check_integrity: bool = False) -> dict[str, Any]:
    """Page accounting, read on the engine thread so the numbers agree with each other. check_integrity adds
    `kv_integrity` ("ok" or what is wrong): every page's refcount against its holders, a pass over the whole
    pool that holds the engine thread ~1 us a page (3.3 ms for 2,048 pages, 31 ms for 32,768 on the 2-core CI
    CPU; ~0.2 s for a GPU pool of 200K pages), so only a caller that asks for it pays (tests, scripts/dev/soak.py)."""
    stats = engine.stats()
    integrity = {}
    if check_integrity:
        try:
            engine.check_integrity()
            integrity["kv_integrity"] = "ok"
        except Exception as e:  # AssertionError from the checks, ValueError from the pool's own
            integrity["kv_integrity"] = f"{type(e).__name__}: {e}"
    return {
        "page_size": stats.page_size,
        "kv_total_pages": stats.num_total_pages,
        "kv_free_pages": stats.num_free_pages,
        "kv_cached_pages": stats.num_cached_pages,
        # held by requests in flight; pages only the prefix cache holds are reclaimable
        "kv_used_pages": stats.num_used_pages,
        "kv_usage": stats.kv_usage,
        "max_total_num_tokens": stats.max_total_num_tokens,
        "num_running_requests": stats.num_running,
        "num_waiting_requests": stats.num_waiting,
        "num_unfinished_requests": stats.num_unfinished_requests,
        **integrity,
    }


def _uses_cuda(state: ServerState) -> bool:
    device = getattr(getattr(state.engine.engine, "runner", None), "device", None)
    return getattr(device, "type", None) == "cuda"


def create_app(state: ServerState) -> FastAPI:
    config = state.server_config
    if config.enable_metrics and state.metrics is None:
        state.metrics = ServerMetrics(
            state.model_name, state.context_length, gpu=_uses_cuda(state), names=config.metrics_names
        )
        if state.tokenizers.prefix_cache is not None:
            state.metrics.watch_tokenizer_cache(state.tokenizers.prefix_cache)
    state.engine.configure_stats(state.metrics, config.log_stats_interval, config.step_log)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        state.engine.start(asyncio.get_running_loop())
        yield
        state.engine.close()  # stops the step thread, then the engine's tensor-parallel workers
        state.tokenizers.shutdown()

    app = FastAPI(title="longserve", version=__version__, lifespan=lifespan)
    app.state.longserve = state
    install_error_handlers(app)
    openapi.install(app)
    if state.metrics is not None:  # inside the API-key check: unauthenticated calls are not counted
        app.add_middleware(RejectedRequestsMiddleware, metrics=state.metrics)
    if state.server_config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.server_config.api_key)
    app.include_router(routes_generate.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_responses.router)
    app.include_router(routes_pooling.router)
    app.include_router(routes_admin.router)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request):
        engine = get_state(request).engine
        if engine.draining:  # a load balancer stops sending requests here
            return APIError(503, SHUTTING_DOWN, code="shutting_down").response()
        if not engine.is_alive:
            return APIError(503, "the engine is not running; see the server log").response()
        return {"status": "ok"}

    @app.get("/model_info")
    @app.get("/get_model_info", include_in_schema=False)
    async def model_info(request: Request):
        state = get_state(request)
        hf = state.engine.engine.hf_config
        return {
            "model_path": state.engine_config.model,
            "tokenizer_path": state.engine_config.tokenizer_path,
            "served_model_name": state.model_name,
            "is_generation": state.engine.engine.runner.pooler is None,  # False: an embedding model/reranker
            "architectures": list(getattr(hf, "architectures", None) or []),
            "vocab_size": getattr(hf, "vocab_size", None),
            "context_length": state.context_length,
        }

    @app.get("/server_info")
    @app.get("/get_server_info", include_in_schema=False)
    async def server_info(request: Request):
        state = get_state(request)
        server = dataclasses.asdict(state.server_config)
        server["api_key"] = "***" if server["api_key"] else None
        check = request.query_params.get("check_integrity", "").lower() in ("1", "true", "yes")
        # first: the counters below then include every command before
        kv = await state.engine.call(lambda engine: _kv_stats(engine, check))
        sched = state.engine.engine.scheduler.config
        return {
            "version": __version__,
            "uptime": time.time() - state.started,
            "engine_config": dataclasses.asdict(state.engine_config),
            "server_config": server,
            "context_length": state.context_length,
            "num_steps": state.engine.num_steps,
            "num_step_errors": state.engine.num_step_errors,
            "num_aborted_requests": state.engine.num_aborted,
            # weights (experts apart) and KV pool of one rank, and what fits: fixed at start-up
            "memory": state.engine.engine.runner.memory_plan,
            # a step's prompt tokens as the engine runs them, fixed once warm-up ran (a lone prompt's: None for
            # the usual ones; engine_config's lone None means the model's choice)
            "step_prompt_tokens": {"usual": sched.token_budget, "lone": sched.lone_prefill_chunk_size},
            **kv,
        }

    if state.metrics is not None:
        metrics = state.metrics

        @app.get("/metrics", include_in_schema=False)
        def prometheus_metrics() -> Response:  # sync: NVML reads run in the thread pool
            return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/flush_cache", methods=["GET", "POST"])  # SGLang takes both
    async def flush_cache(request: Request):
        state = get_state(request)
        flushed = await state.engine.call(lambda engine: engine.flush_cache())
        if state.tokenizers.prefix_cache is not None:  # so that a benchmark after a flush starts cold
            state.tokenizers.prefix_cache.clear()
        return {"message": "cache flushed", "flushed_pages": flushed}

    @app.post("/tokenize", openapi_extra=openapi.body(TokenizeRequest))
    async def tokenize(request: Request):
        state = get_state(request)
        req = await parse_body(request, TokenizeRequest)
        state.check_model(req.model)
        given = [x for x in (req.prompt, req.text, req.messages) if x is not None]
        if len(given) != 1:
            raise APIError(400, "give exactly one of 'prompt', 'text' and 'messages'", param="prompt")
        if req.messages is not None:
            messages = [m.as_dict(i) for i, m in enumerate(req.messages)]
            ids = await state.tokenizers.chat(messages, req.add_generation_prompt, use_cache=False)
        else:
            ids = await state.tokenizers.encode(given[0], req.add_special_tokens, use_cache=False)  # type: ignore[arg-type]
        return {"tokens": ids, "count": len(ids), "max_model_len": state.context_length}

    @app.post("/detokenize", openapi_extra=openapi.body(DetokenizeRequest))
    async def detokenize(request: Request):
        state = get_state(request)
        req = await parse_body(request, DetokenizeRequest)
        state.check_model(req.model)
        vocab = len(state.tokenizers.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: token ids must be in [0, {vocab}); got {bad[:5]}", param="tokens")
        text = await state.tokenizers.decode(req.tokens, req.skip_special_tokens)
        return JSONResponse({"prompt": text, "text": text})

    return app
