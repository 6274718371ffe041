"""One streamed request per backend, timed on the client: SGLang's /generate (longserve, sglang) takes token
ids and streams cumulative meta_info; the OpenAI completions/chat endpoints (vllm, openai) take text and end
with a usage chunk. Each call returns a RequestResult; HTTP and stream errors become failed results."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from longserve.bench.workloads import BenchRequest

BACKENDS = ("longserve", "sglang", "vllm", "openai")
GENERATE_BACKENDS = ("longserve", "sglang")


# a record's times to 1 us: perf_counter's digits below that are noise, and they made each random workload's
# results.json 270 KB under xz against 75 KB at 1 us (benchmarks/results/ shares the device's 64 MiB copy with the
# vLLM anchor; twenty-second session). The summaries are computed before, from the unrounded times.
TIME_DIGITS = 6


@dataclass(slots=True)
class RequestResult:
    """Client-side timings (seconds, perf_counter) and the server's own token counts where it reports them."""

    prompt_len: int  # planned (tokenized on the client)
    output_len: int  # requested
    success: bool = False
    error: str | None = None
    start: float = 0.0  # since the benchmark began
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    prompt_tokens: int | None = None  # as counted by the server
    output_tokens: int = 0
    cached_tokens: int | None = None
    server_ttft: float | None = None  # meta_info.ttft (longserve)
    group: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The record's row: every field, times rounded to TIME_DIGITS."""
        row = {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]
        for key in ("start", "ttft", "latency", "server_ttft"):
            if row[key] is not None:
                row[key] = round(row[key], TIME_DIGITS)
        row["itl"] = [round(gap, TIME_DIGITS) for gap in self.itl]
        return row


def request_body(
    backend: str, endpoint: str, req: BenchRequest, model: str | None, ignore_eos: bool = True
) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one streamed greedy request that should generate exactly req.output_len tokens."""
    if backend in GENERATE_BACKENDS:
        body: dict[str, Any] = {
            "sampling_params": {
                "max_new_tokens": req.output_len,
                "temperature": 0.0,
                "ignore_eos": ignore_eos,
            },
            "stream": True,
        }
        if req.input_ids is not None:
            body["input_ids"] = req.input_ids
        else:
            body["text"] = req.text
        return "/generate", body
    body = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if backend != "openai":  # vLLM's extra; api.openai.com refuses unknown fields
        body["ignore_eos"] = ignore_eos
    prompt: Any = req.text if req.text is not None else req.input_ids
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


class _Stream:
    """Parses the SSE data lines of one response and stamps each chunk that carries new tokens."""

    def __init__(self, backend: str, endpoint: str, result: RequestResult, t0: float) -> None:
        self.generate = backend in GENERATE_BACKENDS
        self.chat = endpoint == "chat"
        self.result = result
        self.t0 = t0
        self.last: float | None = None
        self.chunks = 0

    def feed(self, data: dict[str, Any], now: float) -> None:
        r = self.result
        if "error" in data:
            err = data["error"]
            raise RuntimeError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        if self.generate:
            meta = data.get("meta_info") or {}
            done = int(meta.get("completion_tokens") or len(data.get("output_ids") or []))
            new = done > r.output_tokens or (done == 0 and bool(data.get("text")))
            r.output_tokens = max(done, r.output_tokens)
            r.prompt_tokens = meta.get("prompt_tokens", r.prompt_tokens)
            r.cached_tokens = meta.get("cached_tokens", r.cached_tokens)
            r.server_ttft = meta.get("ttft", r.server_ttft)
        else:
            usage = data.get("usage")
            if usage:
                r.prompt_tokens = usage.get("prompt_tokens")
                r.output_tokens = usage.get("completion_tokens") or r.output_tokens
                details = usage.get("prompt_tokens_details") or {}
                r.cached_tokens = details.get("cached_tokens", r.cached_tokens)
            new = False
            for choice in data.get("choices") or []:
                if self.chat:
                    delta = choice.get("delta") or {}
                    new = new or bool(delta.get("content")) or "role" not in delta
                else:
                    new = True
        if not new:
            return
        self.chunks += 1
        if r.ttft is None:
            r.ttft = now - self.t0
        elif self.last is not None:
            r.itl.append(now - self.last)
        self.last = now


async def _sse_data(content: Any):
    """The payloads of an SSE stream's `data:` lines up to `[DONE]` (lines of any length)."""
    buffer = b""
    async for chunk in content.iter_any():
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            yield payload


async def send(
    session: Any,
    base_url: str,
    backend: str,
    endpoint: str,
    req: BenchRequest,
    model: str | None,
    t_start: float,
    headers: dict[str, str],
) -> RequestResult:
    """Send one request on an aiohttp session and time it; never raises for server or network errors."""
    import aiohttp

    path, body = request_body(backend, endpoint, req, model)
    result = RequestResult(req.prompt_len, req.output_len, group=req.group)
    t0 = time.perf_counter()
    result.start = t0 - t_start
    stream = _Stream(backend, endpoint, result, t0)
    try:
        async with session.post(base_url + path, json=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                raise RuntimeError(f"HTTP {resp.status}: {text}")
            async for payload in _sse_data(resp.content):
                stream.feed(json.loads(payload), time.perf_counter())
        result.latency = time.perf_counter() - t0
        if result.ttft is None:
            raise RuntimeError("the stream ended without a token")
        if not result.output_tokens:
            result.output_tokens = stream.chunks  # no usage in the stream: one token per chunk
        result.success = True
    except (aiohttp.ClientError, RuntimeError, ValueError, TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}" if not isinstance(e, RuntimeError) else str(e)
    return result
