"""`longserve bench serve` and `bench compare` against real servers with the tiny model: every workload runs,
the counts agree with what the server saw (responses, its request log, /metrics when it has one), shared
prefixes hit the cache, errors are counted, an unreachable server is a clear error, and compare writes its
report with valid PNGs."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from longserve import cli
from longserve.bench.compare import load_config, run_compare
from longserve.bench.serve import parse_args, run_once
from longserve.bench.server_api import metrics_delta, parse_metrics
from longserve.bench.workloads import LocalTokenizer, PromptBuilder, build_workload
from tests.server.conftest import CONTEXT, ServerProcess, free_port

pytest.importorskip("aiohttp")
QUIET = ["--disable-tqdm", "--seed", "3"]
_LOGGED = re.compile(r"(/\S+) \S+: (\d+) prompt \((\d+) cached\) \+ (\d+) completion tokens")


def bench(server: ServerProcess, *flags: str) -> dict:
    return run_once(parse_args(["--base-url", server.url, *QUIET, *flags]))


def check_counts(record: dict, num: int, exact_prompt: bool = True) -> None:
    """Every request succeeded; client plan, response counts and /metrics (when exposed) agree."""
    s, reqs = record["summary"], record["requests"]
    assert (s["completed"], s["failed"], s["errors"]) == (num, 0, [])
    assert len(reqs) == num and all(r["success"] and r["ttft"] > 0 for r in reqs)
    for r in reqs:
        assert r["latency"] >= r["ttft"] and r["output_tokens"] == r["output_len"]  # ignore_eos
        times = [r["start"], r["ttft"], r["latency"], *r["itl"]]
        assert all(t == round(t, 6) for t in times), (
            "the record's times are kept to 1 us (backends.TIME_DIGITS)"
        )
        if exact_prompt:
            assert r["prompt_tokens"] == r["prompt_len"]
    assert s["total_input_tokens"] == sum(r["prompt_tokens"] for r in reqs)
    assert s["total_output_tokens"] == sum(r["output_len"] for r in reqs)
    for key in ("ttft", "e2e", "tpot", "itl"):
        d = s[key]
        assert 0 < d["median"] <= d["p90"] <= d["p95"] <= d["p99"]
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    m = record["server_metrics"]
    if m:  # the server exposes /metrics: its counters saw exactly this run
        assert m["requests"] == num
        assert m["prompt_tokens"] == s["total_input_tokens"]
        assert m["generation_tokens"] == s["total_output_tokens"]
        assert m["prefix_cache_hit_rate"] == pytest.approx(s["cache_hit_rate"])


@pytest.fixture(scope="module")
def server2(tiny_model, tmp_path_factory) -> Iterator[ServerProcess]:
    """A second server with a small prefill chunk, for `compare`."""
    args = ["--model-path", tiny_model, "--device", "cpu", "--dtype", "float32"]
    args += ["--max-total-tokens", str(4 * CONTEXT), "--context-length", str(CONTEXT)]
    args += ["--chunked-prefill-size", "64"]
    proc = ServerProcess(args, str(tmp_path_factory.mktemp("logs") / "server2.log"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_random_generate_counts_match_server_log(server, tmp_path):
    out = tmp_path / "random.json"
    log_start = len(server.log())
    rc = cli.main([
        "bench", "serve", "--base-url", server.url, "--backend", "longserve", "--dataset", "random",
        "--num-prompts", "6", "--random-input-len", "48", "--random-output-len", "6", "--max-concurrency", "3",
        "--warmup-requests", "0", "--flush-cache", "--output-json", str(out), *QUIET,
    ])  # fmt: skip
    assert rc == 0
    record = json.loads(out.read_text())
    check_counts(record, 6)
    meta = record["metadata"]
    assert (meta["backend"], meta["endpoint"], meta["dataset"], meta["cache_flushed"]) == (
        "longserve", "generate", "random", "/flush_cache",
    )  # fmt: skip
    assert meta["cache_flush_error"] is None
    assert meta["server_info"]["chunked_prefill_size"] == 8192 and meta["command"].startswith("longserve")
    logged = [m.groups() for m in _LOGGED.finditer(server.log()[log_start:])]
    assert [g[0] for g in logged] == ["/generate"] * 6  # the server saw each request once
    assert sorted(int(g[1]) for g in logged) == sorted(r["prompt_len"] for r in record["requests"])
    assert sum(int(g[3]) for g in logged) == record["summary"]["total_output_tokens"]


def test_shared_prefix_hits_the_cache_more_than_random(server):
    common = ["--flush-cache", "--max-concurrency", "1", "--output-len", "4"]
    random = bench(
        server, *common, "--num-prompts", "8", "--random-input-len", "272", "--random-output-len", "4"
    )
    shared = bench(
        server, *common, "--dataset", "shared-prefix", "--shared-prefix-docs", "2",
        "--shared-prefix-doc-len", "256", "--shared-prefix-questions", "4", "--shared-prefix-question-len", "16",
    )  # fmt: skip
    check_counts(random, 8)
    check_counts(shared, 8)
    assert [r["group"] for r in shared["requests"]] == [0, 0, 0, 0, 1, 1, 1, 1]
    # page-aligned hits: 3 of 4 questions per document reuse its 256 tokens
    assert shared["summary"]["total_cached_tokens"] == 2 * 3 * 256
    assert random["summary"]["cache_hit_rate"] < 0.1 < 0.5 < shared["summary"]["cache_hit_rate"]
    if shared["server_metrics"]:
        rates = [rec["server_metrics"]["prefix_cache_hit_rate"] for rec in (random, shared)]
        assert rates[0] < rates[1]


def test_multi_turn_conversations_resend_their_history_in_order(server, tiny_model):
    flags = ["--dataset", "multi-turn", "--multi-turn-conversations", "2", "--multi-turn-turns", "3",
             "--multi-turn-first-len", "200", "--multi-turn-turn-len", "20", "--output-len", "4"]  # fmt: skip
    args = parse_args(["--base-url", server.url, *QUIET, *flags, "--backend", "vllm"])
    reqs = build_workload(args, PromptBuilder(LocalTokenizer(tiny_model), as_text=True))
    assert [(r.group, r.after) for r in reqs] == [(0, None), (1, None), (0, 0), (1, 1), (0, 2), (1, 3)]
    for r in reqs:  # each turn's text is its previous turn's text plus a reply and a new question
        if r.after is not None:
            assert r.text.startswith(reqs[r.after].text) and r.prompt_len > reqs[r.after].prompt_len
    record = bench(server, *flags, "--backend", "vllm", "--flush-cache", "--max-concurrency", "2")
    check_counts(record, 6)
    done = record["requests"]
    assert [r["group"] for r in done] == [0, 1, 0, 1, 0, 1]
    # a turn is sent once its previous turn has finished; from the second turn on, its history is cached
    for i in range(2, 6):
        assert done[i]["start"] >= done[i - 2]["start"] + done[i - 2]["latency"] - 1e-3
        # all but the last page or two of the previous turn's prompt (its last tokens may merge anew)
        assert done[i]["cached_tokens"] >= done[i - 2]["prompt_tokens"] - 32
    ids = bench(server, *flags, "--flush-cache")  # token ids over /generate: the same shape
    check_counts(ids, 6)


def test_long_doc_text_prompts_over_completions(server):
    record = bench(
        server, "--backend", "vllm", "--dataset", "long-doc", "--long-doc-lens", "128,512",
        "--num-prompts", "4", "--output-len", "3", "--request-rate", "50", "--flush-cache",
    )  # fmt: skip
    check_counts(record, 4)  # the client's re-encoded count is the server's
    assert record["metadata"]["endpoint"] == "completions" and record["metadata"]["model"]
    lens = [r["prompt_len"] for r in record["requests"]]
    assert lens == [128, 512, 128, 512]  # text cut to the exact token count


def test_jsonl_over_chat(server, tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"Question {i}: what did the library lend?", "output_len": 2 + i} for i in range(3)]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    record = bench(server, "--backend", "vllm", "--endpoint", "chat", "--dataset", "jsonl",
                   "--dataset-path", str(path), "--num-prompts", "0")  # fmt: skip
    check_counts(record, 3, exact_prompt=False)  # the chat template adds tokens the client did not count
    for r in record["requests"]:
        assert r["prompt_tokens"] > r["prompt_len"]


def test_server_errors_are_counted_not_raised(server, capsys):
    record = bench(server, "--num-prompts", "3", "--random-input-len", str(CONTEXT + 100),
                   "--random-range-ratio", "1", "--warmup-requests", "0")  # fmt: skip
    s = record["summary"]
    assert (s["completed"], s["failed"]) == (0, 3)
    (error,) = s["errors"]
    assert "HTTP 400" in error and "context length" in error and error.endswith("(x3)")
    assert s["ttft"]["mean"] is None
    rc = cli.main(["bench", "serve", "--base-url", server.url, *QUIET, "--num-prompts", "2",
                   "--random-input-len", str(CONTEXT + 100), "--random-range-ratio", "1"])  # fmt: skip
    assert rc == 1 and "HTTP 400" in capsys.readouterr().out


def test_unreachable_server_is_a_clear_error(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert cli.main(["bench", "serve", "--base-url", url, "--num-prompts", "2"]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach the server at {url}" in err


def test_workload_is_reproducible(tiny_model):
    args = parse_args(
        ["--base-url", "-", "--dataset", "random", "--num-prompts", "5", "--random-input-len", "64"]
    )
    builder = PromptBuilder(LocalTokenizer(tiny_model), as_text=False)
    first, again = build_workload(args, builder), build_workload(args, builder)
    assert first == again
    args.seed += 1
    assert build_workload(args, builder) != first
    assert all(1 <= r.prompt_len <= 64 and 1 <= r.output_len <= 128 for r in first)


def test_metrics_names_of_vllm_and_sglang():
    def text(prefix: str, hits: float, queries: float, ttft_sum: float, count: float) -> str:
        return (
            f'# TYPE {prefix}prefix_cache_hits counter\n{prefix}prefix_cache_hits_total{{m="a"}} {hits}\n'
            f"# TYPE {prefix}prefix_cache_queries counter\n{prefix}prefix_cache_queries_total {queries}\n"
            f"# TYPE {prefix}time_to_first_token_seconds histogram\n"
            f'{prefix}time_to_first_token_seconds_bucket{{le="+Inf"}} {count}\n'
            f"{prefix}time_to_first_token_seconds_sum {ttft_sum}\n"
            f"{prefix}time_to_first_token_seconds_count {count}\n"
        )

    delta = metrics_delta(
        parse_metrics(text("vllm:", 10, 100, 1.0, 2)), parse_metrics(text("vllm:", 40, 200, 2.0, 6))
    )
    assert delta == {
        "prefix_cache_hit_rate": 0.3, "prefix_cache_hits": 30, "prefix_cache_queries": 100,
        "ttft_mean_s": 0.25, "ttft_count": 4,
    }  # fmt: skip
    sglang = "# TYPE sglang:cached_tokens counter\nsglang:cached_tokens_total {}\n"
    sglang += "# TYPE sglang:prompt_tokens counter\nsglang:prompt_tokens_total {}\n"
    delta = metrics_delta(parse_metrics(sglang.format(0, 0)), parse_metrics(sglang.format(50, 200)))
    assert delta["prefix_cache_hit_rate"] == 0.25 and delta["prompt_tokens"] == 200
    assert metrics_delta(None, {}) is None


def test_compare_two_servers_writes_report(server, server2, tmp_path):
    config = {
        "workload": {
            "dataset": "long-doc", "long_doc_lens": [64, 256], "num_prompts": 4, "output_len": 3,
            "max_concurrency": [1, 2], "flush_cache": True, "disable_tqdm": True, "warmup_requests": 0,
        },
        "endpoints": [
            {"name": "chunk-8192", "base_url": server.url, "backend": "longserve"},
            {"name": "chunk-64", "base_url": server2.url, "backend": "longserve"},
        ],
    }  # fmt: skip
    path = tmp_path / "compare.yaml"
    import yaml

    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "report"
    assert cli.main(["bench", "compare", "--config", str(path), "--output-dir", str(out)]) == 0
    pngs = {"ttft_vs_prompt_len.png", "ttft_cdf.png", "throughput_vs_concurrency.png"}
    assert {"report.md", "results.json", *pngs} == {p.name for p in out.iterdir()}
    for png in out.glob("*.png"):
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) > 5000
    results = json.loads((out / "results.json").read_text())
    runs = [(r["name"], r["max_concurrency"]) for r in results["runs"]]
    assert runs == [("chunk-8192", 1), ("chunk-8192", 2), ("chunk-64", 1), ("chunk-64", 2)]
    for run in results["runs"]:
        check_counts(run, 4)
        assert run["summary"]["cache_hit_rate"] == 0  # flushed before each run
    chunks = {r["name"]: r["metadata"]["server_info"]["chunked_prefill_size"] for r in results["runs"]}
    assert chunks == {"chunk-8192": 8192, "chunk-64": 64}
    report = (out / "report.md").read_text()
    assert "| chunk-64 | 2 | 4/0 |" in report and "chunked_prefill_size 64" in report
    assert "![ttft_cdf.png](ttft_cdf.png)" in report


def test_compare_config_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "endpoints:\n  - {name: a, base_url: 'http://127.0.0.1:1'}\nworkload: {no_such_flag: 1}\n"
    )
    with pytest.raises(ValueError, match="unknown key 'no_such_flag'"):
        run_compare(load_config(str(path)), str(tmp_path))
    path.write_text("workload: {}\n")
    assert cli.main(["bench", "compare", "--config", str(path)]) == 2
