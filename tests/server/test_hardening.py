"""No request can hurt another, and a shutdown loses nothing accepted (real server processes): a poisoned
seed fails alone while 30 streams finish; chat_template_kwargs cannot run a client's template; a huge prompt
is refused by its size; a burst within the running slots is all admitted; SIGTERM drains; forged request ids
stay on one log line; a disconnect mid-upload is no traceback; a taken port fails before the model loads."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.server.conftest import REPO, ServerProcess

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

CHAT = "/v1/chat/completions"
SHORT = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
# minutes on the CPU: never done in time
LONG = {"max_new_tokens": 8000, "temperature": 0, "ignore_eos": True}
LOOP_TEMPLATE = "{% for a in range(100000) %}{% for b in range(100000) %}{{ a }}{% endfor %}{% endfor %}"


def events(text: str) -> list:
    return [
        line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


async def stream_generate(client: httpx.AsyncClient, body: dict) -> tuple[int, list]:
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        text = (await r.aread()).decode()
    return r.status_code, events(text)


def test_a_poisoned_seed_fails_alone_while_30_streams_finish(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            body = {"input_ids": [5, 6, 7, 8], "sampling_params": {**SHORT, "max_new_tokens": 24}}
            streams = [asyncio.ensure_future(stream_generate(client, body)) for _ in range(30)]
            await asyncio.sleep(0.2)  # the streams are running
            poisoned = await client.post(
                "/generate", json={"input_ids": [5, 6], "sampling_params": {"seed": 2**64, "temperature": 1}}
            )
            results = await asyncio.gather(*streams)
            # the largest seed still works, for n siblings too (seed + i wraps within 64 bits)
            top = await client.post(
                "/v1/completions", json={"prompt": [5, 6], "seed": 2**63 - 1, "n": 2, "max_tokens": 3}
            )
            return poisoned, results, top

    poisoned, results, top = asyncio.run(main())
    assert poisoned.status_code == 400, poisoned.text
    err = poisoned.json()["error"]
    assert err["param"] == "seed" and "64-bit" in err["message"]
    for status, evs in results:
        assert status == 200 and evs[-1] == "[DONE]", evs[-2:]
        assert evs[-2]["meta_info"]["completion_tokens"] == 24
    assert top.status_code == 200 and len(top.json()["choices"]) == 2
    info = httpx.get(server.url + "/server_info").json()
    assert info["num_step_errors"] == 0 and info["num_unfinished_requests"] == 0


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"chat_template": LOOP_TEMPLATE}, ["'chat_template'", "argument"]),
        ({"add_generation_prompt": False}, ["'add_generation_prompt'", "field"]),
        ({"tokenize": False}, ["'tokenize'"]),
        ({"return_dict": True}, ["'return_dict'"]),
        ({"__class__": 1}, ["variable names"]),
    ],
)
def test_chat_template_kwargs_take_only_template_variables(client, kwargs, words):
    t0 = time.monotonic()
    r = client.post(
        CHAT,
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "chat_template_kwargs": kwargs,
        },
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template_kwargs"
    for word in words:
        assert word in err["message"], err["message"]
    assert time.monotonic() - t0 < 5  # refused, never rendered


def test_template_variables_still_reach_the_template(client):
    r = client.post(
        CHAT,
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "chat_template_kwargs": {"enable_thinking": False, "custom": {"a": [1, 2]}},
        },
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", CHAT])
def test_a_10_mb_prompt_is_refused_by_its_size(client, route):
    text = "word " * (2 * 2**20)  # 10 MiB
    body = {
        "/generate": {"text": text},
        "/v1/completions": {"prompt": text},
        CHAT: {"messages": [{"role": "user", "content": text}]},
    }[route]
    t0 = time.monotonic()
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text[:300]
    assert "characters" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 5  # refused before any tokenizing (12 s of it)
    assert client.get("/health").status_code == 200


def test_forged_request_ids_stay_on_one_log_line(client, server):
    rid = "forged\r\n2026-01-01 00:00:00,000 INFO longserve.server: FAKE ENTRY\x1b[2J"
    r = client.post(
        "/generate", json={"input_ids": [5, 6], "rid": rid, "sampling_params": {"max_new_tokens": 2}}
    )
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == rid
    end = time.monotonic() + 5
    while "FAKE ENTRY" not in server.log() and time.monotonic() < end:
        time.sleep(0.05)
    lines = [line for line in server.log().splitlines() if "FAKE ENTRY" in line]
    assert len(lines) == 1 and lines[0].split(" INFO ")[1].startswith(
        "longserve.server: /generate forged\\r\\n"
    )
    assert "\x1b" not in lines[0] and "\\x1b[2J" in lines[0]


def test_a_disconnect_mid_upload_is_not_a_traceback(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100000\r\n\r\n{"prompt": "'
        )
        time.sleep(0.3)
    time.sleep(0.5)
    assert httpx.get(server.url + "/health").status_code == 200
    assert "Traceback" not in server.log() and "ClientDisconnect" not in server.log()


def test_head_health_and_openapi_request_bodies(client):
    assert client.head("/health").status_code == 200
    schema = client.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, item in schema["paths"].items():
        if "post" not in item or path == "/flush_cache":
            continue
        body = item["post"].get("requestBody")
        assert body is not None, path
        ref = body["content"]["application/json"]["schema"]["$ref"]
        assert ref.rsplit("/", 1)[1] in components, (path, ref)
    assert "sampling_params" in components["GenerateRequest"]["properties"]
    assert "messages" in components["ChatCompletionRequest"]["properties"]
    assert {"/generate", "/v1/completions", CHAT, "/tokenize"} <= set(schema["paths"])


def test_a_taken_port_fails_before_the_model_loads(tiny_model, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "longserve.launch_server", "--model-path", tiny_model, "--device", "cpu"]
            + ["--port", str(port)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 2, proc.stderr
    assert f"127.0.0.1:{port}" in proc.stderr and "--port" in proc.stderr
    assert "Loading weights" not in proc.stderr and "serving" not in proc.stderr
    assert time.monotonic() - t0 < 60


# ---- admission and shutdown: one server with a queue limit of 64 (the last test stops it) --------------


@pytest.fixture(scope="module")
def limited(tiny_model, tmp_path_factory):
    args = ["--model-path", tiny_model, "--device", "cpu", "--dtype", "float32"]
    args += ["--max-total-tokens", "65536", "--context-length", "8192", "--max-queued-requests", "64"]
    args += ["--shutdown-timeout", "8"]  # the short requests' 100 tokens take 0.2-2 s, the long ones minutes
    proc = ServerProcess(args, str(tmp_path_factory.mktemp("logs") / "limited.log"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_a_burst_of_200_within_256_slots_is_all_served(limited):
    async def main():
        limits = httpx.Limits(max_connections=250)
        async with httpx.AsyncClient(base_url=limited.url, timeout=300, limits=limits) as client:
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
            return await asyncio.gather(*(client.post("/generate", json=body) for _ in range(200)))

    statuses = [r.status_code for r in asyncio.run(main())]
    assert statuses.count(200) == 200, {s: statuses.count(s) for s in set(statuses)}


def test_sigterm_drains_then_exits_0(limited):
    """SIGTERM: /health and new requests get 503 at once; short requests in flight finish; long ones get a
    JSON error (non-streamed) or an error event and [DONE] (streamed) after --shutdown-timeout; the pages
    come back; exit code 0."""

    async def main():
        async with httpx.AsyncClient(base_url=limited.url, timeout=120) as client:
            long_body = {"input_ids": [9, 10, 11], "sampling_params": LONG}
            long_plain = asyncio.ensure_future(client.post("/generate", json=long_body))
            long_stream = asyncio.ensure_future(stream_generate(client, long_body))
            short_body = {"input_ids": [5, 6, 7], "sampling_params": {**SHORT, "max_new_tokens": 100}}
            short = [asyncio.ensure_future(client.post("/generate", json=short_body)) for _ in range(3)]
            while (await client.get("/server_info")).json()["num_unfinished_requests"] < 5:
                await asyncio.sleep(0.01)  # all five are in flight
            limited.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            health = await client.get("/health")
            refused = await client.post("/generate", json={"input_ids": [5], "sampling_params": SHORT})
            return health, refused, await asyncio.gather(*short), await long_plain, await long_stream

    health, refused, short, long_plain, (stream_status, stream_events) = asyncio.run(main())
    assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    for r in short:
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 100
    assert long_plain.status_code == 503
    assert "--shutdown-timeout" in long_plain.json()["error"]["message"]
    assert stream_status == 200 and stream_events[-1] == "[DONE]"
    assert "--shutdown-timeout" in stream_events[-2]["error"]["message"]
    assert limited.proc.wait(30) == 0
    log = limited.log()
    assert "SIGTERM: shutting down; the 5 requests in flight" in log and "ended 2 unfinished requests" in log
    assert "every KV page is back in the pool" in log
    assert "Traceback" not in log
