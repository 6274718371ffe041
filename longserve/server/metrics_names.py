"""--metrics-names: the same Prometheus series under vLLM's names (vllm:*) or SGLang's (sglang:*), so that
their published Grafana dashboards work unchanged against longserve.

The metrics are kept once, under longserve's own names (metrics.py); `renamed_registry` exposes them
renamed at scrape time. A series whose meaning matches one of theirs takes its name (or several: vLLM's
dashboards ask for vllm:gpu_cache_usage_perc before V1 and vllm:kv_cache_usage_perc after); the label
names already are theirs (`model_name`, `finished_reason`). A series they have no name for keeps its
longserve: name, so nothing is lost and nothing squats on their namespace. vLLM's V0 dashboards also chart
swapped requests and the CPU KV cache; longserve preempts by recompute and keeps no CPU cache, so those
are served as constant zeros, as vLLM reported them with no swap space.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

PREFIX = "longserve:"

# longserve name (without the prefix) -> the names it is served under
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prefix_cache_hit_rate": ("vllm:gpu_prefix_cache_hit_rate",),
    "prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "num_preemptions": ("vllm:num_preemptions",),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "request_finished": ("vllm:request_success",),
    "time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    # vLLM V1's inter-token latency; V0 (and its dashboards) called the same histogram time_per_output_token
    "inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "request_time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds",),
    "e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "request_generation_tokens": ("vllm:request_generation_tokens",),
    "request_max_num_generation_tokens": ("vllm:request_max_num_generation_tokens",),
}
VLLM_CONSTANTS: dict[str, str] = {  # gauge -> what it means in vLLM; always 0 here (see the docstring)
    "vllm:num_requests_swapped": "Requests swapped to CPU (longserve preempts by recompute: always 0)",
    "vllm:cpu_cache_usage_perc": "CPU KV-cache usage (longserve keeps no CPU KV cache: always 0)",
}

SGLANG_NAMES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("sglang:num_running_reqs",),
    "num_requests_waiting": ("sglang:num_queue_reqs",),
    "kv_cache_usage_perc": ("sglang:token_usage",),
    "num_used_tokens": ("sglang:num_used_tokens",),
    "prefix_cache_hit_rate": ("sglang:cache_hit_rate",),
    "gen_throughput": ("sglang:gen_throughput",),
    "prompt_tokens": ("sglang:prompt_tokens",),
    "generation_tokens": ("sglang:generation_tokens",),
    "prefix_cache_hits": ("sglang:cached_tokens",),
    "time_to_first_token_seconds": ("sglang:time_to_first_token_seconds",),
    "inter_token_latency_seconds": (
        "sglang:inter_token_latency_seconds",
        "sglang:time_per_output_token_seconds",
    ),
    "e2e_request_latency_seconds": ("sglang:e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("sglang:queue_time_seconds",),
}

NAMES: dict[str, tuple[dict[str, tuple[str, ...]], dict[str, str]]] = {
    "vllm": (VLLM_NAMES, VLLM_CONSTANTS),
    "sglang": (SGLANG_NAMES, {}),
}


class RenamedCollector:
    """Every family of `source`, renamed after `names` (unnamed ones as they are), plus `constants`."""

    def __init__(
        self,
        source: CollectorRegistry,
        names: dict[str, tuple[str, ...]],
        constants: dict[str, str],
        model_name: str,
    ) -> None:
        self.source, self.names, self.constants, self.model_name = source, names, constants, model_name

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            targets = self.names.get(family.name.removeprefix(PREFIX), (family.name,))
            for target in targets:
                renamed = Metric(target, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    suffix = sample.name[len(family.name) :]  # _total, _bucket, _sum, _count or ""
                    renamed.add_sample(
                        target + suffix, sample.labels, sample.value, sample.timestamp, sample.exemplar
                    )
                yield renamed
        for name, doc in self.constants.items():
            constant = Metric(name, doc, "gauge")
            constant.add_sample(name, {"model_name": self.model_name}, 0.0)
            yield constant


def renamed_registry(source: CollectorRegistry, names: str, model_name: str) -> CollectorRegistry:
    """The registry /metrics renders: `source` itself for longserve's names, else a renamed view of it."""
    if names == "longserve":
        return source
    if names not in NAMES:
        raise ValueError(f"metrics names must be longserve, vllm or sglang; got {names!r}")
    mapping, constants = NAMES[names]
    view = CollectorRegistry(auto_describe=False)
    view.register(RenamedCollector(source, mapping, constants, model_name))
    return view
