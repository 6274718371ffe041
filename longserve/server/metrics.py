"""Prometheus metrics (GET /metrics) and the periodic engine stats log line of one server.

ServerMetrics owns a per-app CollectorRegistry, so several apps can live in one process (tests). Names
mirror vLLM's with the `longserve:` prefix; every series carries `model_name`. StatsTracker runs on the
engine thread only: after each loop iteration of the bridge it turns the step's stats, the outputs it
delivers and the requests that finished into metric updates (and, every `log_stats_interval` seconds,
one log line). It takes no lock of its own; prometheus_client's per-value locks are the only ones.
GPU memory and utilisation are read through NVML at scrape time when it loads (server/metric_collectors.py),
and are absent otherwise.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from longserve.server.metric_collectors import NvmlCollector, TokenizerCacheCollector
from longserve.server.metrics_names import PREFIX, renamed_registry

if TYPE_CHECKING:
    from longserve.engine import Engine
    from longserve.outputs import EngineStats, RequestOutput, StepStats

logger = logging.getLogger("longserve.stats")

# why a request left: the engine's reasons, plus the server's own
FINISHED_REASONS = ("stop", "length", "abort", "timeout", "error", "rejected")
HIT_RATE_WINDOW_S = 60.0
THROUGHPUT_WINDOW_S = 10.0

# seconds; long prompts make TTFT and prefill reach minutes, so the buckets go far
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def token_buckets(max_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's build_1_2_5_buckets)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_len:
                return out
            out.append(v)
        exp += 1


class ServerMetrics:
    """The Prometheus collectors of one app, with `model_name` already bound."""

    def __init__(
        self, model_name: str, max_model_len: int = 131072, gpu: bool = True, names: str = "longserve"
    ) -> None:
        """names: whose names /metrics serves the series under (metrics_names.py): longserve's, vLLM's
        (vllm:*) or SGLang's (sglang:*), so that their Grafana dashboards work unchanged."""
        disable_created_metrics()  # process-wide; the `_created` series only add noise (vLLM does the same)
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        reg, labels = self.registry, ["model_name"]

        def histogram(name: str, doc: str, buckets: Iterable[float]):
            return Histogram(PREFIX + name, doc, labels, buckets=list(buckets), registry=reg).labels(
                model_name
            )

        def counter(name: str, doc: str):
            return Counter(PREFIX + name, doc, labels, registry=reg).labels(model_name)

        def gauge(name: str, doc: str):
            return Gauge(PREFIX + name, doc, labels, registry=reg).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token per request", TTFT_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens", ITL_BUCKETS
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival at the engine to the end of a request", REQUEST_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduling per request", TTFT_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduling to first token per request", TTFT_BUCKETS
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "First token to the end of a request", REQUEST_BUCKETS
        )
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request", tokens)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request", tokens
        )
        self.request_max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Most tokens any one completion of a request generated",
            tokens,
        )

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests whose prefill completed")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.prefill_tokens_computed = counter(
            "prefill_tokens_computed", "Prompt tokens computed by the model (prefix-cache hits excluded)"
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache (at first admission)"
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache")
        self.preemptions = counter("num_preemptions", "Requests preempted (recomputed later)")
        self.short_first_steps = counter(
            "short_first_steps",
            "Steps that served short requests while a long prefill waited (--schedule-policy short-first)",
        )
        finished = Counter(
            PREFIX + "request_finished",
            "Requests by how they ended: stop, length, abort (client gone), timeout (--request-timeout), "
            "error, rejected (refused with a 4xx/503 before running; one per HTTP request)",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.finished = {r: finished.labels(model_name, r) for r in FINISHED_REASONS}

        self.num_running = gauge("num_requests_running", "Requests in the running batch")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting for admission")
        self.num_used_tokens = gauge("num_used_tokens", "KV pool tokens held by requests in flight")
        self.gen_throughput = gauge(
            "gen_throughput", f"Generated tokens per second over the last {THROUGHPUT_WINDOW_S:.0f} s"
        )
        self.kv_usage = gauge(
            "kv_cache_usage_perc", "KV pool share held by requests in flight; 1 means 100 percent"
        )
        self.hit_rate = gauge(
            "prefix_cache_hit_rate",
            f"Prefix-cache hits / queried prompt tokens over the last {HIT_RATE_WINDOW_S:.0f} s of admissions",
        )
        self.nvml = NvmlCollector.create(model_name) if gpu else None
        if self.nvml is not None:
            reg.register(self.nvml)
        self._exposed = renamed_registry(reg, names, model_name)  # what render() writes

    def watch_tokenizer_cache(self, cache: Any) -> None:
        """Export a PrefixTokenCache's counters (once; the server's tokenizer pool has one cache)."""
        self.registry.register(TokenizerCacheCollector(cache, self.model_name))

    def render(self) -> bytes:
        return generate_latest(self._exposed)

    def observe_finished(self, out: RequestOutput, reason: str) -> None:
        """Request-level histograms and the finish counter, once per request (engine thread)."""
        self.finished.get(reason, self.finished["error"]).inc()
        self.request_prompt_tokens.observe(out.prompt_tokens)
        self.request_generation_tokens.observe(out.completion_tokens)
        self.request_max_generation_tokens.observe(max((len(c.token_ids) for c in out.outputs), default=0))
        if out.e2e_latency is not None:
            self.e2e.observe(out.e2e_latency)
        if out.queue_time is not None:
            self.queue_time.observe(out.queue_time)
        if out.prefill_time is not None:
            self.prefill_time.observe(out.prefill_time)
        if out.ttft is not None:
            self.ttft.observe(out.ttft)
            decode = decode_time(out)
            if decode is not None:
                self.decode_time.observe(decode)
                per_member = max(len(c.token_ids) for c in out.outputs)
                if per_member > 1:
                    self.tpot.observe(decode / (per_member - 1))


def decode_time(out: RequestOutput) -> float | None:
    """First token to the end of the request (None until both are known)."""
    if out.ttft is None or out.e2e_latency is None:
        return None
    return max(out.e2e_latency - out.ttft, 0.0)


def timings(out: RequestOutput) -> dict[str, Any]:
    """The request's own numbers, as responses carry them (`meta_info`)."""
    return {
        "prompt_tokens": out.prompt_tokens,
        "cached_tokens": out.cached_tokens,
        "ttft": out.ttft,
        "queue_time": out.queue_time,
        "prefill_time": out.prefill_time,
        "decode_time": decode_time(out),
        "e2e_latency": out.e2e_latency,
    }


def finish_label(out: RequestOutput, status: int | None, timed_out: bool) -> str:
    if timed_out:
        return "timeout"
    if status == 400:
        return "rejected"  # the engine refused it before it ran (it cannot fit the KV pool)
    if status is not None and status >= 500:
        return "error"  # failed step or shutdown
    return out.finish_reason or "error"


class StatsTracker:
    """Engine-thread bookkeeping: metric updates per loop iteration and the periodic stats log line."""

    def __init__(
        self,
        metrics: ServerMetrics | None,
        log_interval: float,
        hit_rate_window: float = HIT_RATE_WINDOW_S,
    ) -> None:
        self.metrics = metrics
        self.log_interval = log_interval
        self.hit_rate_window = hit_rate_window
        self._seen = (0, 0, 0, 0)  # engine counters already accounted: queries, hits, preemptions, short
        self._window: deque[tuple[float, int, int]] = deque()  # (time, queried, hit) per iteration
        self._window_q = self._window_h = 0
        self._last_token: dict[str, dict[int, float]] = {}  # request -> completion index -> last token time
        self._generated: deque[tuple[float, int]] = deque()  # (time, tokens generated) per iteration
        self._generated_total = 0  # in _generated
        self._started = time.perf_counter()
        # since the last log line
        self._log_start = time.perf_counter()
        self._log = dict.fromkeys(("prefill", "decode", "queries", "hits", "preemptions", "finished"), 0)
        self._active = False  # anything happened since the last line

    # ---- per loop iteration ---------------------------------------------------------------------
    def update(
        self,
        stats: EngineStats,
        step: StepStats | None,
        items: list[tuple[RequestOutput, int | None]],
        timed_out: set[str],
    ) -> None:
        """`stats`: the engine's snapshot after this iteration; `step`: its step's counters (None: no step)."""
        now = time.perf_counter()
        m, log = self.metrics, self._log
        if step is not None:
            log["prefill"] += step.num_prefill_tokens
            log["decode"] += step.num_decode_tokens
            self._active = True
            if m is not None:
                m.prefill_tokens_computed.inc(step.num_prefill_tokens)
        counts = (
            stats.num_prefix_query_tokens,
            stats.num_prefix_hit_tokens,
            stats.num_preemptions,
            stats.num_short_first_steps,
        )
        dq, dh, dp, ds = (new - old for new, old in zip(counts, self._seen))
        self._seen = counts
        log["queries"] += dq
        log["hits"] += dh
        log["preemptions"] += dp
        if dq:
            self._window.append((now, dq, dh))
            self._window_q += dq
            self._window_h += dh
        while self._window and now - self._window[0][0] > self.hit_rate_window and len(self._window) > 1:
            _, q, h = self._window.popleft()
            self._window_q -= q
            self._window_h -= h
        if m is not None:
            if dq:
                m.prefix_cache_queries.inc(dq)
                m.prefix_cache_hits.inc(dh)
                m.hit_rate.set(self._window_h / self._window_q)
            if dp:
                m.preemptions.inc(dp)
            if ds:
                m.short_first_steps.inc(ds)
            m.num_running.set(stats.num_running)
            m.num_waiting.set(stats.num_waiting)
            m.kv_usage.set(stats.kv_usage)
            m.num_used_tokens.set(stats.num_used_pages * stats.page_size)
        self._update_throughput(now, items)
        for out, status in items:
            self._on_output(out, status, now, out.request_id in timed_out)

    def _update_throughput(self, now: float, items: list[tuple[RequestOutput, int | None]]) -> None:
        """gen_throughput: tokens generated over the last THROUGHPUT_WINDOW_S seconds (SGLang's gauge)."""
        generated = sum(len(c.new_token_ids) for out, _ in items for c in out.outputs)
        if generated:
            self._generated.append((now, generated))
            self._generated_total += generated
        while self._generated and now - self._generated[0][0] > THROUGHPUT_WINDOW_S:
            self._generated_total -= self._generated.popleft()[1]
        if self.metrics is not None:
            span = min(THROUGHPUT_WINDOW_S, max(now - self._started, 1e-3))
            self.metrics.gen_throughput.set(self._generated_total / span)

    def _on_output(self, out: RequestOutput, status: int | None, now: float, timed_out: bool) -> None:
        m = self.metrics
        new = sum(len(c.new_token_ids) for c in out.outputs)
        total = out.completion_tokens
        # a request's prompt counts once its prefill completed: at its first token, or when it ends
        # without one (max_new_tokens=0)
        prefilled = (new and new == total) or (
            out.finished and total == 0 and out.finish_reason in ("stop", "length")
        )
        if m is not None:
            if new:
                m.generation_tokens.inc(new)
            if prefilled:
                m.prompt_tokens.inc(out.prompt_tokens)
        last = self._last_token.setdefault(out.request_id, {})
        for c in out.outputs:
            if c.new_token_ids:
                prev = last.get(c.index)
                if prev is not None and m is not None:
                    m.itl.observe(now - prev)
                last[c.index] = now
        if out.finished:
            del self._last_token[out.request_id]
            self._log["finished"] += 1
            self._active = True
            if m is not None:
                m.observe_finished(out, finish_label(out, status, timed_out))

    # ---- the stats log line ---------------------------------------------------------------------
    def idle_wait(self) -> float | None:
        """Seconds an idle engine thread may sleep before a pending log line is due (None: forever)."""
        if self.log_interval <= 0 or not self._active:
            return None
        return max(self._log_start + self.log_interval - time.perf_counter(), 0.0)

    def maybe_log(self, engine: Engine) -> None:
        if self.log_interval <= 0:
            return
        now = time.perf_counter()
        elapsed = now - self._log_start
        if elapsed < self.log_interval:
            return
        log = self._log
        if self._active:
            stats = engine.stats()
            hit_rate = f"{100.0 * log['hits'] / log['queries']:.1f}%" if log["queries"] else "-"
            logger.info(
                "engine: prefill %.1f tok/s, decode %.1f tok/s, %d running, %d queued, KV usage %.1f%%, "
                "prefix cache hit rate %s, %d finished, %d preempted",
                log["prefill"] / elapsed,
                log["decode"] / elapsed,
                stats.num_running,
                stats.num_waiting,
                100.0 * stats.kv_usage,
                hit_rate,
                log["finished"],
                log["preemptions"],
            )
        self._log = dict.fromkeys(log, 0)
        self._log_start = now
        self._active = engine.has_unfinished()
