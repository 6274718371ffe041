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
from longserve.server.grammars import constraint_fields
from longserve.server.logprobs import sglang_logprob_meta
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


async def _result(
    state: ServerState, out: RequestOutput, c: CompletionOutput, req: GenerateRequest
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": out.request_id,
        "finish_reason": finish_reason(c),
        "completion_tokens": len(c.token_ids),
        **timings(out),  # prompt/cached tokens and seconds: ttft, queue, prefill, decode, e2e
    }
    if req.return_logprob:  # input_/output_token_logprobs, input_/output_top_logprobs
        meta.update(
            await sglang_logprob_meta(state, out, c, req.top_logprobs_num, req.return_text_in_logprobs)
        )
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
    if req.top_logprobs_num < 0:
        raise APIError(400, "top_logprobs_num must be >= 0", param="top_logprobs_num")
    if req.custom_logit_processor is not None:
        raise APIError(
            400,
            "custom_logit_processor is not supported: longserve runs no client code",
            param="custom_logit_processor",
        )
    # return_logprob: the output's logprobs and the prompt's from logprob_start_len, with top_n each
    top_n = req.top_logprobs_num if req.return_logprob else None
    params = sampling.to_params(top_n, prompt_logprobs=top_n, logprob_start_len=req.logprob_start_len)
    state.check_logprobs(params, {"logprobs": "top_logprobs_num", "prompt_logprobs": "top_logprobs_num"})
    deadline = state.deadline(request)
    # SGLang's json_schema, regex, ebnf, structural_tag
    grammar = await state.grammars.compile_fields(constraint_fields(sampling), deadline)
    prompts = await _prompts(state, req, deadline)
    for p in prompts:
        state.check_lengths(len(p), params.max_new_tokens)
    batched = isinstance(req.text, list) or bool(req.input_ids and isinstance(req.input_ids[0], list))
    rids = await state.add_all(request, prompts, params, _request_ids(req, len(prompts), batched), grammar)
    single = not batched and params.n == 1

    if req.stream:

        async def events():
            interval = sampling.stream_interval or 1  # an event every `interval` tokens, and the last
            for rid in rids:  # a batch streams its prompts one after the other
                done = [False] * params.n
                sent = [0] * params.n  # tokens when the last event went out
                async for out in state.engine.stream(rid, deadline):
                    for c in out.outputs:
                        due = len(c.token_ids) - sent[c.index] >= interval or c.finish_reason is not None
                        if not done[c.index] and due and (c.new_token_ids or c.new_text or c.finish_reason):
                            done[c.index] = c.finish_reason is not None
                            sent[c.index] = len(c.token_ids)
                            chunk = await _result(state, out, c, req)
                            if not single:
                                chunk["index"] = rids.index(rid) * params.n + c.index
                            yield sse(chunk)
                    if out.finished:
                        state.log_request("/generate", [out])

        return state.stream_response(events(), rids)

    outs = await state.collect_all(request, rids, deadline)
    state.log_request("/generate", outs)
    results = [await _result(state, out, c, req) for out in outs for c in out.outputs]
    return JSONResponse(results[0] if single else results)
