"""Rank 0's last stage of a pooling step: the pooled rows (models/pooler.py, one per request whose prompt
ended in this step) become each request's embedding or score, as its PoolingParams ask, in a RunnerOutput
whose token ids are placeholders (a pooling request samples nothing: the engine ends it at once).

An embedding keeps its first `dimensions` components (Matryoshka), then is L2-normalized, as vLLM and
sentence-transformers do; a score is the relevance logit (models.pooler.score_logit) through the sigmoid."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from longserve.models.pooler import PoolerSpec, classifier_token_ids, score_logit
from longserve.outputs import RunnerOutput
from longserve.pooling_params import PoolingParams
from longserve.request import Request
from longserve.sampling_params import SamplingParams

logger = logging.getLogger("longserve.runner")
_DEFAULT = PoolingParams()
# what a pooling request runs as: a prefill whose one sample is dropped (max_new_tokens=0)
POOLING_SAMPLING = SamplingParams(max_new_tokens=0, temperature=0.0)


def bind_tokenizer(runner: Any, tokenizer: Any) -> None:
    """A reranker that scores with vocabulary tokens (classifier_from_token) learns their ids (rank 0)."""
    spec: PoolerSpec | None = runner.pooler
    if spec is None or not spec.classifier_tokens:
        return
    if tokenizer is None:
        raise ValueError(f"classifier_from_token {list(spec.classifier_tokens)} needs the model's tokenizer")
    runner.model.classifier_ids = classifier_token_ids(tokenizer, spec.classifier_tokens)
    logger.info(
        "reranker: scores with tokens %s (ids %s)", list(spec.classifier_tokens), runner.model.classifier_ids
    )


def check_pooling(
    runner: Any, params: SamplingParams | PoolingParams
) -> tuple[PoolingParams | None, SamplingParams]:
    """(the pooling params or None, the sampling params the request runs with); ValueError when the request
    does not fit the model: generation from a pooling model, or an embedding from a generative one."""
    spec: PoolerSpec | None = runner.pooler
    if isinstance(params, PoolingParams):
        if spec is None:
            raise ValueError(
                "this model generates text: embeddings and scores need a pooling model "
                "(an embedding model or a reranker, or --runner pooling)"
            )
        dims, hidden = params.dimensions, runner.model.hidden_size
        if dims is not None and spec.task == "embed" and dims > hidden:
            raise ValueError(f"dimensions must be at most the model's {hidden}; got {dims}")
        return params, POOLING_SAMPLING
    if spec is not None:
        what = "an embedding model" if spec.task == "embed" else "a reranker (scores)"
        raise ValueError(
            f"this server runs {what} (a pooling model): it does not generate text; use "
            + ("/v1/embeddings" if spec.task == "embed" else "/v1/rerank or /v1/score")
        )
    return None, params


def pooled_output(spec: PoolerSpec, values: torch.Tensor, reqs: list[Request]) -> RunnerOutput:
    """values [N, D] float32 (the model's `pool` of the N requests' last rows) -> one result per request.
    A request whose own post-processing fails ends alone with an error (`failed`)."""
    values = values.detach().float().cpu()
    pooled: list[list[float] | float | None] = []
    failed: dict[str, str] = {}
    logits = score_logit(values) if spec.task == "classify" else None
    for i, req in enumerate(reqs):
        params = req.pooling_params or _DEFAULT
        try:
            if logits is not None:
                logit = logits[i]
                pooled.append(float(torch.sigmoid(logit) if params.activation else logit))
                continue
            vec = values[i]
            if params.dimensions is not None:
                vec = vec[: params.dimensions]
            if params.normalize:
                vec = F.normalize(vec, p=2.0, dim=0)
            pooled.append(vec.tolist())
        except Exception as e:
            logger.error("request %s failed while pooling", req.request_id, exc_info=e)
            failed[req.request_id] = (
                f"internal error while pooling request {req.request_id}; see the server log"
            )
            pooled.append(None)
    return RunnerOutput(sampled_token_ids=[0] * len(reqs), pooled=pooled, failed=failed)
