"""Online serving benchmark: `longserve bench serve --base-url URL --backend longserve|sglang|vllm|openai`
streams a seeded workload at a running server (Poisson arrivals and/or bounded concurrency), times every
request on the client, scrapes /metrics before and after, and prints/saves TTFT, ITL, TPOT, E2E latency and
throughput. Flag spellings follow SGLang's bench_serving where they overlap."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shlex
import sys
from typing import Any

from longserve.bench.backends import BACKENDS, GENERATE_BACKENDS, RequestResult, send
from longserve.bench.latency import _counts
from longserve.bench.server_api import Server, ServerError, metrics_delta
from longserve.bench.stats import summarize
from longserve.bench.workloads import (
    DATASETS,
    BenchRequest,
    LocalTokenizer,
    PromptBuilder,
    RemoteTokenizer,
    arrival_delays,
    build_workload,
    warmup_requests,
)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload and arrival flags (shared with `bench compare`, whose YAML uses the same names)."""
    p.add_argument("--dataset", "--dataset-name", default="random", choices=DATASETS, help="workload")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=100,
        help="requests (shared-prefix and multi-turn ignore it: docs x questions, conversations x turns)",
    )
    p.add_argument("--random-input-len", type=int, default=1024, help="random: longest prompt")
    p.add_argument("--random-output-len", type=int, default=128, help="random: longest output")
    p.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="random: lengths drawn from [len*ratio, len]"
    )
    p.add_argument(
        "--long-doc-lens", type=_counts, default=[8192, 32768], help="long-doc: prompt lengths (8k,32k,128k)"
    )
    p.add_argument("--shared-prefix-docs", type=int, default=4, help="shared-prefix: documents")
    p.add_argument("--shared-prefix-doc-len", type=int, default=8192, help="shared-prefix: document tokens")
    p.add_argument("--shared-prefix-questions", type=int, default=8, help="shared-prefix: questions per doc")
    p.add_argument(
        "--shared-prefix-question-len", type=int, default=64, help="shared-prefix: question tokens"
    )
    p.add_argument("--multi-turn-conversations", type=int, default=4, help="multi-turn: conversations")
    p.add_argument("--multi-turn-turns", type=int, default=8, help="multi-turn: turns per conversation")
    p.add_argument(
        "--multi-turn-first-len",
        type=int,
        default=8192,
        help="multi-turn: tokens of a conversation's opening",
    )
    p.add_argument("--multi-turn-turn-len", type=int, default=256, help="multi-turn: new tokens per turn")
    p.add_argument("--dataset-path", help='jsonl: file of {"prompt": str, "output_len": int} lines')
    p.add_argument(
        "--output-len", type=int, default=16, help="output tokens of long-doc/shared-prefix/multi-turn/jsonl"
    )
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson rate/s (inf: all at once)"
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--warmup-requests", type=int, default=1, help="short requests sent first, not measured")
    p.add_argument("--seed", type=int, default=1, help="seed of the workload and the arrival times")
    p.add_argument("--tokenizer", help="local tokenizer directory (default: the server's /tokenize)")
    p.add_argument("--flush-cache", action="store_true", help="flush the prefix cache before the run")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="server address, e.g. http://127.0.0.1:30000")
    p.add_argument("--backend", default="longserve", choices=BACKENDS, help="API: /generate or OpenAI")
    p.add_argument("--endpoint", default="completions", choices=("completions", "chat"), help="OpenAI API")
    p.add_argument("--model", help="model name for the OpenAI endpoints (default: the server's first)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    p.add_argument("--output-json", metavar="FILE", help="write summary and per-request records as JSON")
    add_workload_args(p)


def _validate(args: argparse.Namespace) -> None:
    for name in (
        "num_prompts", "random_input_len", "random_output_len", "output_len", "shared_prefix_docs",
        "multi_turn_conversations", "multi_turn_turns", "multi_turn_first_len", "multi_turn_turn_len",
    ):  # fmt: skip
        if getattr(args, name) < (0 if name == "num_prompts" and args.dataset == "jsonl" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1]; got {args.random_range_ratio}")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once); got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1; got {args.max_concurrency}")


