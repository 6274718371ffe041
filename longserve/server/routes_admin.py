"""SGLang's and vLLM's small endpoints: GET /v1/models/{id}, /version, /health_generate (a real one-token
generation), /ping (SageMaker's health check, vLLM), POST /abort_request (SGLang: end a /generate request by
its `rid`, or every request). /flush_cache (GET and POST) and /health live in app.py."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ConfigDict

from longserve import __version__
from longserve.pooling_params import PoolingParams
from longserve.sampling_params import SamplingParams
from longserve.server import openapi
from longserve.server.async_engine import SHUTTING_DOWN
from longserve.server.errors import APIError
from longserve.server.protocol import _Schema, parse_body
from longserve.server.state import DEFAULT_MODEL, ServerState, get_state

router = APIRouter()
HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's: a step that does not answer in this long is unhealthy


def model_card(state: ServerState, name: str) -> dict[str, Any]:
    """One entry of GET /v1/models."""
    return {
        "id": name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "longserve",
        "root": state.engine_config.model,
        "max_model_len": state.context_length,
    }


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str):
    state = get_state(request)
    if model_id == DEFAULT_MODEL:
        return model_card(state, state.model_name)
    if model_id not in state.model_names:
        raise APIError(
            404,
            f"the model {model_id!r} does not exist; this server serves "
            f"{', '.join(map(repr, state.model_names))}",
            param="model",
            code="model_not_found",
        )
    return model_card(state, model_id)


@router.get("/version")
async def version():
    return {"version": __version__}


@router.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)  # a probe, no body
async def ping(request: Request):
    engine = get_state(request).engine
    if engine.draining:
        return APIError(503, SHUTTING_DOWN, code="shutting_down").response()
    if not engine.is_alive:
        return APIError(503, "the engine is not running; see the server log").response()
    return {"status": "ok"}


@router.get("/health_generate")
async def health_generate(request: Request):
    """200 once a one-token request went through the engine (a pooling model: one pooled prompt), 503 if
    it failed or took longer than HEALTH_GENERATE_TIMEOUT_S (the engine is stuck or dead)."""
    state = get_state(request)
    engine = state.engine
    if engine.draining:
        return APIError(503, SHUTTING_DOWN, code="shutting_down").response()
    tokenizer = state.tokenizers.tokenizer
    token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0
    pooling = engine.engine.runner.pooler is not None
    params = PoolingParams() if pooling else SamplingParams(max_new_tokens=1, temperature=0.0)
    rid = f"health-generate-{uuid.uuid4().hex}"
    start = time.monotonic()
    try:
        await engine.add([token], params, rid)
        out = await state.collect(rid, time.monotonic() + HEALTH_GENERATE_TIMEOUT_S)
    except Exception as e:  # refused (busy, shutting down), timed out, or the step failed
        message = e.message if isinstance(e, APIError) else type(e).__name__
        return APIError(503, f"health check generation failed: {message}").response()
    finally:
        engine.release(rid)  # a no-op once it finished
    if out.error or (not pooling and len(out.token_ids) != 1):
        return APIError(503, f"health check generation failed: {out.error or out.finish_reason}").response()
    return {"status": "ok", "latency": time.monotonic() - start}


class AbortRequest(_Schema):
    model_config = ConfigDict(strict=True, extra="forbid")
    rid: str | list[str] | None = None
    abort_all: bool = False


@router.post("/abort_request", openapi_extra=openapi.body(AbortRequest))
async def abort_request(request: Request):
    """SGLang's: end the request with this `rid` (a /generate request's), or every request (abort_all); its
    caller gets what it generated so far with finish_reason "abort". An unknown rid is not an error (the
    request may have just finished), as in SGLang."""
    state = get_state(request)
    req = await parse_body(request, AbortRequest)
    if req.abort_all:
        rids = state.engine.inflight_ids()
    elif req.rid:
        rids = [req.rid] if isinstance(req.rid, str) else list(req.rid)
    else:
        raise APIError(400, "give the 'rid' of the request to abort, or abort_all: true", param="rid")
    for rid in rids:
        state.engine.abort(rid)
    return Response(status_code=200)
