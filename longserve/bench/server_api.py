"""Blocking calls to a server's admin endpoints for the serving benchmark (stdlib urllib only): reachability,
/tokenize and /detokenize, cache flush, /server_info, and Prometheus /metrics scraped before and after a run
(longserve's `longserve:`, vLLM's `vllm:` and SGLang's `sglang:` names) into server-side deltas."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from typing import Any

METRIC_PREFIXES = ("longserve:", "vllm:", "sglang:")
# candidate names (prefix and `_total` stripped), the first present wins
_HITS = ("prefix_cache_hits", "gpu_prefix_cache_hits", "cached_tokens")
_QUERIES = ("prefix_cache_queries", "gpu_prefix_cache_queries")
_PROMPT = ("prompt_tokens",)
_GENERATED = ("generation_tokens", "completion_tokens")
_REQUESTS = ("request_success", "request_finished", "num_requests", "e2e_request_latency_seconds_count")
_TTFT = "time_to_first_token_seconds"


class ServerError(RuntimeError):
    """The server could not be reached, or refused an admin call; the message names the URL."""


class Server:
    """A base URL plus headers (API key); `get`/`post` return parsed JSON or raise ServerError."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout

    def _open(self, path: str, body: Any = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self.headers, **({"Content-Type": "application/json"} if data is not None else {}))
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ServerError(f"cannot reach the server at {self.base_url}: {reason}") from None

    def request(self, path: str, body: Any = None) -> Any:
        status, raw = self._open(path, body)
        if status >= 400:
            text = raw.decode(errors="replace")[:300]
            raise ServerError(f"{self.base_url}{path} answered HTTP {status}: {text}")
        return json.loads(raw) if raw.strip() else None

    def check_reachable(self) -> None:
        """Any HTTP answer (even a 404) proves the server is up; a connection error raises ServerError."""
        self._open("/health")

    def try_json(self, *paths: str) -> Any:
        """The JSON of the first GET path that answers 200, else None."""
        for path in paths:
            try:
                return self.request(path)
            except (ServerError, ValueError):
                continue
        return None

    def flush_cache(self, backend: str) -> str:
        """Empty the server's prefix cache: POST /flush_cache (longserve, SGLang) or /reset_prefix_cache
        (vLLM, which serves it only with VLLM_SERVER_DEV_MODE=1), vLLM's first for backend vllm. The path that
        answered 2xx; ServerError naming every answer when neither did."""
        paths = ["/flush_cache", "/reset_prefix_cache"]
        if backend == "vllm":
            paths.reverse()
        answers = []
        for path in paths:
            status, raw = self._open(path, {})
            if status < 300:
                return path
            answers.append(f"POST {path}: HTTP {status} {raw.decode(errors='replace')[:120].strip()}")
        raise ServerError(
            f"could not flush the prefix cache of {self.base_url} ({'; '.join(answers)}); a vLLM server "
            "serves POST /reset_prefix_cache only when started with VLLM_SERVER_DEV_MODE=1"
        )

    def server_info(self) -> dict[str, Any]:
        """A few facts about the server for the report (model, chunk size, page size, version)."""
        models = self.try_json("/v1/models") or {}
        data = models.get("data") if isinstance(models, dict) else None
        card = data[0] if data and isinstance(data[0], dict) else {}
        # vLLM's /server_info (dev mode only) dumps its config as text and runs collect_env: slow, and none
        # of the keys below; its model card says owned_by "vllm"
        info = (
            {} if card.get("owned_by") == "vllm" else self.try_json("/server_info", "/get_server_info") or {}
        )
        engine = info.get("engine_config") or info
        keys = ("model", "model_path", "chunked_prefill_size", "page_size", "max_total_tokens", "dtype")
        out = {k: engine[k] for k in keys if isinstance(engine, dict) and k in engine}
        if "version" in info:
            out["version"] = info["version"]
        elif isinstance(version := self.try_json("/version"), dict) and "version" in version:
            out["version"] = version["version"]
        if card:
            out["served_model"] = card.get("id")
            if card.get("max_model_len"):
                out["max_model_len"] = card["max_model_len"]
        return out

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        body = {"prompt": text, "add_special_tokens": add_special_tokens}
        return list(self.request("/tokenize", body)["tokens"])

    def detokenize(self, ids: list[int]) -> str:
        out = self.request("/detokenize", {"tokens": ids})
        return out.get("prompt", out.get("text", ""))

    def scrape_metrics(self) -> dict[str, float] | None:
        """Sample values of /metrics summed over label sets, keyed by name without the engine prefix and
        `_total`; None when the server has no Prometheus endpoint."""
        try:
            status, raw = self._open("/metrics")
        except ServerError:
            return None
        if status != 200:
            return None
        try:
            return parse_metrics(raw.decode(errors="replace"))
        except ValueError:
            return None


def parse_metrics(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(METRIC_PREFIXES):
            continue
        for sample in family.samples:
            name = sample.name.split(":", 1)[1]
            if name.endswith(("_bucket", "_created")) or math.isnan(sample.value):
                continue
            name = name.removesuffix("_total")
            out[name] = out.get(name, 0.0) + sample.value
    return out


def _first(values: dict[str, float], names: tuple[str, ...]) -> float | None:
    return next((values[n] for n in names if n in values), None)


def metrics_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """What the server itself counted during the run; None when it exposes no metrics."""
    if before is None or after is None:
        return None
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    out: dict[str, Any] = {}
    hits, queries = _first(delta, _HITS), _first(delta, _QUERIES)
    prompt = _first(delta, _PROMPT)
    if queries is None and hits is not None and "cached_tokens" in delta:
        queries = prompt  # SGLang: cached tokens over prompt tokens
    if hits is not None and queries:
        out["prefix_cache_hit_rate"] = hits / queries
        out["prefix_cache_hits"], out["prefix_cache_queries"] = hits, queries
    if prompt is not None:
        out["prompt_tokens"] = prompt
    if (generated := _first(delta, _GENERATED)) is not None:
        out["generation_tokens"] = generated
    if (requests := _first(delta, _REQUESTS)) is not None:
        out["requests"] = requests
    count = delta.get(_TTFT + "_count")
    if count:
        out["ttft_mean_s"] = delta[_TTFT + "_sum"] / count
        out["ttft_count"] = count
    if "cache_hit_rate" in after and "prefix_cache_hit_rate" not in out:
        out["prefix_cache_hit_rate_gauge"] = after["cache_hit_rate"]  # SGLang's gauge (recent window)
    return out
