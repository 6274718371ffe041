"""The soak's traffic (scripts/dev/soak.py): one coroutine per request kind against a real server, each checking
its answer (the status, the shape, the error object) and returning a label, or raising Unexpected. The malformed
requests that bad_input sends are listed in soak_bad_requests.py."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from longserve.testing.soak_bad_requests import bad_requests, too_long_prompt
from longserve.testing.soak_checks import Unexpected, error_of, sse_events

_TEXT = (
    "return the value of a object if it is not none otherwise raise an error when called with this "
    "module function class method string list dict file path name data type default argument number "
    "first last new given each all any line text byte buffer stream socket thread lock event queue "
    "time date format encoding result iterator generator context manager attribute instance subclass "
    "exception warning test case"
)
WORDS = _TEXT.split()


class Traffic:
    """One coroutine per request kind; each checks its answer and returns a label ("200", "400", ...,
    "disconnect") or raises Unexpected."""

    # requests of each kind in every block of 95 (kind_sequence): mostly generation, 2% cut by the timeout
    KIND_WEIGHTS = {
        "generate": 10,
        "generate_ids": 10,
        "generate_stream": 10,
        "generate_batch": 4,
        "completion": 9,
        "completion_stream": 8,
        "chat": 9,
        "chat_stream": 8,
        "responses": 4,
        "disconnect_stream": 4,
        "disconnect_wait": 3,
        "timeout": 1,
        "timeout_stream": 1,
        "bad_input": 10,
        "utility": 4,
    }

    def __init__(self, session: aiohttp.ClientSession, url: str, info: dict, rng: random.Random) -> None:
        self.s = session
        self.url = url
        self.ctx = int(info["context_length"])
        self.vocab = int(info["vocab_size"])
        self.request_timeout = info.get("request_timeout")
        self.rng = rng
        # documents that many prompts start with: prefix-cache hits (radix tree and tokenizer cache)
        self.docs = [self.words(rng.randint(300, 900)) for _ in range(4)]
        self.doc_ids: list[list[int]] = []
        self._too_long: bytes | None = None
        # kind: its coroutine (the method of the same name), run KIND_WEIGHTS[kind] times per block
        self.kinds: dict[str, Callable[[], Awaitable[str]]] = {k: getattr(self, k) for k in self.KIND_WEIGHTS}
        if self.request_timeout is None:  # the server cuts no request: nothing would time out
            del self.kinds["timeout"], self.kinds["timeout_stream"]

    async def setup(self) -> None:
        for doc in self.docs:
            body = await self.post_json("/tokenize", {"prompt": doc})
            self.doc_ids.append(body["tokens"])

    # ---- helpers
    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def prompt_text(self) -> str:
        r = self.rng.random()
        if r < 0.25:  # a question over a shared document
            return self.rng.choice(self.docs) + "\n\nQuestion: " + self.words(self.rng.randint(3, 20))
        if r < 0.3:  # long and new
            return self.words(self.rng.randint(200, 600))
        return self.words(self.rng.randint(1, 60))

    def prompt_ids(self) -> list[int]:
        if self.rng.random() < 0.25 and self.doc_ids:
            return self.rng.choice(self.doc_ids) + [self.rng.randrange(2, self.vocab) for _ in range(8)]
        return [self.rng.randrange(2, self.vocab) for _ in range(self.rng.randint(1, 120))]

    def sampling(self, openai: bool = False) -> dict[str, Any]:
        rng = self.rng
        p: dict[str, Any] = {"temperature": rng.choice([0.0, 0.7, 1.0])}
        p["max_tokens" if openai else "max_new_tokens"] = rng.randint(1, 40)
        if rng.random() < 0.3:
            p["top_p"] = 0.9
        if rng.random() < 0.3:
            p["top_k"] = rng.choice([1, 20])
        if rng.random() < 0.15:
            p["min_p"] = 0.05
        if rng.random() < 0.2:
            p["repetition_penalty"] = 1.1
        if rng.random() < 0.15:
            p["frequency_penalty"] = 0.5
            p["presence_penalty"] = 0.3
        if rng.random() < 0.4:
            p["seed"] = rng.randrange(1 << 30)
        if rng.random() < 0.2:
            p["stop"] = rng.choice([".", "\n", ["the", "a "]])
        if rng.random() < 0.1:
            p["min_tokens" if openai else "min_new_tokens"] = 2
            p["max_tokens" if openai else "max_new_tokens"] += 2
        if rng.random() < 0.05:
            p["ignore_eos"] = True
        return p

    def messages(self) -> list[dict[str, str]]:
        msgs = []
        if self.rng.random() < 0.3:
            msgs.append({"role": "system", "content": self.words(self.rng.randint(3, 12))})
        turns = self.rng.randint(1, 3)
        for i in range(turns):
            first = i == 0 and self.rng.random() < 0.2
            msgs.append(
                {"role": "user", "content": (self.rng.choice(self.docs) if first else self.words(12))}
            )
            if i < turns - 1:
                msgs.append({"role": "assistant", "content": self.words(self.rng.randint(2, 20))})
        return msgs

    async def post(self, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, bytes]:
        data = raw if raw is not None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        async with self.s.post(self.url + path, data=data, headers=headers) as r:
            return r.status, await r.read()

    async def post_json(self, path: str, body: Any) -> Any:
        status, raw = await self.post(path, body)
        if status != 200:
            raise Unexpected(f"POST {path}: {status} {raw[:300]!r}")
        return json.loads(raw)

    @staticmethod
    def check(cond: bool, what: str, body: Any) -> None:
        if not cond:
            raise Unexpected(f"{what}: {json.dumps(body)[:300]}")

    def check_generate_result(self, r: dict, max_new: int) -> None:
        meta = r.get("meta_info", {})
        reason = (meta.get("finish_reason") or {}).get("type")
        self.check(isinstance(r.get("text"), str), "no text", r)
        self.check(reason in ("stop", "length"), "finish_reason", r)
        self.check(len(r.get("output_ids", [])) <= max_new, "more tokens than max_new_tokens", r)

    def check_choices(self, body: dict, n: int, chat: bool) -> None:
        choices = body.get("choices", [])
        self.check(len(choices) == n, f"{n} choices", body)
        for c in choices:
            self.check(c.get("finish_reason") in ("stop", "length"), "finish_reason", body)
            text = c["message"]["content"] if chat else c.get("text")
            self.check(isinstance(text, str), "no text", body)
        usage = body.get("usage", {})
        total = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
        self.check(usage.get("total_tokens") == total, "usage", body)

    async def stream(self, path: str, body: dict, keep: int | None = None) -> tuple[int, list[Any]]:
        """POST a streaming request; its status and events. keep=k: hang up after k events."""
        async with self.s.post(self.url + path, json=body) as r:
            if r.status != 200:
                return r.status, [json.loads(await r.read())]
            if keep is None:
                return 200, sse_events(await r.read())
            events: list[Any] = []
            async for line in r.content:
                if line.startswith(b"data: "):
                    events.append(line)
                    if len(events) >= keep:
                        break
            r.close()  # hang up with the request still generating
            return 200, events

    def check_stream(self, status: int, events: list[Any]) -> list[Any]:
        self.check(status == 200, f"status {status}", events)
        self.check(bool(events) and events[-1] == "[DONE]", "stream did not end with [DONE]", events[-3:])
        errors = [error_of(e) for e in events if error_of(e)]
        self.check(not errors, "error event in a stream", errors)
        return events[:-1]

    # ---- the kinds
    async def generate(self) -> str:
        params = self.sampling()
        body: dict[str, Any] = {"text": self.prompt_text(), "sampling_params": params}
        if self.rng.random() < 0.3:
            body["return_logprob"] = True
            body["top_logprobs_num"] = self.rng.choice([0, 3])
        r = await self.post_json("/generate", body)
        self.check_generate_result(r, params["max_new_tokens"])
        if body.get("return_logprob"):
            lps = r["meta_info"].get("output_token_logprobs", [])
            self.check(len(lps) == len(r["output_ids"]), "one logprob per token", r)
        return "200"

    async def generate_ids(self) -> str:
        params = self.sampling()
        r = await self.post_json("/generate", {"input_ids": self.prompt_ids(), "sampling_params": params})
        self.check_generate_result(r, params["max_new_tokens"])
        return "200"

    async def generate_stream(self) -> str:
        params = self.sampling()
        prompt: dict[str, Any] = (
            {"text": self.prompt_text()} if self.rng.random() < 0.6 else {"input_ids": self.prompt_ids()}
        )
        status, events = await self.stream("/generate", {**prompt, "sampling_params": params, "stream": True})
        events = self.check_stream(status, events)
        self.check(bool(events), "no events", events)
        self.check_generate_result(events[-1], params["max_new_tokens"])
        return "200"

    async def generate_batch(self) -> str:
        params = {**self.sampling(), "n": self.rng.choice([1, 2, 3])}
        prompts = [self.prompt_text() for _ in range(self.rng.randint(1, 3))]
        r = await self.post_json(
            "/generate", {"text": prompts, "sampling_params": params, "return_logprob": True}
        )
        self.check(isinstance(r, list) and len(r) == len(prompts) * params["n"], "batch size", r)
        for x in r:
            self.check_generate_result(x, params["max_new_tokens"])
        return "200"

    async def completion(self) -> str:
        n = self.rng.choice([1, 1, 2])
        body: dict[str, Any] = {"prompt": self.prompt_text(), "n": n, **self.sampling(openai=True)}
        if self.rng.random() < 0.5:
            body["logprobs"] = self.rng.choice([0, 2])
        if self.rng.random() < 0.2:
            body["prompt"] = self.prompt_ids()
        r = await self.post_json("/v1/completions", body)
        self.check_choices(r, n, chat=False)
        return "200"

    async def completion_stream(self) -> str:
        body = {"prompt": self.prompt_text(), "stream": True, "stream_options": {"include_usage": True}}
        body.update(self.sampling(openai=True))
        if self.rng.random() < 0.3:
            body["logprobs"] = 1
        events = self.check_stream(*await self.stream("/v1/completions", body))
        self.check(bool(events) and "usage" in events[-1], "no usage chunk", events[-2:])
        self.check(
            events[-1]["usage"]["completion_tokens"] <= body["max_tokens"], "too many tokens", events[-1]
        )
        return "200"

    async def chat(self) -> str:
        n = self.rng.choice([1, 1, 2])
        body: dict[str, Any] = {"messages": self.messages(), "n": n, **self.sampling(openai=True)}
        if self.rng.random() < 0.3:
            body["logprobs"] = True
            body["top_logprobs"] = 2
        r = await self.post_json("/v1/chat/completions", body)
        self.check_choices(r, n, chat=True)
        return "200"

    async def chat_stream(self) -> str:
        body = {"messages": self.messages(), "stream": True, **self.sampling(openai=True)}
        if self.rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        events = self.check_stream(*await self.stream("/v1/chat/completions", body))
        finishes = [c.get("finish_reason") for e in events for c in e.get("choices", [])]
        self.check(any(f in ("stop", "length") for f in finishes), "no finish_reason", events[-3:])
        return "200"

    async def responses(self) -> str:
        """/v1/responses, plain or streamed (its events numbered in order, ending with the final response)."""
        body: dict[str, Any] = {"input": self.messages(), **self.sampling(openai=True)}
        body["max_output_tokens"] = body.pop("max_tokens")
        for key in ("frequency_penalty", "presence_penalty", "min_tokens", "ignore_eos"):  # chat's, not its
            body.pop(key, None)
        if self.rng.random() < 0.5:
            status, events = await self.stream("/v1/responses", {**body, "stream": True})
            numbered = [e.get("sequence_number") for e in events if isinstance(e, dict)]
            self.check(status == 200 and numbered == list(range(len(events))), "events", events[-2:])
            self.check(events[-1]["type"] in ("response.completed", "response.incomplete"), "end", events[-1])
            final = events[-1]["response"]
        else:
            final = await self.post_json("/v1/responses", body)
        self.check(final["usage"]["output_tokens"] <= body["max_output_tokens"], "too many tokens", final)
        return "200"

    def long_body(self, path: str) -> dict[str, Any]:
        """A request that generates until the context is full (thousands of steps)."""
        prompt = self.words(self.rng.randint(1, 10))
        if path == "/generate":
            params = {"max_new_tokens": self.ctx - 64, "ignore_eos": True, "temperature": 1.0}
            return {"text": prompt, "sampling_params": params}
        if path == "/v1/completions":
            return {"prompt": prompt, "max_tokens": self.ctx - 64, "ignore_eos": True}
        return {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.ctx - 128,
            "ignore_eos": True,
        }

    async def disconnect_stream(self) -> str:
        path = self.rng.choice(["/generate", "/v1/completions", "/v1/chat/completions"])
        body = {**self.long_body(path), "stream": True}
        status, events = await self.stream(path, body, keep=self.rng.randint(1, 6))
        self.check(status == 200, f"status {status}", events)
        return "disconnect"

    async def disconnect_wait(self) -> str:
        path = self.rng.choice(["/generate", "/v1/completions", "/v1/chat/completions"])
        try:
            await asyncio.wait_for(self.post(path, self.long_body(path)), self.rng.uniform(0.02, 0.4))
        except TimeoutError:
            return "disconnect"  # the connection is closed under the waiting handler
        raise Unexpected(f"{path}: answered before the client hung up")

    async def timeout(self) -> str:
        path = self.rng.choice(["/generate", "/v1/completions", "/v1/chat/completions"])
        status, raw = await self.post(path, self.long_body(path))
        body = json.loads(raw)
        if status == 504:
            self.check(body["error"]["code"] == "timeout", "504 without the timeout code", body)
            return "504"
        raise Unexpected(f"{path}: {status} where the request timeout (504) was due: {raw[:200]!r}")

    async def timeout_stream(self) -> str:
        path = self.rng.choice(["/generate", "/v1/completions", "/v1/chat/completions"])
        status, events = await self.stream(path, {**self.long_body(path), "stream": True})
        self.check(status == 200 and events[-1:] == ["[DONE]"], f"status {status}", events[-2:])
        errors = [error_of(e) for e in events if error_of(e)]
        self.check(len(errors) == 1 and errors[0]["code"] == "timeout", "no timeout error event", events[-2:])
        return "timeout-event"

    def bad_cases(self) -> list[tuple[str, str, bytes, tuple[int, ...]]]:
        """(name, path, raw body, expected statuses): input a client got wrong (soak_bad_requests.py)."""
        if self._too_long is None:  # made once: a prompt of the context length's ids
            self._too_long = too_long_prompt(self.rng, self.ctx, self.vocab)
        return bad_requests(self.ctx, self.vocab, self._too_long)

    async def bad_input(self) -> str:
        name, path, raw, expected = self.rng.choice(self.bad_cases())
        status, body = await self.post(path, raw=raw)
        if status not in expected:
            raise Unexpected(f"{name} ({path}): {status} where {expected} was due: {body[:200]!r}")
        err = json.loads(body).get("error", {})
        self.check(isinstance(err.get("message"), str) and err["message"], "no error message", err)
        return str(status)

    async def utility(self) -> str:
        r = self.rng.random()
        if r < 0.4:
            body = await self.post_json("/tokenize", {"prompt": self.prompt_text()})
            self.check(body["count"] == len(body["tokens"]), "token count", body)
        elif r < 0.7:
            body = await self.post_json("/detokenize", {"tokens": self.prompt_ids()[:50]})
            self.check(isinstance(body.get("text"), str), "no text", body)
        else:
            path = "/v1/models" if r < 0.85 else "/metrics"
            async with self.s.get(self.url + path) as resp:
                raw = await resp.read()
                self.check(
                    resp.status == 200, f"GET {path}: {resp.status}", raw[:200].decode(errors="replace")
                )
        return "200"
