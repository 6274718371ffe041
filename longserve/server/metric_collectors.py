"""The /metrics series read at scrape time rather than updated as requests go (server/metrics.py registers them):
GPU memory and utilisation through NVML (pynvml / nvidia-ml-py, where it loads; absent otherwise), and the prefix
token cache's counters (the cache counts on the tokenizer threads)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from longserve.server.metrics_names import PREFIX

__all__ = ["NvmlCollector", "TokenizerCacheCollector"]


class NvmlCollector:
    """GPU memory used/total and utilisation per visible GPU, read through NVML at scrape time."""

    def __init__(self, nvml: Any, model_name: str) -> None:
        self.nvml = nvml
        self.model_name = model_name
        self.handles = self._visible_handles()

    @classmethod
    def create(cls, model_name: str) -> NvmlCollector | None:
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            collector = cls(pynvml, model_name)
        except Exception:  # no package, no driver, no GPU: the GPU series are simply absent
            return None
        return collector if collector.handles else None

    def _visible_handles(self) -> list[tuple[str, Any]]:
        nvml = self.nvml
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            return [(str(i), nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(nvml.nvmlDeviceGetCount())]
        handles = []
        for i, dev in enumerate(d.strip() for d in visible.split(",") if d.strip()):
            get = nvml.nvmlDeviceGetHandleByIndex if dev.isdigit() else nvml.nvmlDeviceGetHandleByUUID
            handles.append((str(i), get(int(dev) if dev.isdigit() else dev)))
        return handles

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["model_name", "gpu"]
        used = GaugeMetricFamily(PREFIX + "gpu_memory_used_bytes", "GPU memory in use (NVML)", labels=labels)
        total = GaugeMetricFamily(PREFIX + "gpu_memory_total_bytes", "GPU memory (NVML)", labels=labels)
        util = GaugeMetricFamily(
            PREFIX + "gpu_utilization_perc",
            "GPU busy share over NVML's last sample period; 1 means 100 percent",
            labels=labels,
        )
        for index, handle in self.handles:
            try:
                mem = self.nvml.nvmlDeviceGetMemoryInfo(handle)
                rates = self.nvml.nvmlDeviceGetUtilizationRates(handle)
            except Exception:  # a GPU that stops answering drops out of this scrape only
                continue
            used.add_metric([self.model_name, index], float(mem.used))
            total.add_metric([self.model_name, index], float(mem.total))
            util.add_metric([self.model_name, index], rates.gpu / 100.0)
        yield from (used, total, util)


class TokenizerCacheCollector:
    """The prefix token cache's counters, read at scrape time (the cache counts on the tokenizer threads)."""

    def __init__(self, cache: Any, model_name: str) -> None:
        self.cache, self.model_name = cache, model_name

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, doc, value in (
            ("tokenizer_prefix_cache_hits", "Long prompts tokenized by re-using a cached prompt's tokens",
             self.cache.hits),
            ("tokenizer_prefix_cache_misses", "Long prompts tokenized whole (then kept)", self.cache.misses),
            ("tokenizer_prefix_cache_reused_tokens", "Prompt tokens taken from the cache, not tokenized",
             self.cache.reused_tokens),
        ):  # fmt: skip
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
