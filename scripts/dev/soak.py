#!/usr/bin/env python3
"""Soak test of a real longserve server: mixed traffic, the server's RSS as it goes, every page back at the end.

Starts `python -m longserve.launch_server` on a free 127.0.0.1 port (the built-in demo model unless
--model-path is given; more flags with --server-arg), or attaches to --base-url (--pid for its RSS), then sends
--num-requests requests (stopping early after --max-seconds, once --min-requests went out) from --concurrency
clients. The kinds: /generate, /v1/completions and /v1/chat/completions, streamed and not, text and token-id
prompts, batches, n > 1, seeded sampling, logprobs, stop strings; clients that hang up mid-stream or mid-wait;
requests that run past the server's --request-timeout; bad input that must get a 4xx (malformed JSON, wrong
types, prompts over the context, unknown models, ...); /tokenize, /detokenize, /v1/models, /metrics.

Every --report-every requests it prints the server's RSS (VmRSS, and its anonymous part, from /proc/PID/status)
with the counts so far. At the end: /health, the KV page accounting of GET /server_info (`kv_used_pages` must
be 0 once every request is over, `kv_integrity` "ok", from /server_info?check_integrity=true), and a least-squares fit of RSS against the request count
after --warmup-requests (KiB per request, and the growth over the fitted span).

Exit status 0 when all is well; 1 when a request got an unexpected answer (a 5xx, a 2xx where a 4xx was due, a
wrong shape, a client-side timeout), when the accounting or /health is wrong, or when the RSS slope after the
warm-up exceeds --max-rss-slope-kib; 2 when the server could not be started or reached.

    python scripts/dev/soak.py --num-requests 20000                      # the demo model, 8 clients
    python scripts/dev/soak.py --num-requests 3000 --max-seconds 60      # about a minute
    python scripts/dev/soak.py --base-url http://127.0.0.1:30000 --pid 1234 --num-requests 5000

Loopback only: the server it starts binds 127.0.0.1, and --base-url must be a loopback address.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import ipaddress
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import aiohttp

from longserve.testing.server_process import (
    ServerProcess,
    read_cpu_seconds,
    read_rss,
    read_smaps,
    smaps_growth,
)
from longserve.testing.soak_checks import Stats, Unexpected, wait_healthy
from longserve.testing.soak_traffic import Traffic

# Flags of the server this script starts, before any --server-arg (a later flag wins). A KV pool of 2,048
# pages rather than the CPU default (32,768 pages, 1 GiB zero-filled at start): the prefix cache fills it and
# evicts within the warm-up, so the steady state is what gets measured, eviction included. A context of 16,384
# (past the demo model's 2,048 positions, which only costs quality) and an 8 s request timeout: the "timeout"
# kinds ask for ~16,000 tokens, at least 16 s at 1 ms a token, and are always cut; the other requests (at most
# ~60 new tokens, 0.2 s unloaded) keep a 40x margin on a loaded machine (20x, with 4 s and a context of 8,192,
# was not enough: CI's other worker beside it pushed an ordinary request past 4 s in 2 of 7 runs, 2026-12-05).
# --strict-model-name: an unknown `model` is a 404 (vLLM's answer; by default any name is served, as SGLang
# does), so the bad-input kinds keep exercising that refusal.
DEFAULT_SERVER_ARGS = ["--max-total-tokens", "32768", "--context-length", "16384", "--request-timeout", "8"]
DEFAULT_SERVER_ARGS += ["--strict-model-name"]

# ---- the run ----------------------------------------------------------------------------------------


def least_squares_slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of RSS (KiB) against the request count: KiB per request."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def median_slope(points: list[tuple[int, int]]) -> float:
    """Theil-Sen: the median of the slopes between every two samples (KiB per request). A leak moves every
    pair; a one-off step (an arena that grows once, a burst of long prompts) moves only the pairs across it,
    which a least-squares line turns into a slope over a short run."""
    slopes = sorted(
        (y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1 :] if x2 != x1
    )
    if not slopes:
        return 0.0
    mid = len(slopes) // 2
    return slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2


@dataclass
class Run:
    args: argparse.Namespace
    url: str
    pid: int | None
    stats: Stats = field(default_factory=Stats)
    samples: list[tuple[int, int]] = field(default_factory=list)  # (requests done, VmRSS KiB)
    started: float = field(default_factory=time.monotonic)
    smaps_at_warmup: dict[str, int] | None = None
    last_cpu: tuple[int, float] = (0, 0.0)  # (requests done, server CPU seconds) at the previous row
    cpu_at_start: float = 0.0

    def rss(self) -> dict[str, int]:
        return read_rss(self.pid) if self.pid is not None else {}

    def cpu(self) -> float:
        return read_cpu_seconds(self.pid) if self.pid is not None else 0.0

    def report(self) -> None:
        """One row of the table: requests done, seconds, requests/s, the server's RSS and anonymous RSS (MiB),
        its CPU milliseconds per request since the previous row, the answers so far."""
        s = self.stats
        rss = self.rss()
        elapsed = time.monotonic() - self.started
        labels = " ".join(f"{k}={v}" for k, v in sorted(s.by_label.items()))
        if rss:
            cpu, (done0, cpu0) = self.cpu(), self.last_cpu
            per_request = 1000 * (cpu - cpu0) / max(s.done - done0, 1)
            self.last_cpu = (s.done, cpu)
            mem = f"{rss['VmRSS'] / 1024:8.1f} {rss.get('RssAnon', 0) / 1024:8.1f} {per_request:6.1f}"
        else:
            mem = f"{'-':>8} {'-':>8} {'-':>6}"
        print(f"{s.done:>8} {elapsed:8.1f} {s.done / elapsed:7.1f} {mem}  {labels}", flush=True)

    def on_done(self) -> None:
        done = self.stats.done
        if self.pid is not None and done % self.args.sample_every == 0:
            self.samples.append((done, self.rss()["VmRSS"]))
            if self.args.smaps and done == self.args.warmup_requests:
                self.smaps_at_warmup = read_smaps(self.pid)
        if done % self.args.report_every == 0:
            self.report()


def kind_sequence(kinds: dict[str, int], rng: random.Random) -> Iterator[str]:
    """The kinds in shuffled blocks, each kind its weight's number of times per block: every kind runs in
    every block (95 requests with all kinds), however short the run, and the mix is the seed's alone."""
    block = [kind for kind, weight in kinds.items() for _ in range(weight)]
    while True:
        rng.shuffle(block)
        yield from block


