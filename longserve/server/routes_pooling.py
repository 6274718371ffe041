"""The RAG side: POST /v1/embeddings (OpenAI's shape), /encode (SGLang's), /v1/rerank, /rerank and
/v2/rerank (Cohere's and Jina's shape, as vLLM serves them) and /v1/score, /score (vLLM's), on a pooling
model (models/pooler.py).

Every input is one engine request: a prefill whose last position yields an embedding or a relevance score,
chunked and over the prefix cache like any prompt. A rerank call's documents share its query's prompt pages
(pooling.encode_pair puts the query first; the documents wait for the first one's pages, PoolingParams.
prefix_group). An embedding model scores a pair by the cosine similarity of the two embeddings.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field

from longserve.models.pooler import PoolerSpec
from longserve.outputs import RequestOutput
from longserve.pooling import cosine, pair_up, shared_prefix_len
from longserve.pooling_params import PoolingParams
from longserve.server import openapi
from longserve.server.errors import APIError
from longserve.server.protocol import _Schema, parse_body
from longserve.server.state import EMPTY_PROMPT, ServerState, context_length_error, get_state

router = APIRouter()
MAX_INPUTS = 2048  # inputs (or documents) of one call; OpenAI's embeddings limit


class _PoolingSchema(_Schema):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    user: str | None = None  # accepted without effect, as on OpenAI's routes


class EmbeddingRequest(_PoolingSchema):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka models only
    normalize: bool | None = None  # vLLM's extra; default: the model's (sentence-transformers Normalize)


class EncodeRequest(_Schema):
    """SGLang's native embedding request (POST /encode)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None


class RerankDocument(_Schema):
    model_config = ConfigDict(strict=True, extra="forbid")
    text: str


class RerankRequest(_PoolingSchema):
    query: str
    documents: list[str | RerankDocument] = Field(min_length=1)
    top_n: int | None = None  # None or 0: every document
    return_documents: bool = True


class ScoreRequest(_PoolingSchema):
    # vLLM's text_1/text_2, or their newer names queries/documents
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None


def _pooler(state: ServerState, route: str) -> PoolerSpec:
    spec = state.engine.engine.runner.pooler
    if spec is None:
        raise APIError(
            400,
            f"{route} needs a pooling model (an embedding model or a reranker); this server's model generates "
            "text. Serve one with --runner pooling (SGLang: --is-embedding)",
        )
    return spec


def _check_size(n: int, param: str) -> None:
    if n > MAX_INPUTS:
        raise APIError(400, f"{param} has {n} items; at most {MAX_INPUTS} are taken in one call", param=param)


async def _run(
    request: Request, state: ServerState, route: str, prompts: list[list[int]], params: PoolingParams
) -> list[RequestOutput]:
    """Each prompt as a pooling request; their final outputs, in order (any error is the call's)."""
    for p in prompts:
        if len(p) > state.context_length:
            raise context_length_error(state.context_length, len(p), None, "input")
    deadline = state.deadline(request)
    rids = await state.add_all(request, prompts, params, [None] * len(prompts))
    outs = await state.collect_all(request, rids, deadline)
    state.log_request(route, outs)
    for out in outs:
        if out.pooled is None:  # aborted (a client that left is not answered)
            raise APIError(500, f"request {out.request_id} ended without a result ({out.finish_reason})")
    return outs


def _usage(outs: list[RequestOutput]) -> dict[str, Any]:
    tokens = sum(o.prompt_tokens for o in outs)
    cached = sum(o.cached_tokens for o in outs)
    return {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def _embed(
    request: Request, state: ServerState, route: str, texts: list[str], params: PoolingParams
) -> list[RequestOutput]:
    deadline = state.deadline(request)
    prompts = [await state.tokenizers.encode(t, deadline=deadline, param="input") for t in texts]
    return await _run(request, state, route, prompts, params)


@router.post("/v1/embeddings", openapi_extra=openapi.body(EmbeddingRequest))
async def embeddings(request: Request):
    state = get_state(request)
    req = await parse_body(request, EmbeddingRequest)
    state.check_model(req.model)
    spec = _pooler(state, "/v1/embeddings")
    if spec.task != "embed":
        raise APIError(400, "this server runs a reranker: /v1/embeddings needs an embedding model")
    dims = req.dimensions
    if dims is not None:
        if dims < 1:
            raise APIError(400, f"dimensions must be >= 1, got {dims}", param="dimensions")
        if not spec.matryoshka:  # vLLM's words
            raise APIError(
                400,
                "Model does not support matryoshka representation, changing output dimensions will lead to "
                "poor results.",
                param="dimensions",
            )
        if isinstance(spec.matryoshka, tuple) and dims not in spec.matryoshka:
            raise APIError(
                400,
                f"Model only supports {list(spec.matryoshka)} matryoshka dimensions, use other output "
                "dimensions will lead to poor results.",
                param="dimensions",
            )
    params = PoolingParams(
        dimensions=dims, normalize=spec.normalize if req.normalize is None else req.normalize
    )
    deadline = state.deadline(request)
    inputs = req.input
    if isinstance(inputs, list) and inputs and not isinstance(inputs[0], int):
        _check_size(len(inputs), "input")
    prompts = await state.encode_prompts(inputs, "input", deadline)
    outs = await _run(request, state, "/v1/embeddings", prompts, params)
    data = []
    for i, out in enumerate(outs):
        vector: Any = out.pooled
        if req.encoding_format == "base64":  # little-endian float32, as OpenAI's client decodes it
            vector = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
        data.append({"object": "embedding", "index": i, "embedding": vector})
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": req.model or state.model_name,
        "data": data,
        "usage": _usage(outs),
    }


