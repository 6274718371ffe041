"""GET /metrics against a real server process (page size 4, a 5 s --request-timeout): counters move by
exactly what scripted requests imply (a shared 3-page prefix, tokens sent and generated, an aborted and a
timed-out request, rejections), histogram counts equal finished requests, the exposition parses with
prometheus_client's parser, responses carry their own timings, and the stats log line appears without
prompt text. In-process: --disable-metrics, two apps side by side, the NVML gauges with a fake NVML, and
the Grafana dashboard querying only metrics that exist."""

from __future__ import annotations

import random
import sys
import time
import types

import pytest

from tests.server.conftest import CONTEXT, ServerProcess

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

PAGE = 4
TIMEOUT = 5.0  # generous: on a busy 2-core machine a short request must never reach it
SECRET = "ZebraQuokkaMarmalade"  # a prompt marker that must never reach the log
LONG = {"max_new_tokens": CONTEXT - 400, "temperature": 0, "ignore_eos": True}

HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
)
COUNTERS = (
    "prompt_tokens",
    "generation_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "request_finished",
    "short_first_steps",
    "tokenizer_prefix_cache_hits",
    "tokenizer_prefix_cache_misses",
    "tokenizer_prefix_cache_reused_tokens",
)
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate")


@pytest.fixture(scope="module")
def mserver(tiny_model, tmp_path_factory):
    args = ["--model-path", tiny_model, "--device", "cpu", "--dtype", "float32"]
    args += [
        "--max-total-tokens",
        str(4 * CONTEXT),
        "--context-length",
        str(CONTEXT),
        "--page-size",
        str(PAGE),
    ]
    args += ["--request-timeout", str(TIMEOUT), "--log-stats-interval", "0.2", "--log-requests"]
    args += ["--strict-model-name"]  # an unknown model name is refused (404) and counted as rejected
    proc = ServerProcess(args, str(tmp_path_factory.mktemp("logs") / "metrics-server.log"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture
def mclient(mserver):
    with httpx.Client(base_url=mserver.url, timeout=60.0) as c:
        yield c


def scrape(client) -> dict[str, float]:
    """Samples keyed `name{label=value,...}` (labels sorted, model_name left out)."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def value(samples: dict[str, float], name: str, **labels: str) -> float:
    key = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return samples.get(f"longserve:{name}{{{key}}}", 0.0)


def delta(before, after, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def finished(samples, reason: str) -> float:
    return value(samples, "request_finished_total", finished_reason=reason)


def wait_for(client, cond, timeout: float = 10.0) -> dict[str, float]:
    end = time.monotonic() + timeout
    while True:
        samples = scrape(client)
        if cond(samples) or time.monotonic() > end:
            return samples
        time.sleep(0.05)


def test_exposition_parses_with_every_family_labelled(mclient, tiny_model):
    r = mclient.get("/metrics")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in HISTOGRAMS:
        assert families[f"longserve:{name}"].type == "histogram", name
    for name in COUNTERS:
        assert families[f"longserve:{name}"].type == "counter", name
    for name in GAUGES:
        assert families[f"longserve:{name}"].type == "gauge", name
    assert not any("gpu" in name for name in families)  # no NVML here: absent, not zero
    for family in families.values():
        assert family.name.startswith("longserve:")
        for s in family.samples:
            assert s.labels["model_name"] == tiny_model, s


def test_shared_prefix_and_token_counters_move_exactly(mclient):
    assert mclient.post("/flush_cache").status_code == 200
    rng = random.Random(5)
    ids = rng.sample(range(4, 512), 3 * PAGE + 3)
    prefix, a, b = ids[: 3 * PAGE], ids[3 * PAGE : 3 * PAGE + 1], ids[3 * PAGE + 1 :]
    sampling = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    before = scrape(mclient)
    first = mclient.post("/generate", json={"input_ids": prefix + a, "sampling_params": sampling}).json()
    second = mclient.post("/generate", json={"input_ids": prefix + b, "sampling_params": sampling}).json()
    after = scrape(mclient)

    sent = len(prefix + a) + len(prefix + b)
    assert delta(before, after, "prefix_cache_queries_total") == sent
    assert delta(before, after, "prefix_cache_hits_total") == 3 * PAGE  # exactly the shared pages
    assert delta(before, after, "prompt_tokens_total") == sent
    assert delta(before, after, "generation_tokens_total") == 8
    assert delta(before, after, "prefill_tokens_computed_total") == sent - 3 * PAGE
    assert finished(after, "length") - finished(before, "length") == 2
    for name in HISTOGRAMS:
        if name != "inter_token_latency_seconds":
            assert delta(before, after, name + "_count") == 2, name
    assert delta(before, after, "inter_token_latency_seconds_count") == 2 * 3  # 3 gaps per 4 tokens
    assert delta(before, after, "request_prompt_tokens_sum") == sent
    assert value(after, "prefix_cache_hit_rate") > 0
    assert value(after, "num_requests_running") == 0 and value(after, "num_requests_waiting") == 0

    # each response carries its own numbers
    assert first["meta_info"]["cached_tokens"] == 0 and second["meta_info"]["cached_tokens"] == 3 * PAGE
    for meta in (first["meta_info"], second["meta_info"]):
        for key in ("ttft", "queue_time", "prefill_time", "decode_time", "e2e_latency"):
            assert isinstance(meta[key], float) and meta[key] >= 0, key
        assert meta["ttft"] <= meta["e2e_latency"]

    # the OpenAI routes too: an extra meta_info per choice, the standard cached_tokens in usage
    r = mclient.post("/v1/completions", json={"prompt": prefix + b, "max_tokens": 2, "temperature": 0}).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * PAGE
    meta = r["choices"][0]["meta_info"]
    assert meta["cached_tokens"] == 3 * PAGE and meta["prefill_time"] >= 0 and meta["ttft"] > 0


def test_tokenizer_prefix_cache_counters(mclient):
    """A conversation's second turn re-uses the first turn's tokens: one more hit, its tokens counted."""
    rng = random.Random(9)
    words = ["the", "a", "cat", "sat", "on", "mat", "12345", ",", ".", "!", "hello", "world"]
    first = " ".join(rng.choice(words) for _ in range(900))  # long enough for the cache (>= 2048 chars)
    second = first + " and then " + " ".join(rng.choice(words) for _ in range(40))
    before = scrape(mclient)
    for prompt in (first, second):
        r = mclient.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
    after = scrape(mclient)
    assert delta(before, after, "tokenizer_prefix_cache_misses_total") == 1
    assert delta(before, after, "tokenizer_prefix_cache_hits_total") == 1
    assert delta(before, after, "tokenizer_prefix_cache_reused_tokens_total") > 100
    # /tokenize neither uses nor fills it (a benchmark counting its prompts first must not warm it) ...
    third = second + " more"
    assert mclient.post("/tokenize", json={"prompt": third}).status_code == 200
    # ... and a flush empties it: the next turn is tokenized whole again (a miss, not a hit)
    assert mclient.post("/flush_cache").status_code == 200
    assert mclient.post("/v1/completions", json={"prompt": third, "max_tokens": 1}).status_code == 200
    last = scrape(mclient)
    assert delta(after, last, "tokenizer_prefix_cache_misses_total") == 1
    assert delta(after, last, "tokenizer_prefix_cache_hits_total") == 0


def test_abort_timeout_and_rejections_counted_by_reason(mclient, mserver):
    before = scrape(mclient)
    # a client that hangs up mid-stream
    body = {"text": "The river was quiet", "stream": True, "sampling_params": LONG}
    with (
        httpx.Client(base_url=mserver.url, timeout=60) as other,
        other.stream("POST", "/generate", json=body) as r,
    ):
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events >= 3:
                break
    aborted = wait_for(mclient, lambda s: finished(s, "abort") > finished(before, "abort"))
    assert finished(aborted, "abort") - finished(before, "abort") == 1
    assert finished(aborted, "timeout") == finished(before, "timeout")

    # a request that outlives --request-timeout
    r = mclient.post("/generate", json={"text": "Weather reports said", "sampling_params": LONG})
    assert r.status_code == 504
    timed_out = wait_for(mclient, lambda s: finished(s, "timeout") > finished(before, "timeout"))

    # refused before running: an unknown model (404), a prompt longer than the context (400), a Responses
    # request with a hosted tool (400)
    assert mclient.post("/v1/completions", json={"model": "nope", "prompt": "hi"}).status_code == 404
    too_long = {"input_ids": [5] * (CONTEXT + 1)}
    assert mclient.post("/generate", json=too_long).status_code == 400
    hosted = {"input": "hi", "tools": [{"type": "web_search"}]}
    assert mclient.post("/v1/responses", json=hosted).status_code == 400
    after = scrape(mclient)

    assert finished(after, "timeout") - finished(before, "timeout") == 1
    assert finished(after, "abort") - finished(before, "abort") == 1
    assert finished(after, "rejected") - finished(before, "rejected") == 3
    for reason in ("stop", "length", "error"):
        assert finished(after, reason) == finished(before, reason), reason
    # the two that ran both produced tokens before they ended: every request histogram saw both
    for name in HISTOGRAMS:
        if name != "inter_token_latency_seconds":
            assert delta(before, after, name + "_count") == 2, name
    assert delta(before, after, "e2e_request_latency_seconds_sum") >= TIMEOUT * 0.9
    # the generated-token counter saw every token of both, however far each got
    generated = delta(before, after, "generation_tokens_total")
    assert generated >= 3 and generated == delta(before, after, "request_generation_tokens_sum")
    assert value(timed_out, "num_requests_running") == 0 and value(after, "kv_cache_usage_perc") == 0


def test_stats_log_line_and_no_prompt_in_logs(mclient, mserver):
    body = {"text": f"{SECRET} opened the library", "sampling_params": {"max_new_tokens": 8}}
    assert mclient.post("/generate", json=body).status_code == 200
    end = time.monotonic() + 5
    while "engine: prefill" not in mserver.log() and time.monotonic() < end:
        time.sleep(0.1)
    log = mserver.log()
    line = next(line for line in log.splitlines() if "engine: prefill" in line)
    for words in ("tok/s", "decode", "running", "queued", "KV usage", "prefix cache hit rate"):
        assert words in line, words
    assert "/generate" in log  # --log-requests is on ...
    assert SECRET not in log  # ... and still no prompt text


# ---- in-process ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model):
    from longserve.config import EngineConfig
    from longserve.engine import Engine

    return Engine(EngineConfig(tiny_model, device="cpu", dtype="float32", max_total_tokens=1024))


def _get(app, path: str):
    import asyncio

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get(path)

    return asyncio.run(main())


def _app(engine, tiny_model, **server_kw):
    from longserve.server.app import create_app
    from longserve.server.async_engine import AsyncEngine
    from longserve.server.config import ServerConfig
    from longserve.server.state import ServerState
    from longserve.tokenization.pool import TokenizerPool

    state = ServerState(
        engine.config, ServerConfig(**server_kw), AsyncEngine(engine), TokenizerPool(tiny_model, 1)
    )
    return create_app(state), state


def test_disable_metrics_and_apps_side_by_side(engine, tiny_model):
    from longserve.server.args import parse

    _, server = parse(
        ["--model-path", tiny_model, "--disable-metrics", "--log-stats-interval", "0"], environ={}
    )
    assert server.enable_metrics is False and server.log_stats_interval == 0
    _, server = parse(["--model-path", tiny_model], environ={})
    assert server.enable_metrics is True and server.log_stats_interval == 10
    with pytest.raises(ValueError, match="log_stats_interval"):
        parse(["--model-path", tiny_model, "--log-stats-interval", "-1"], environ={})

    off, state = _app(engine, tiny_model, enable_metrics=False)
    assert state.metrics is None and _get(off, "/metrics").status_code == 404
    one, s1 = _app(engine, tiny_model)
    two, s2 = _app(engine, tiny_model, served_model_name=("other",))  # own registries: no clash
    s1.metrics.prefix_cache_hits.inc(7)
    assert 'longserve:prefix_cache_hits_total{model_name="other"} 0.0' in _get(two, "/metrics").text
    assert f'longserve:prefix_cache_hits_total{{model_name="{tiny_model}"}} 7.0' in _get(one, "/metrics").text
    for s in (state, s1, s2):
        s.tokenizers.shutdown()


def test_nvml_gauges_when_present(monkeypatch):
    from longserve.server.metrics import ServerMetrics

    fake = types.ModuleType("pynvml")
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetCount = lambda: 2
    fake.nvmlDeviceGetHandleByIndex = lambda i: i
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=(h + 1) * 2**30, total=80 * 2**30)
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=50 + h)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    text = ServerMetrics("m", gpu=True).render().decode()
    samples = {
        (s.name, s.labels.get("gpu")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    # CUDA_VISIBLE_DEVICES=1: one GPU, NVML index 1, shown as the process's gpu "0"
    assert samples[("longserve:gpu_memory_used_bytes", "0")] == 2 * 2**30
    assert samples[("longserve:gpu_memory_total_bytes", "0")] == 80 * 2**30
    assert samples[("longserve:gpu_utilization_perc", "0")] == pytest.approx(0.51)
    assert ("longserve:gpu_memory_used_bytes", "1") not in samples

    fake.nvmlInit = lambda: (_ for _ in ()).throw(RuntimeError("no driver"))
    assert "gpu_" not in ServerMetrics("m", gpu=True).render().decode()


def test_grafana_dashboard_queries_known_metrics():
    import json
    import os
    import re

    from longserve.server.metrics import ServerMetrics
    from tests.server.conftest import REPO

    with open(os.path.join(REPO, "grafana", "longserve-dashboard.json")) as f:
        dashboard = json.load(f)
    metrics = ServerMetrics("m", gpu=False)
    metrics.watch_tokenizer_cache(types.SimpleNamespace(hits=0, misses=0, reused_tokens=0))
    names = {f.name for f in text_string_to_metric_families(metrics.render().decode())}
    names |= {f"longserve:gpu_{n}" for n in ("memory_used_bytes", "memory_total_bytes", "utilization_perc")}
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (
        variables["DS_PROMETHEUS"]["type"] == "datasource"
        and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    )
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for words in ("ttft", "prefill", "decode", "hit rate", "queue", "timeout", "kv"):
        assert words in titles.replace("time to first token", "ttft"), words
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}"
        for target in panel["targets"]:
            for used in re.findall(r"longserve:[a-z0-9_]+", target["expr"]):
                base = re.sub(r"_(bucket|sum|count|total)$", "", used)
                assert base in names, (panel["title"], used)
