"""SGLang's native POST /generate: `text` or `input_ids` (one prompt or a batch), `sampling_params`,
`stream`, `return_logprob`, `rid`. One prompt with n=1 answers an object; a batch or n>1 a list
(prompt-major). Streams send the text so far (cumulative, like SGLang) as SSE events, then `data: [DONE]`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from longserve.outputs import CompletionOutput, RequestOutput
from longserve.server import openapi
from longserve.server.errors import APIError
from longserve.server.metrics import timings
from longserve.server.protocol import GenerateRequest, GenerateSampling, parse_body
from longserve.server.state import ServerState, get_state, sse

router = APIRouter()


def finish_reason(c: CompletionOutput) -> dict[str, Any] | None:
    if c.finish_reason is None:
        return None
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.stop_reason}
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids)}
    return {"type": c.finish_reason, "message": "the request was aborted"}


def _result(out: RequestOutput, c: CompletionOutput, want_logprobs: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": out.request_id,
        "finish_reason": finish_reason(c),
        "completion_tokens": len(c.token_ids),
        **timings(out),  # prompt/cached tokens and seconds: ttft, queue, prefill, decode, e2e
    }
    if want_logprobs and c.logprobs is not None:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.token_ids)]
        if c.top_logprobs:
            meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in top] for top in c.top_logprobs]
    return {"text": c.text, "output_ids": list(c.token_ids), "meta_info": meta}


async def _prompts(state: ServerState, req: GenerateRequest, deadline: float | None) -> list[list[int]]:
    if (req.text is None) == (req.input_ids is None):
        raise APIError(400, "give exactly one of 'text' and 'input_ids'", param="text")
    if req.text is not None:
        return await state.encode_prompts(req.text, "text", deadline)
    return await state.encode_prompts(req.input_ids, "input_ids", deadline)  # type: ignore[arg-type]


def _request_ids(req: GenerateRequest, num_prompts: int, batched: bool) -> list[str | None]:
    if req.rid is None:
        return [None] * num_prompts
    rids = [req.rid] if isinstance(req.rid, str) else req.rid
    if len(rids) != num_prompts or (isinstance(req.rid, str) and batched):
        raise APIError(400, f"rid must give one id per prompt ({num_prompts})", param="rid")
    return list(rids)


@router.post("/generate", openapi_extra=openapi.body(GenerateRequest))
async def generate(request: Request):
    state = get_state(request)
    req = await parse_body(request, GenerateRequest)
    sampling = req.sampling_params or GenerateSampling()
    if not 0 <= req.top_logprobs_num <= 20:
        raise APIError(400, "top_logprobs_num must be in [0, 20]", param="top_logprobs_num")
    params = sampling.to_params(req.top_logprobs_num if req.return_logprob else None)
    deadline = state.deadline(request)
    prompts = await _prompts(state, req, deadline)
    for p in prompts:
        state.check_lengths(len(p), params.max_new_tokens)
    batched = isinstance(req.text, list) or bool(req.input_ids and isinstance(req.input_ids[0], list))
    rids = await state.add_all(request, prompts, params, _request_ids(req, len(prompts), batched))
    single = not batched and params.n == 1

    if req.stream:

        async def events():
            for rid in rids:  # a batch streams its prompts one after the other
                done = [False] * params.n
                async for out in state.engine.stream(rid, deadline):
                    for c in out.outputs:
                        if not done[c.index] and (c.new_token_ids or c.new_text or c.finish_reason):
                            done[c.index] = c.finish_reason is not None
                            chunk = _result(out, c, req.return_logprob)
                            if not single:
                                chunk["index"] = rids.index(rid) * params.n + c.index
                            yield sse(chunk)
                    if out.finished:
                        state.log_request("/generate", [out])

        return state.stream_response(events(), rids)

    outs = await state.collect_all(request, rids, deadline)
    state.log_request("/generate", outs)
    results = [_result(out, c, req.return_logprob) for out in outs for c in out.outputs]
    return JSONResponse(results[0] if single else results)