@router.post("/encode", openapi_extra=openapi.body(EncodeRequest))
async def encode(request: Request):
    """SGLang's: one prompt answers {"embedding", "meta_info"}, a batch a list of them."""
    state = get_state(request)
    req = await parse_body(request, EncodeRequest)
    spec = _pooler(state, "/encode")
    if spec.task != "embed":
        raise APIError(400, "this server runs a reranker: /encode needs an embedding model")
    if (req.text is None) == (req.input_ids is None):
        raise APIError(400, "give exactly one of 'text' and 'input_ids'", param="text")
    given = req.text if req.text is not None else req.input_ids
    param = "text" if req.text is not None else "input_ids"
    single = isinstance(given, str) or bool(given and isinstance(given[0], int))
    prompts = await state.encode_prompts(given, param, state.deadline(request))  # type: ignore[arg-type]
    _check_size(len(prompts), param)
    outs = await _run(request, state, "/encode", prompts, PoolingParams(normalize=spec.normalize))
    results = [
        {
            "embedding": o.pooled,
            "meta_info": {
                "id": o.request_id,
                "prompt_tokens": o.prompt_tokens,
                "cached_tokens": o.cached_tokens,
            },
        }
        for o in outs
    ]
    return results[0] if single else results


async def _score_pairs(
    request: Request, state: ServerState, route: str, pairs: list[tuple[str, str]]
) -> tuple[list[float], list[RequestOutput]]:
    """Relevance of each (query, document) pair: a reranker's score, or an embedding model's cosine."""
    spec = _pooler(state, route)
    _check_size(len(pairs), "documents")
    for a, b in pairs:
        if not a or not b:
            raise APIError(400, EMPTY_PROMPT, param="documents" if a else "query")
    if spec.task == "embed":
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        outs = await _embed(request, state, route, texts, PoolingParams(normalize=True))
        emb = {t: o.pooled for t, o in zip(texts, outs)}
        return [cosine(emb[a], emb[b]) for a, b in pairs], outs
    deadline = state.deadline(request)
    prompts = await asyncio.gather(*(state.tokenizers.encode_pair(a, b, deadline) for a, b in pairs))
    params = PoolingParams()
    config = state.engine_config
    share = config.enable_prefix_caching and len(prompts) > 1
    if share and shared_prefix_len(prompts) >= config.page_size:  # the query's pages: computed once
        params = PoolingParams(prefix_group=f"score-{uuid.uuid4().hex}")
    outs = await _run(request, state, route, list(prompts), params)
    return [float(o.pooled) for o in outs], outs


@router.post("/v1/rerank", openapi_extra=openapi.body(RerankRequest))
@router.post("/rerank", include_in_schema=False)
@router.post("/v2/rerank", include_in_schema=False)
async def rerank(request: Request):
    state = get_state(request)
    req = await parse_body(request, RerankRequest)
    state.check_model(req.model)
    if req.top_n is not None and req.top_n < 0:
        raise APIError(400, f"top_n must be >= 0, got {req.top_n}", param="top_n")
    docs = [d if isinstance(d, str) else d.text for d in req.documents]
    scores, outs = await _score_pairs(request, state, request.url.path, [(req.query, d) for d in docs])
    order = sorted(range(len(docs)), key=lambda i: -scores[i])
    if req.top_n:
        order = order[: req.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": docs[i]}
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": req.model or state.model_name,
        "usage": _usage(outs),
        "results": results,
    }


@router.post("/v1/score", openapi_extra=openapi.body(ScoreRequest))
@router.post("/score", include_in_schema=False)
async def score(request: Request):
    state = get_state(request)
    req = await parse_body(request, ScoreRequest)
    state.check_model(req.model)
    sides = []
    for names, values in (
        (("text_1", "queries"), (req.text_1, req.queries)),
        (("text_2", "documents"), (req.text_2, req.documents)),
    ):
        given = [v for v in values if v is not None]
        if len(given) != 1:
            raise APIError(400, f"give exactly one of {names[0]!r} and {names[1]!r}", param=names[0])
        sides.append([given[0]] if isinstance(given[0], str) else list(given[0]))
    try:
        pairs = pair_up(sides[0], sides[1])
    except ValueError as e:
        raise APIError(400, str(e), param="text_2") from None
    scores, outs = await _score_pairs(request, state, request.url.path, pairs)
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": req.model or state.model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": _usage(outs),
    }
