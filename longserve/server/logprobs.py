"""Logprobs in the shapes clients read them: a completion's own tokens (the chat shape, which the Responses API's
output_text logprobs share, and the completions shape), the prompt's tokens under OpenAI's completions `echo` (what
lm-evaluation-harness scores), vLLM's `prompt_logprobs` field, SGLang's `meta_info` tuples (what
`sglang.lang`'s `select` scores), and the request fields that ask for them.

Every token's text is decoded once per response (unique ids, one call on the tokenizer pool). A logprob of
-inf (a token the model cannot emit) is written as -9999.0, as vLLM writes it: JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from longserve.outputs import CompletionOutput, RequestOutput
from longserve.server.errors import APIError
from longserve.server.state import ServerState

MIN_LOGPROB = -9999.0


def finite(lp: float | None) -> float | None:
    return None if lp is None else max(lp, MIN_LOGPROB)


async def token_texts(state: ServerState, *groups: Iterable[int]) -> dict[int, str]:
    """Each distinct token id's own text (decoded alone, as vLLM and SGLang show it)."""
    ids = sorted({t for group in groups for t in group})
    return dict(zip(ids, await state.tokenizers.token_strings(ids))) if ids else {}


def _prompt_ids(out: RequestOutput) -> list[int]:
    return out.prompt_token_ids[out.prompt_logprob_start :]


def _top_ids(tops: Iterable[list[tuple[int, float]] | None] | None) -> list[int]:
    return [t for top in tops or () if top for t, _ in top]


# ---- vLLM / OpenAI ----------------------------------------------------------------------------------
async def completion_logprobs(
    state: ServerState, c: CompletionOutput, start: int, chat: bool
) -> dict[str, Any] | None:
    """Logprobs of tokens [start, ...) of a completion, in the chat shape (`content`: token, logprob, bytes,
    top_logprobs, as the Responses API's output_text logprobs too) or the completions one."""
    if c.logprobs is None:
        return None
    ids = c.token_ids[start:]
    lps = c.logprobs[start:]
    tops = (c.top_logprobs or [])[start:]
    top_ids = sorted({t for top in tops for t, _ in top})
    strings = await state.tokenizers.token_strings(ids + top_ids)
    text_of = dict(zip(ids + top_ids, strings))
    if chat:

        def entry(t: int, lp: float) -> dict[str, Any]:
            return {"token": text_of[t], "logprob": lp, "bytes": list(text_of[t].encode("utf-8"))}

        content = []
        for i, (t, lp) in enumerate(zip(ids, lps)):
            item = entry(t, lp)
            item["top_logprobs"] = [entry(tt, tlp) for tt, tlp in tops[i]] if i < len(tops) else []
            content.append(item)
        return {"content": content}
    offsets, pos = [], len(c.text) - sum(len(text_of[t]) for t in ids) if start else 0
    for t in ids:
        offsets.append(max(pos, 0))
        pos += len(text_of[t])
    return {
        "tokens": [text_of[t] for t in ids],
        "token_logprobs": lps,
        "top_logprobs": [{text_of[t]: lp for t, lp in top} for top in tops] if tops else None,
        "text_offset": offsets,
    }


async def vllm_prompt_logprobs(state: ServerState, out: RequestOutput) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for the prompt's own token and the top prompt_logprobs."""
    if out.prompt_logprobs is None:
        return None
    ids = _prompt_ids(out)
    tops = out.prompt_top_logprobs or [None] * len(ids)
    ranks = out.prompt_logprob_ranks or [None] * len(ids)
    text = await token_texts(state, ids, _top_ids(tops))
    entries: list[dict[str, Any] | None] = []
    for t, lp, top, rank in zip(ids, out.prompt_logprobs, tops, ranks):
        if lp is None:
            entries.append(None)
            continue
        entry = {str(t): {"logprob": finite(lp), "rank": rank, "decoded_token": text[t]}}
        for r, (tt, v) in enumerate(top or (), start=1):
            entry.setdefault(str(tt), {"logprob": finite(v), "rank": r, "decoded_token": text[tt]})
        entries.append(entry)
    return entries


