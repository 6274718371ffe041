"""Bad input of every kind gets a 4xx with OpenAI's error object and a clear message; the server stays
healthy and answers a valid request afterwards."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import CONTEXT

pytest.importorskip("fastapi")

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
TOO_LONG = "hello world " * CONTEXT  # about 2 * CONTEXT tokens


def j(obj) -> bytes:
    return json.dumps(obj).encode()


# (name, method, path, raw body, expected status, words the message must contain)
CASES = [
    ("malformed json", "POST", COMPL, b'{"prompt": "hi", ', 400, ["malformed json"]),
    ("invalid utf-8", "POST", COMPL, b'{"prompt": "\xff\xfe"}', 400, ["utf-8"]),
    ("lone surrogate", "POST", "/generate", b'{"text": "\\ud800"}', 400, ["json"]),
    ("body not an object", "POST", COMPL, b"[1, 2]", 400, ["json object"]),
    ("empty body", "POST", CHAT, b"", 400, ["empty"]),
    ("missing prompt", "POST", COMPL, j({"max_tokens": 3}), 400, ["prompt"]),
    ("missing messages", "POST", CHAT, j({"max_tokens": 3}), 400, ["messages"]),
    ("empty messages", "POST", CHAT, j({"messages": []}), 400, ["messages"]),
    ("negative max_tokens", "POST", COMPL, j({"prompt": "hi", "max_tokens": -1}), 400, ["max_tokens"]),
    (
        "huge max_tokens",
        "POST",
        COMPL,
        j({"prompt": "hi", "max_tokens": 10**9}),
        400,
        ["maximum context length is 8192 tokens", "context_length_exceeded"],
    ),
    ("max_tokens as string", "POST", COMPL, j({"prompt": "hi", "max_tokens": "10"}), 400, ["max_tokens"]),
    ("max_tokens as float", "POST", CHAT, j({"messages": MSGS, "max_tokens": 2.5}), 400, ["max_tokens"]),
    ("negative temperature", "POST", CHAT, j({"messages": MSGS, "temperature": -0.5}), 400, ["temperature"]),
    ("top_p over 1", "POST", COMPL, j({"prompt": "hi", "top_p": 1.5}), 400, ["top_p"]),
    ("n = 0", "POST", CHAT, j({"messages": MSGS, "n": 0}), 400, ["n must"]),
    ("n huge", "POST", "/generate", j({"text": "a", "sampling_params": {"n": 100000}}), 400, ["at most"]),
    (
        "prompt over the context",
        "POST",
        COMPL,
        j({"prompt": TOO_LONG, "max_tokens": 1}),
        400,
        ["8192", "tokens"],
    ),
    ("unknown model", "POST", CHAT, j({"model": "gpt-17", "messages": MSGS}), 404, ["gpt-17"]),
    ("bad role", "POST", CHAT, j({"messages": [{"role": "wizard", "content": "x"}]}), 400, ["role"]),
    (
        "content not a string",
        "POST",
        CHAT,
        j({"messages": [{"role": "user", "content": 5}]}),
        400,
        ["content"],
    ),
    ("stop not a string", "POST", COMPL, j({"prompt": "hi", "stop": 5}), 400, ["stop"]),
    (
        "presence_penalty out of range",
        "POST",
        COMPL,
        j({"prompt": "hi", "presence_penalty": 5}),
        400,
        ["presence"],
    ),
    ("logprobs too many", "POST", COMPL, j({"prompt": "hi", "logprobs": 50}), 400, ["logprobs"]),
    (
        "top_logprobs without logprobs",
        "POST",
        CHAT,
        j({"messages": MSGS, "top_logprobs": 2}),
        400,
        ["logprobs"],
    ),
    ("stream not a bool", "POST", COMPL, j({"prompt": "hi", "stream": "yes"}), 400, ["stream"]),
    ("seed not an int", "POST", COMPL, j({"prompt": "hi", "seed": "abc"}), 400, ["seed"]),
    (
        "min_tokens over max",
        "POST",
        COMPL,
        j({"prompt": "hi", "max_tokens": 2, "min_tokens": 5}),
        400,
        ["min"],
    ),
    ("tools", "POST", CHAT, j({"messages": MSGS, "tools": [{"type": "function"}]}), 400, ["tools"]),
    ("empty prompt list", "POST", COMPL, j({"prompt": []}), 400, ["prompt"]),
    ("token ids not ints", "POST", COMPL, j({"prompt": [1, "a"]}), 400, ["prompt"]),
    ("generate without prompt", "POST", "/generate", j({"sampling_params": {}}), 400, ["text", "input_ids"]),
    ("generate text and ids", "POST", "/generate", j({"text": "a", "input_ids": [1]}), 400, ["exactly one"]),
    ("generate ids out of vocab", "POST", "/generate", j({"input_ids": [5, 999999]}), 400, ["999999"]),
    ("generate negative id", "POST", "/generate", j({"input_ids": [-3]}), 400, ["-3"]),
    (
        "generate unknown param",
        "POST",
        "/generate",
        j({"text": "a", "sampling_params": {"max_tokens": 3}}),
        400,
        ["max_tokens"],
    ),
    (
        "generate params not an object",
        "POST",
        "/generate",
        j({"text": "a", "sampling_params": "x"}),
        400,
        ["sampling_params"],
    ),
    ("generate empty text list", "POST", "/generate", j({"text": []}), 400, ["empty"]),
    (
        "generate top_k fraction",
        "POST",
        "/generate",
        j({"text": "a", "sampling_params": {"top_k": 0.5}}),
        400,
        ["top_k"],
    ),
    ("generate rid list mismatch", "POST", "/generate", j({"text": ["a", "b"], "rid": ["x"]}), 400, ["rid"]),
    (
        "generate over the context",
        "POST",
        "/generate",
        j({"input_ids": [5] * (CONTEXT + 1)}),
        400,
        ["8193", "8192"],
    ),
    ("detokenize negative", "POST", "/detokenize", j({"tokens": [-1]}), 400, ["tokens"]),
    # an empty prompt gets the same answer on every route, however it is spelled
    ("generate empty text", "POST", "/generate", j({"text": ""}), 400, ["prompt is empty"]),
    ("generate empty ids", "POST", "/generate", j({"input_ids": []}), 400, ["prompt is empty"]),
    ("generate empty id batch", "POST", "/generate", j({"input_ids": [[5], []]}), 400, ["prompt is empty"]),
    ("completions empty prompt", "POST", COMPL, j({"prompt": ""}), 400, ["prompt is empty"]),
    ("completions empty in batch", "POST", COMPL, j({"prompt": ["a", ""]}), 400, ["prompt is empty"]),
    ("completions empty ids", "POST", COMPL, j({"prompt": [[]]}), 400, ["prompt is empty"]),
    # "" and [""] alike
    ("stop empty string", "POST", COMPL, j({"prompt": "a", "stop": ""}), 400, ["stop", "non-empty"]),
    ("stop empty in list", "POST", COMPL, j({"prompt": "a", "stop": [""]}), 400, ["stop", "non-empty"]),
    (
        "generate stop empty",
        "POST",
        "/generate",
        j({"text": "a", "sampling_params": {"stop": ""}}),
        400,
        ["stop", "non-empty"],
    ),
    (
        "user without content",
        "POST",
        CHAT,
        j({"messages": [{"role": "user"}]}),
        400,
        ["messages[0]", "content"],
    ),
    (
        "system content null",
        "POST",
        CHAT,
        j({"messages": [{"role": "system", "content": None}, *MSGS]}),
        400,
        ["messages[0]", "'system'"],
    ),
    ("seed past 64 bits", "POST", COMPL, j({"prompt": "a", "seed": 2**64}), 400, ["seed", "64-bit"]),
    (
        "seed below int64",
        "POST",
        "/generate",
        j({"text": "a", "sampling_params": {"seed": -(2**63) - 1}}),
        400,
        ["seed"],
    ),
    (
        "stop token past vocab",
        "POST",
        COMPL,
        j({"prompt": "a", "stop_token_ids": [10**6]}),
        400,
        ["stop_token_ids"],
    ),
    (
        "stop token past int64",
        "POST",
        COMPL,
        j({"prompt": "a", "stop_token_ids": [2**70]}),
        400,
        ["stop_token_ids"],
    ),
    ("tokenize nothing", "POST", "/tokenize", j({}), 400, ["prompt"]),
    ("unknown route", "POST", "/v1/audio/speech", j({"input": "x"}), 404, ["/v1/audio/speech"]),
    ("embeddings of a generative model", "POST", "/v1/embeddings", j({"input": "x"}), 400, ["pooling model"]),
    ("wrong method", "GET", CHAT, b"", 405, ["not allowed"]),
]


@pytest.mark.parametrize("name,method,path,body,status,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input(client, name, method, path, body, status, words):
    r = client.request(method, path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, (name, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for word in words:
        assert word.lower() in err["message"].lower(), (name, err["message"])


def test_stream_errors_before_streaming_are_plain_http_errors(client):
    r = client.post(COMPL, json={"prompt": TOO_LONG, "stream": True})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]


def test_healthy_after_bad_inputs(client):
    assert len(CASES) >= 25
    assert client.get("/health").status_code == 200
    r = client.post(CHAT, json={"messages": MSGS, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    stats = client.get("/server_info").json()
    assert stats["num_step_errors"] == 0 and stats["num_unfinished_requests"] == 0
