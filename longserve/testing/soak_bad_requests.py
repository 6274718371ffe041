"""The soak's malformed requests (Traffic.bad_input in longserve/testing/soak_traffic.py): input a client got
wrong, each with the statuses a server must answer it with (400, or 404 for an unknown model or route)."""

from __future__ import annotations

import json
import random
from typing import Any


def too_long_prompt(rng: random.Random, ctx: int, vocab: int) -> bytes:
    """A prompt of exactly the context length: no room for one new token."""
    return json.dumps({"input_ids": [rng.randrange(2, vocab) for _ in range(ctx)]}).encode()


def bad_requests(ctx: int, vocab: int, too_long: bytes) -> list[tuple[str, str, bytes, tuple[int, ...]]]:
    """(name, path, raw body, expected statuses) for a server of context length `ctx` and vocabulary `vocab`;
    `too_long` is too_long_prompt's body (the caller keeps one: its ids are random)."""

    def j(obj: Any) -> bytes:
        return json.dumps(obj).encode()

    msgs = [{"role": "user", "content": "hi"}]
    return [
        ("malformed json", "/v1/completions", b'{"prompt": "hi", ', (400,)),
        ("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', (400,)),
        ("lone surrogate", "/generate", b'{"text": "\\ud800"}', (400,)),
        ("body not an object", "/v1/chat/completions", b"[1, 2]", (400,)),
        ("empty body", "/generate", b"", (400,)),
        ("missing prompt", "/v1/completions", j({"max_tokens": 3}), (400,)),
        ("empty messages", "/v1/chat/completions", j({"messages": []}), (400,)),
        ("max_tokens as string", "/v1/completions", j({"prompt": "hi", "max_tokens": "10"}), (400,)),
        (
            "negative temperature",
            "/v1/chat/completions",
            j({"messages": msgs, "temperature": -1}),
            (400,),
        ),
        ("top_p over 1", "/v1/completions", j({"prompt": "hi", "top_p": 1.5}), (400,)),
        ("n = 0", "/v1/chat/completions", j({"messages": msgs, "n": 0}), (400,)),
        (
            "unknown sampling key",
            "/generate",
            j({"text": "a", "sampling_params": {"max_tokenz": 3}}),
            (400,),
        ),
        ("prompt ids over the context", "/generate", too_long, (400,)),
        (
            "prompt + max_tokens over",
            "/v1/completions",
            j({"prompt": [5, 6], "max_tokens": ctx}),
            (400,),
        ),
        ("token id out of range", "/generate", j({"input_ids": [3, vocab + 7]}), (400,)),
        ("negative token id", "/v1/completions", j({"prompt": [-1, 4]}), (400,)),
        ("unknown model", "/v1/chat/completions", j({"model": "gpt-17", "messages": msgs}), (404,)),
        (
            "top_logprobs without logprobs",
            "/v1/chat/completions",
            j({"messages": msgs, "top_logprobs": 2}),
            (400,),
        ),
        (
            "top_logprobs_num 50",
            "/generate",
            j({"text": "a", "return_logprob": True, "top_logprobs_num": 50}),
            (400,),
        ),
        ("both text and ids", "/generate", j({"text": "a", "input_ids": [3]}), (400,)),
        ("empty prompt list", "/v1/completions", j({"prompt": []}), (400,)),
        ("no such route", "/v1/nothing", j({}), (404,)),
        ("responses: input a number", "/v1/responses", j({"input": 3}), (400,)),
        (
            "responses: hosted tool",
            "/v1/responses",
            j({"input": "hi", "tools": [{"type": "web_search"}]}),
            (400,),
        ),
        (
            "responses: image input",
            "/v1/responses",
            j({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            (400,),
        ),
        (
            "responses: output over the context",
            "/v1/responses",
            j({"input": "hi", "max_output_tokens": ctx}),
            (400,),
        ),
        (
            "responses: unknown previous",
            "/v1/responses",
            j({"input": "hi", "previous_response_id": "resp_0"}),
            (404,),
        ),
    ]