async def echo_logprobs(
    state: ServerState, out: RequestOutput, completion: dict[str, Any] | None
) -> dict[str, Any] | None:
    """OpenAI completions logprobs of `echo`: the prompt's tokens (the first one's logprob null; each
    position's top_logprobs has its own token and the top k) followed by the completion's (`completion`,
    as the route formats it). text_offset counts the token strings from 0 on, as vLLM does (a special token's
    string, e.g. the BOS, counts though the echoed prompt text lacks it)."""
    if out.prompt_logprobs is None:
        return completion
    ids = _prompt_ids(out)
    tops = out.prompt_top_logprobs or [None] * len(ids)
    text = await token_texts(state, ids, _top_ids(tops))
    tokens = [text[t] for t in ids]
    token_logprobs = [finite(lp) for lp in out.prompt_logprobs]
    top_logprobs: list[dict[str, float] | None] = [
        None if lp is None else {text[t]: finite(lp)} | {text[tt]: finite(v) for tt, v in top or ()}
        for t, lp, top in zip(ids, out.prompt_logprobs, tops)
    ]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    if completion is not None:
        tokens += completion["tokens"]
        token_logprobs += completion["token_logprobs"]
        top_logprobs += completion["top_logprobs"] or [None] * len(completion["tokens"])
        offsets += [pos + o for o in completion["text_offset"]]  # running on, as vLLM counts them
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


async def echo_texts(state: ServerState, prompt: Any, prompts: list[list[int]]) -> list[str]:
    """The text `echo` puts before each completion: the prompt as sent, or its token ids decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], str):
        return list(prompt)
    return [await state.tokenizers.decode(ids) for ids in prompts]


def check_best_of(best_of: int | None, n: int, stream: bool, max_n: int) -> None:
    if best_of is None:
        return
    if not isinstance(best_of, int) or best_of < n:
        raise APIError(400, f"best_of must be an integer >= n ({n}), got {best_of!r}", param="best_of")
    if best_of > max_n:
        raise APIError(400, f"best_of must be at most {max_n}, got {best_of}", param="best_of")
    if stream and best_of > n:
        raise APIError(
            400, "best_of > n cannot stream: the best completions are known at the end", param="best_of"
        )


# ---- SGLang -------------------------------------------------------------------------------------------
async def sglang_logprob_meta(
    state: ServerState, out: RequestOutput, c: CompletionOutput, top_n: int, with_text: bool
) -> dict[str, Any]:
    """meta_info's input_token_logprobs / output_token_logprobs as [logprob, token id, text or None] (the
    first input entry's logprob null), and with top_logprobs_num the input/output_top_logprobs lists."""
    meta: dict[str, Any] = {}
    in_ids = _prompt_ids(out) if out.prompt_logprobs is not None else []
    in_tops = out.prompt_top_logprobs or []
    out_tops = c.top_logprobs or []
    text: dict[int, str] = {}
    if with_text:
        text = await token_texts(state, in_ids, c.token_ids, _top_ids(in_tops), _top_ids(out_tops))

    def triple(lp: float | None, t: int) -> list[Any]:
        return [finite(lp), t, text.get(t)]

    if out.prompt_logprobs is not None:
        meta["input_token_logprobs"] = [triple(lp, t) for lp, t in zip(out.prompt_logprobs, in_ids)]
    if c.logprobs is not None:
        meta["output_token_logprobs"] = [triple(lp, t) for lp, t in zip(c.logprobs, c.token_ids)]
    if top_n > 0:
        if out.prompt_logprobs is not None:
            meta["input_top_logprobs"] = [
                None if top is None else [triple(v, t) for t, v in top] for top in in_tops
            ]
        meta["output_top_logprobs"] = [[triple(v, t) for t, v in top] for top in out_tops]
    return meta


async def with_echo(
    state: ServerState,
    choice: dict[str, Any],
    out: RequestOutput,
    echo_text: str | None,
    want_logprobs: bool,
    stream: bool = False,
) -> None:
    """A completions choice (or a stream's first chunk of it) with `echo`: the prompt's text and, when
    logprobs were asked, its tokens' logprobs before the completion's; and vLLM's prompt_logprobs field."""
    if echo_text is not None:
        choice["text"] = echo_text + choice["text"]
        if want_logprobs:
            choice["logprobs"] = await echo_logprobs(state, out, choice["logprobs"])
    if not stream and out.prompt_logprobs is not None:
        choice["prompt_logprobs"] = await vllm_prompt_logprobs(state, out)


def check_prompt_logprobs_stream(prompt_logprobs: int | None, stream: bool) -> None:
    if stream and prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs are not available when stream is true", param="prompt_logprobs")
