"""The real server process with a tiny model: the official openai client (chat, completions, streaming,
n=2, stop, logprobs, cached-token usage), SGLang's /generate with a body in SGLang's request shape (streamed
and not, greedy equal to the offline LLM), the admin endpoints, and a disconnect mid-stream freeing pages."""

from __future__ import annotations

import json
import time

import pytest

from tests.server.conftest import CONTEXT

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

SGLANG_BODY = {
    "text": "請用三句話說明什麼是 Prefill 階段。",
    "sampling_params": {"max_new_tokens": 256, "temperature": 0.7},
}
LONG_PROMPT = "The library opened at nine. Readers borrowed books about history and travel. " * 12


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model  # served under its path, like vLLM


def sse_events(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_chat_completion(oai, model, client):
    # the shared server's cache emptied: the chat template's opening is cached by any chat asked before (the
    # order of tests, e.g. under pytest-xdist's -n 2, decides which ran first)
    assert client.post("/flush_cache").status_code == 200
    r = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=12, temperature=0
    )
    assert r.object == "chat.completion" and len(r.choices) == 1
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_stream_matches_non_stream(oai, model):
    msgs = [{"role": "user", "content": "Tell me about the river"}]
    full = oai.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0)
    stream = oai.chat.completions.create(
        model=model,
        messages=msgs,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0


def test_completions_n2_seed_and_stream(oai, model):
    r = oai.completions.create(model=model, prompt="Weather reports said", max_tokens=8, n=2, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 16
    again = oai.completions.create(model=model, prompt="Weather reports said", max_tokens=8, n=2, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible
    stream = oai.completions.create(
        model=model, prompt="Weather reports said", max_tokens=8, n=2, stream=True
    )
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and all(texts.values())


def test_stop_string(oai, model):
    base = oai.completions.create(
        model=model, prompt="Children walked to school", max_tokens=24, temperature=0
    )
    text = base.choices[0].text
    stop = text[6:9]
    assert len(stop) == 3
    cut = oai.completions.create(
        model=model, prompt="Children walked to school", max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs(oai, model):
    r = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    c = oai.completions.create(model=model, prompt="hi", max_tokens=4, temperature=0, logprobs=3)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4 and all(len(t) <= 3 for t in lp.top_logprobs)


def test_usage_reports_cached_tokens(oai, model):
    first = oai.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    second = oai.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 64
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16


def test_models_endpoint(oai, model):
    assert [m.id for m in oai.models.list().data] == [model]


def test_generate_sglang_body(client):
    r = client.post("/generate", json=SGLANG_BODY)
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body["text"], str) and body["output_ids"]
    meta = body["meta_info"]
    assert meta["finish_reason"]["type"] in ("length", "stop")
    assert meta["completion_tokens"] == len(body["output_ids"]) <= 256
    for key in ("id", "prompt_tokens", "cached_tokens", "e2e_latency", "ttft", "queue_time"):
        assert key in meta


def test_generate_sglang_body_streamed(client):
    with client.stream("POST", "/generate", json={**SGLANG_BODY, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and len(events) > 2
    last = events[-2]
    assert last["meta_info"]["finish_reason"] is not None
    assert all(e["text"].startswith(events[0]["text"]) for e in events[1:-1])  # cumulative text


def test_generate_from_a_plain_requests_client(server):
    requests = pytest.importorskip("requests")
    resp = requests.post(f"{server.url}/generate", json=SGLANG_BODY)
    print(resp.json())
    assert resp.status_code == 200 and "text" in resp.json()


def test_generate_greedy_equals_offline(client, tiny_model):
    from longserve import LLM, SamplingParams

    prompt = "In the morning the river was quiet"
    r = client.post(
        "/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
    )
    llm = LLM(tiny_model, device="cpu", dtype="float32", max_total_tokens=1024)
    offline = llm.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0))[0]
    assert r.json()["output_ids"] == offline.token_ids
    assert r.json()["text"] == offline.text


def test_generate_batch_and_logprobs(client):
    r = client.post(
        "/generate",
        json={
            "text": ["one", "two"],
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True,
            "top_logprobs_num": 2,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body) == 2 and all(len(b["meta_info"]["output_token_logprobs"]) == 3 for b in body)
    ids = client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
    assert ids.status_code == 200 and ids.json()["meta_info"]["prompt_tokens"] == 3


def test_admin_endpoints(client, tiny_model):
    assert client.get("/health").json() == {"status": "ok"}
    info = client.get("/model_info").json()
    assert info["model_path"] == tiny_model and info["context_length"] == CONTEXT
    tok = client.post("/tokenize", json={"prompt": "hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 1
    text = client.post("/detokenize", json={"tokens": tok["tokens"], "skip_special_tokens": True}).json()
    assert text["prompt"] == "hello world"
    assert client.post("/flush_cache").status_code == 200
    stats = client.get("/server_info").json()
    assert stats["kv_free_pages"] == stats["kv_total_pages"] and stats["num_running_requests"] == 0
    # a float model keeps the usual steps for a lone prompt too (runner/step_tokens.py)
    usual = stats["engine_config"]["chunked_prefill_size"]
    assert stats["step_prompt_tokens"] == {"usual": usual, "lone": None}


def test_disconnect_mid_stream_frees_pages(client, server):
    import httpx

    body = {
        "text": LONG_PROMPT,
        "stream": True,
        "sampling_params": {"max_new_tokens": CONTEXT - 400, "temperature": 0, "ignore_eos": True},
    }
    aborted = client.get("/server_info").json()["num_aborted_requests"]
    with (
        httpx.Client(base_url=server.url, timeout=60) as other,
        other.stream("POST", "/generate", json=body) as r,
    ):
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen >= 3:
                break
        busy = client.get("/server_info").json()
        assert busy["num_running_requests"] == 1 and busy["kv_used_pages"] > 0
    closed = time.monotonic()  # leaving the block closed the connection mid-stream
    while time.monotonic() - closed < 10:
        stats = client.get("/server_info").json()
        if stats["num_unfinished_requests"] == 0:
            break
        time.sleep(0.05)
    assert stats["num_unfinished_requests"] == 0 and stats["num_running_requests"] == 0
    assert stats["kv_used_pages"] == 0  # the request's pages are back (free, or cached and evictable)
    assert client.post("/flush_cache").status_code == 200
    stats = client.get("/server_info").json()
    assert stats["kv_free_pages"] == stats["kv_total_pages"]
    assert stats["num_aborted_requests"] == aborted + 1  # aborted, not run to its end


def wait_idle(client, timeout: float = 10.0) -> dict:
    end = time.monotonic() + timeout
    while True:
        stats = client.get("/server_info").json()
        if stats["num_unfinished_requests"] == 0 or time.monotonic() > end:
            return stats
        time.sleep(0.05)


def test_disconnect_of_non_streaming_request_aborts_it(client, server):
    import httpx

    aborted = client.get("/server_info").json()["num_aborted_requests"]
    body = {"text": "hello", "sampling_params": {"max_new_tokens": CONTEXT - 100, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json=body, timeout=0.5)
    stats = wait_idle(client)
    assert stats["num_unfinished_requests"] == 0 and stats["kv_used_pages"] == 0
    assert stats["num_aborted_requests"] == aborted + 1


def test_concurrent_requests(oai, model, client):
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int):
        if i % 2:
            r = oai.completions.create(model=model, prompt=f"Request {i}: " + LONG_PROMPT, max_tokens=8)
            return r.usage.completion_tokens
        stream = oai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=8, stream=True
        )
        return sum(1 for c in stream if c.choices and c.choices[0].delta.content is not None)

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(24)))
    assert all(r >= 1 for r in results)
    stats = wait_idle(client)
    assert stats["num_unfinished_requests"] == 0 and stats["kv_used_pages"] == 0