def prepare(args: argparse.Namespace, server: Server) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(warm-up requests, workload) in the prompt form the backend takes."""
    tokenizer = LocalTokenizer(args.tokenizer) if args.tokenizer else RemoteTokenizer(server)
    try:
        builder = PromptBuilder(tokenizer, as_text=args.backend not in GENERATE_BACKENDS)
    except ServerError as e:
        raise ServerError(
            f"{e}\n(no /tokenize on this server? pass --tokenizer DIR to count tokens locally)"
        ) from None
    return warmup_requests(builder, args.warmup_requests, args.seed), build_workload(args, builder)


async def _drive(
    args: argparse.Namespace, server: Server, model: str | None, requests: list[BenchRequest], label: str
) -> tuple[list[RequestResult], float]:
    import time

    import aiohttp
    from tqdm import tqdm

    limit = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)
    delays = arrival_delays(len(requests), args.request_rate, args.seed)
    bar = tqdm(total=len(requests), desc=label, file=sys.stderr, disable=args.disable_tqdm, leave=False)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    connector = aiohttp.TCPConnector(limit=0)  # the semaphore bounds concurrency, not the pool

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        finished = [asyncio.Event() for _ in requests]

        async def one(i: int, req: BenchRequest) -> RequestResult:
            try:
                if req.after is not None:  # a conversation's next turn: once the previous one is answered
                    await finished[req.after].wait()
                async with limit:
                    out = await send(
                        session, server.base_url, args.backend, args.endpoint, req, model, t0, server.headers
                    )
            finally:
                finished[i].set()
            bar.update(1)
            return out

        t0 = time.perf_counter()
        tasks = []
        for i, (req, delay) in enumerate(zip(requests, delays)):
            if delay:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


def run_once(
    args: argparse.Namespace,
    server: Server | None = None,
    workload: tuple[list[BenchRequest], list[BenchRequest]] | None = None,
) -> dict[str, Any]:
    """Warm up, optionally flush, scrape /metrics, run the workload, scrape again; the result record."""
    _validate(args)
    api_key = args.api_key
    if api_key is None and args.backend in ("vllm", "openai"):
        import os

        api_key = os.environ.get("OPENAI_API_KEY")
    server = server or Server(args.base_url, api_key)
    server.check_reachable()
    info = server.server_info()
    model = None if args.backend in GENERATE_BACKENDS else (args.model or info.get("served_model"))
    warmup, requests = workload or prepare(args, server)
    if warmup:
        asyncio.run(_drive(args, server, model, warmup, "warm-up"))
    flushed, flush_error = None, None
    if args.flush_cache:
        try:
            flushed = server.flush_cache(args.backend)
        except ServerError as e:  # measured anyway, but the record, the summary and the report say so
            flush_error = str(e)
            print(f"warning: {flush_error}", file=sys.stderr)
    before = server.scrape_metrics()
    results, duration = asyncio.run(_drive(args, server, model, requests, f"{args.dataset} {args.backend}"))
    after = server.scrape_metrics()
    return {
        "metadata": {
            "backend": args.backend,
            "endpoint": args.endpoint if args.backend not in GENERATE_BACKENDS else "generate",
            "base_url": server.base_url,
            "model": model or info.get("served_model") or info.get("model"),
            "server_info": info,
            "dataset": args.dataset,
            "num_prompts": len(requests),
            "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency,
            "seed": args.seed,
            "cache_flushed": flushed,  # the path that flushed it; None when not asked
            "cache_flush_error": flush_error,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": shlex.join(["longserve", *sys.argv[1:]]),
        },
        "summary": summarize(results, duration),
        "server_metrics": metrics_delta(before, after),
        "requests": [r.as_dict() for r in results],
    }


def format_summary(record: dict[str, Any]) -> str:
    """SGLang-style block of the headline numbers."""
    s, m, sm = record["summary"], record["metadata"], record["server_metrics"]
    rows: list[tuple[str, Any]] = [
        ("Backend", f"{m['backend']} ({m['endpoint']}) at {m['base_url']}"),
        ("Dataset", f"{m['dataset']}, {m['num_prompts']} prompts, seed {m['seed']}"),
        ("Request rate / max concurrency", f"{m['request_rate']} / {m['max_concurrency'] or '-'}"),
        ("Successful / failed requests", f"{s['completed']} / {s['failed']}"),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input / generated tokens", f"{s['total_input_tokens']} / {s['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        (
            "Input / output token throughput (tok/s)",
            f"{s['input_throughput']:.1f} / {s['output_throughput']:.1f}",
        ),
        ("Prefix cache hit rate (responses)", _pct(s.get("cache_hit_rate"))),
    ]
    if sm:
        rows.append(("Prefix cache hit rate (/metrics)", _pct(sm.get("prefix_cache_hit_rate"))))
        if "ttft_mean_s" in sm:
            rows.append(("Server mean TTFT (ms)", f"{sm['ttft_mean_s'] * 1000:.2f}"))
    for key, title in (("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT"), ("e2e", "E2E latency")):
        st = s[key]
        if st["mean"] is not None:
            rows.append(
                (
                    f"{title} (ms) mean/median/p90/p95/p99",
                    " / ".join(f"{st[k] * 1000:.2f}" for k in ("mean", "median", "p90", "p95", "p99")),
                )
            )
    width = max(len(r[0]) for r in rows) + 2
    lines = ["=" * 20 + " Serving Benchmark Result " + "=" * 20]
    lines += [f"{k + ':':<{width}}{v}" for k, v in rows]
    if m.get("cache_flush_error"):
        lines.append(f"error: the cache was NOT flushed before the run: {m['cache_flush_error']}")
    for err in s["errors"]:
        lines.append(f"error: {err}")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    record = run_once(args)
    print(format_summary(record))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(record, f, indent=1)
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The `bench serve` flags as a namespace (for scripts and tests: run_once(parse_args([...])))."""
    parser = argparse.ArgumentParser(prog="longserve bench serve", description=__doc__)
    add_serve_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    run_from_args(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