async def worker(
    run: Run, traffic: Traffic, kinds: Iterator[str], next_id: list[int], deadline: float
) -> None:
    # past the deadline only while fewer than --min-requests went out (a busy machine still gets its RSS fit)
    while next_id[0] < run.args.num_requests and (
        time.monotonic() < deadline or next_id[0] < run.args.min_requests
    ):
        next_id[0] += 1
        kind = next(kinds)
        try:
            label = await traffic.kinds[kind]()
            run.stats.record(kind, label)
        except Unexpected as e:
            run.stats.record(kind, "unexpected", str(e))
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, KeyError, TypeError) as e:
            run.stats.record(kind, "unexpected", f"{type(e).__name__}: {e}")
        run.on_done()


async def final_accounting(session: aiohttp.ClientSession, url: str, settle: float) -> tuple[dict, int]:
    """/server_info once no request is left in the engine (aborts of hung-up clients land a little after
    their connections close), and the /health status."""
    end = time.monotonic() + settle
    while True:
        async with session.get(url + "/server_info", params={"check_integrity": "true"}) as r:
            info = await r.json()
        busy = info.get("num_unfinished_requests", 0) or info.get("kv_used_pages", 0)
        if not busy or time.monotonic() > end:
            break
        await asyncio.sleep(0.5)
    async with session.get(url + "/health") as r:
        return info, r.status


