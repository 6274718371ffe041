"""--metrics-names: the same series under SGLang's names find every metric SGLang's published Grafana
dashboard queries (vendored in tests/server/dashboards/, its source in the file; vLLM's dashboards are
checked against a real server in tests/server/test_compat_api.py), values and labels carried over."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from longserve.outputs import CompletionOutput, EngineStats, RequestOutput, StepStats

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from longserve.server.metrics import ServerMetrics, StatsTracker  # noqa: E402

DASHBOARDS = Path(__file__).parents[1] / "server" / "dashboards"


def stats(running: int, hits: int) -> EngineStats:
    return EngineStats(
        num_running=running, num_waiting=1, num_unfinished_requests=running + 1, page_size=16,
        num_total_pages=100, num_free_pages=60, num_cached_pages=10, num_used_pages=30, kv_usage=0.3,
        num_prefix_query_tokens=100, num_prefix_hit_tokens=hits, num_preemptions=0, num_short_first_steps=0,
    )  # fmt: skip


def output(tokens: int, finished: bool) -> RequestOutput:
    c = CompletionOutput(0, "", list(range(tokens)), "length" if finished else None, new_token_ids=[1])
    out = RequestOutput("r1", None, [1, 2, 3], [c], finished, cached_tokens=1)
    out.ttft, out.queue_time, out.prefill_time = 0.05, 0.01, 0.04
    if finished:
        out.e2e_latency = 0.2
    return out


def scrape(names: str) -> dict[str, list]:
    metrics = ServerMetrics("tiny", 512, gpu=False, names=names)
    tracker = StatsTracker(metrics, 0.0)
    tracker.update(stats(2, 40), StepStats(num_prefill_tokens=3), [(output(1, False), None)], set())
    tracker.update(stats(1, 40), StepStats(num_decode_tokens=1), [(output(2, True), None)], set())
    by_name: dict[str, list] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            by_name.setdefault(s.name, []).append(s)
    return by_name


def test_sglang_dashboard_finds_every_series():
    by_name = scrape("sglang")
    board = json.loads((DASHBOARDS / "sglang_grafana.json").read_text())
    queried = {n for p in board["panels"] for t in p["targets"] for n in re.findall(r"sglang:\w+", t["expr"])}
    assert len(queried) == 10  # 4 series and 2 histograms (bucket, sum, count)
    for name in queried:
        assert name in by_name, name
        assert all(s.labels["model_name"] == "tiny" for s in by_name[name])
    value = {name: by_name[name][0].value for name in by_name}
    assert value["sglang:num_running_reqs"] == 1 and value["sglang:num_queue_reqs"] == 1
    assert value["sglang:cache_hit_rate"] == pytest.approx(0.4) and value["sglang:token_usage"] == 0.3
    assert value["sglang:num_used_tokens"] == 30 * 16 and value["sglang:gen_throughput"] > 0
    assert value["sglang:e2e_request_latency_seconds_count"] == 1
    assert value["sglang:prompt_tokens_total"] == 3 and value["sglang:generation_tokens_total"] == 2
    assert "longserve:prefill_tokens_computed_total" in by_name  # no SGLang name: kept under ours
    assert not any(name.startswith("vllm:") for name in by_name)


def test_vllm_names_and_aliases():
    by_name = scrape("vllm")
    assert (
        by_name["vllm:kv_cache_usage_perc"][0].value == by_name["vllm:gpu_cache_usage_perc"][0].value == 0.3
    )
    itl = by_name["vllm:inter_token_latency_seconds_count"][0].value
    assert itl == by_name["vllm:time_per_output_token_seconds_count"][0].value == 1
    reasons = {s.labels["finished_reason"]: s.value for s in by_name["vllm:request_success_total"]}
    assert reasons["length"] == 1
    assert by_name["vllm:num_requests_swapped"][0].value == 0
    assert by_name["vllm:request_max_num_generation_tokens_sum"][0].value == 2


def test_longserve_names_by_default():
    by_name = scrape("longserve")
    assert "longserve:num_requests_running" in by_name
    assert not any(name.startswith(("vllm:", "sglang:")) for name in by_name)