async def soak(args: argparse.Namespace, url: str, pid: int | None, server: ServerProcess | None) -> int:
    timeout = aiohttp.ClientTimeout(total=args.client_timeout)
    connector = aiohttp.TCPConnector(limit=args.concurrency + 4)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await wait_healthy(session, url, server, args.start_timeout)
        async with session.get(url + "/model_info") as r:
            info = await r.json()
        async with session.get(url + "/server_info") as r:
            info["request_timeout"] = (await r.json())["server_config"].get("request_timeout")
        rng = random.Random(args.seed)
        traffic = Traffic(session, url, info, rng)
        await traffic.setup()
        if args.kinds:
            unknown = set(args.kinds) - set(traffic.kinds)
            if unknown:
                raise SystemExit(f"unknown kinds {sorted(unknown)}; known: {', '.join(traffic.kinds)}")
            traffic.kinds = {k: v for k, v in traffic.kinds.items() if k in args.kinds}
        run = Run(args, url, pid)
        rss0 = run.rss()
        print(
            f"soak: {args.num_requests} requests (at most {args.max_seconds:.0f}s, at least {args.min_requests}), "
            f"{args.concurrency} clients, "
            f"against {url} (pid {pid}); context {traffic.ctx}, request timeout {traffic.request_timeout}; "
            f"kinds: {', '.join(traffic.kinds)}",
            flush=True,
        )
        if rss0:
            print(f"RSS before the first request: {rss0['VmRSS'] / 1024:.1f} MiB", flush=True)
        run.cpu_at_start = run.cpu()
        run.last_cpu = (0, run.cpu_at_start)
        head = f"{'requests':>8} {'seconds':>8} {'req/s':>7} {'rss_MiB':>8} {'anon_MiB':>8} {'cpu_ms':>6}"
        print(head + "  answers", flush=True)
        next_id = [0]
        deadline = time.monotonic() + args.max_seconds
        kinds = kind_sequence(
            {k: traffic.KIND_WEIGHTS[k] for k in traffic.kinds}, random.Random(args.seed + 1)
        )
        workers = (worker(run, traffic, kinds, next_id, deadline) for _ in range(args.concurrency))
        await asyncio.gather(*workers)
        if run.stats.done % args.report_every:
            run.report()
        elapsed = time.monotonic() - run.started
        info, health = await final_accounting(session, url, args.settle_seconds)

    return summarize(args, run, info, health, elapsed, server)


def summarize(
    args: argparse.Namespace,
    run: Run,
    info: dict,
    health: int,
    elapsed: float,
    server: ServerProcess | None,
) -> int:
    s = run.stats
    failures: list[str] = []
    print(f"\n{s.done} requests in {elapsed:.1f}s ({s.done / elapsed:.1f}/s)")
    print("by kind:   " + " ".join(f"{k}={v}" for k, v in sorted(s.by_kind.items())))
    print("by answer: " + " ".join(f"{k}={v}" for k, v in sorted(s.by_label.items())))
    if s.by_label["unexpected"]:
        failures.append(f"{s.by_label['unexpected']} unexpected answers")
        for line in s.unexpected:
            print(f"  unexpected: {line}")

    print(f"health: {health}")
    if health != 200:
        failures.append(f"/health answered {health}")
    keys = ("kv_total_pages", "kv_free_pages", "kv_cached_pages", "kv_used_pages", "num_unfinished_requests")
    print("kv pages: " + " ".join(f"{k.removeprefix('kv_')}={info.get(k)}" for k in keys))
    if info.get("kv_used_pages") != 0 or info.get("num_unfinished_requests") != 0:
        failures.append("pages or requests still held after every request ended")
    if info.get("kv_free_pages", 0) + info.get("kv_cached_pages", 0) != info.get("kv_total_pages"):
        failures.append("free + cached pages != total pages")
    integrity = info.get("kv_integrity", "not reported by /server_info")
    print(f"kv integrity: {integrity}")
    if integrity != "ok":
        failures.append(f"kv integrity: {integrity}")
    steps, errors, aborted = (info.get(k) for k in ("num_steps", "num_step_errors", "num_aborted_requests"))
    print(f"engine: {steps} steps, {errors} step errors, {aborted} aborted requests")
    if info.get("num_step_errors"):
        failures.append(f"{info['num_step_errors']} engine step errors")

    if run.pid is not None:
        rss, cpu = run.rss(), run.cpu() - run.cpu_at_start
        print(
            f"RSS at the end: {rss['VmRSS'] / 1024:.1f} MiB (peak {rss.get('VmHWM', 0) / 1024:.1f} MiB); "
            f"server CPU {cpu:.0f} s, {1000 * cpu / max(s.done, 1):.1f} ms per request"
        )
        after = [p for p in run.samples if p[0] >= args.warmup_requests]
        if len(after) >= 3:
            slope, ls_slope = median_slope(after), least_squares_slope(after)
            span = after[-1][0] - after[0][0]
            ys = [y for _, y in after]
            print(
                f"RSS fit after the warm-up ({after[0][0]}..{after[-1][0]} requests, {len(after)} samples): "
                f"{slope:+.3f} KiB/request (Theil-Sen; least squares {ls_slope:+.3f}), "
                f"{slope * span / 1024:+.1f} MiB over the span; measured {(ys[-1] - ys[0]) / 1024:+.1f} MiB, "
                f"min {min(ys) / 1024:.1f}, max {max(ys) / 1024:.1f} MiB"
            )
            if slope > args.max_rss_slope_kib:
                failures.append(f"RSS slope {slope:.3f} KiB/request > {args.max_rss_slope_kib}")
        else:
            print(f"RSS fit: too few samples after the warm-up of {args.warmup_requests} requests")
            if args.require_fit:
                failures.append("no RSS fit (run more requests or shorten --warmup-requests)")
        if run.smaps_at_warmup is not None:
            print("mappings that grew most since the warm-up:")
            for line in smaps_growth(run.smaps_at_warmup, read_smaps(run.pid)):
                print("  " + line)
    if args.json:
        record = {
            "command": [sys.executable, *sys.argv],
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": host_description(),
            "args": vars(args),
            "elapsed": elapsed,
            "by_kind": s.by_kind,
            "by_label": s.by_label,
            "unexpected": s.unexpected,
            "samples": run.samples,
            "server_info": info,
            "failures": failures,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1, default=str)

    if server is not None and server.proc.poll() is not None:
        failures.append(f"the server exited during the run ({server.proc.returncode})")
    print("FAIL: " + "; ".join(failures) if failures else "PASS", flush=True)
    return 1 if failures else 0


def host_description() -> dict[str, Any]:
    """The machine and the versions that matter to a memory measurement (for the JSON record)."""
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    versions = {}
    for package in ("torch", "transformers", "tokenizers", "fastapi", "uvicorn", "aiohttp"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "libc": " ".join(platform.libc_ver()),
        "python": platform.python_version(),
        "versions": versions,
    }


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise SystemExit(f"--base-url must be a loopback address (127.0.0.1, ::1, localhost), not {host!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=20000)
    p.add_argument("--max-seconds", type=float, default=3600, help="stop sending after this long")
    p.add_argument("--min-requests", type=int, default=0, help="but not before this many requests went out")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--model-path", help="checkpoint of the server started here (default: the demo model)")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="a flag for the server started here, e.g. --server-arg=--request-timeout=1 (repeatable; after "
        f"the defaults {' '.join(DEFAULT_SERVER_ARGS)})",
    )
    p.add_argument("--server-log", help="the started server's log file (default: a temporary file)")
    p.add_argument("--base-url", help="attach to this running server instead of starting one (loopback only)")
    p.add_argument("--pid", type=int, help="with --base-url: the server's pid, for its RSS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", type=lambda s: s.split(","), help="only these request kinds (comma-separated)")
    p.add_argument("--report-every", type=int, default=1000, help="print RSS every this many requests")
    p.add_argument(
        "--sample-every", type=int, default=100, help="read RSS for the fit every this many requests"
    )
    p.add_argument("--warmup-requests", type=int, default=4000, help="requests before the RSS fit starts")
    p.add_argument(
        "--max-rss-slope-kib",
        type=float,
        default=1.0,
        help="fail when RSS grows faster than this after the warm-up (KiB per request, Theil-Sen)",
    )
    p.add_argument("--require-fit", action="store_true", help="fail when too few requests ran for the fit")
    p.add_argument(
        "--smaps", action="store_true", help="at the end, list the mappings that grew since warm-up"
    )
    p.add_argument("--client-timeout", type=float, default=120, help="a request with no answer by then fails")
    p.add_argument("--start-timeout", type=float, default=180)
    p.add_argument("--settle-seconds", type=float, default=30, help="wait this long for aborts to land")
    p.add_argument("--json", help="write the samples and the summary here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.base_url:
        check_loopback(args.base_url)
        if args.pid is None:
            print("no --pid: RSS is not measured", file=sys.stderr)
        try:
            return asyncio.run(soak(args, args.base_url.rstrip("/"), args.pid, None))
        except (RuntimeError, aiohttp.ClientError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    server_args = list(DEFAULT_SERVER_ARGS)
    if args.model_path:
        server_args += ["--model-path", args.model_path]
    server_args += args.server_arg
    log_path = args.server_log or os.path.join(tempfile.mkdtemp(prefix="soak-"), "server.log")
    server = ServerProcess(["--host", "127.0.0.1", *server_args], log_path)  # on a port the kernel picks
    print(f"starting the server (pid {server.pid}, log {log_path}): {' '.join(server_args)}", flush=True)
    try:
        server.wait_ready(args.start_timeout)  # its port is in its log
        rc = asyncio.run(soak(args, server.url, server.pid, server))
    except (RuntimeError, aiohttp.ClientError) as e:
        print(f"error: {e}\n{server.log_tail()}", file=sys.stderr)
        rc = 2
    finally:
        status = server.stop()
    print(f"server stopped (exit status {status})", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
