"""The one option table of every command (OPTIONS): each option's flags in longserve's/SGLang's and vLLM's
spellings, the EngineConfig or ServerConfig field it sets, its help and its value parser. server/args.py
builds the parsers, env vars and YAML keys from it and resolves them onto the configs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from longserve.config import (
    CONVERTS,
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPE_ALIASES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    RUNNERS,
)
from longserve.config_hybrid import (
    KERNEL_CHOICES,
    MAMBA_CACHE_MODES,
    MAMBA_SCHEDULER_STRATEGIES,
    MAMBA_SSM_DTYPES,
)
from longserve.platform import attention_backend_help
from longserve.server.config import METRICS_NAMES

_DTYPE_ALIASES = {
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "float": "float32",
    "fp32": "float32",
}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


class _BadValue(argparse.ArgumentTypeError, ValueError):
    """A flag value refused with a message: argparse shows it (ArgumentTypeError), env/YAML parsing too."""


def _schedule_policy(value: str) -> str:
    """Ours, or SGLang's lpm (longest prefix match first: cache hits go first), which short-first serves."""
    value = value.lower()
    value = {"lpm": "short-first"}.get(value, value)
    if value not in ("short-first", "fcfs"):
        raise _BadValue(
            f"{value!r}: expected short-first, fcfs, or lpm (SGLang's name; means short-first here)"
        )
    return value


def _whitespace_limit(value: str) -> int | None:
    """An integer >= 0, or none/unlimited (no bound)."""
    if value.strip().lower() in ("none", "unlimited"):
        return None
    try:
        limit = int(value)
    except ValueError:
        limit = -1
    if limit < 0:
        raise _BadValue(f"{value!r}: expected an integer >= 0 (0: compact JSON) or none (no bound)")
    return limit


def _registry_names(module: str, registry: str) -> tuple[str, ...]:
    import importlib

    return tuple(sorted(getattr(importlib.import_module(module), registry)))


def _dtype(value: str) -> str:
    value = _DTYPE_ALIASES.get(value.lower(), value.lower())
    if value not in DTYPES:
        raise _BadValue(f"{value!r}: expected auto, float32 (float), float16 (half) or bfloat16")
    return value


def _kv_cache_dtype(value: str) -> str:
    """vLLM's and SGLang's --kv-cache-dtype spellings of the formats longserve stores."""
    value = value.strip().lower()
    if value not in KV_CACHE_DTYPES and value not in KV_CACHE_DTYPE_ALIASES:
        raise _BadValue(
            f"{value!r}: expected auto, fp8 or fp8_e4m3 (fp8_e5m2, fp4 and int8 caches are not supported)"
        )
    return value


def _convert_task(value: str) -> str:
    """--convert's values, or vLLM's older --task ones (generate: not a pooling model)."""
    value = value.lower()
    value = {"embedding": "embed", "score": "classify", "generate": "none"}.get(value, value)
    if value not in CONVERTS:
        raise _BadValue(f"{value!r}: expected auto, embed, classify (score) or generate")
    return value


@dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]  # longserve/SGLang spelling first, then vLLM's and others'
    target: str  # "engine.<EngineConfig field>" or "server.<ServerConfig field>"
    help: str
    type: Callable[[str], Any] | None = str  # None: a switch that stores `const`
    const: Any = True
    choices: tuple[str, ...] | None = None
    nargs: str | None = None
    default_help: str | None = None  # what the default means, where the dataclass default (None) says nothing

    @property
    def env_names(self) -> list[str]:
        return ["LONGSERVE_" + f.lstrip("-").upper().replace("-", "_") for f in self.flags]

    @property
    def keys(self) -> set[str]:
        return {f.lstrip("-").replace("-", "_") for f in self.flags}


E, S = "engine.", "server."
OPTIONS: tuple[Option, ...] = (
    Option(("--model-path", "--model"), E + "model", "Hugging Face checkpoint directory",
           default_help="the small built-in demo model"),
    Option(("--tokenizer-path", "--tokenizer"), E + "tokenizer", "tokenizer directory",
           default_help="the model's"),
    Option(("--chat-template",), E + "chat_template",
           "chat template for chat requests instead of the tokenizer's: a file, or the Jinja text itself "
           "(the server's own, trusted; a request cannot bring one)", default_help="the tokenizer's"),
    Option(("--trust-remote-code",), E + "trust_remote_code",
           "accepted for vLLM/SGLang launch lines; no effect: longserve runs only its own model code, never "
           "a checkpoint's Python (said in the start-up log)", None),
    Option(("--host",), S + "host", "address to bind; 0.0.0.0 listens on every interface"),
    Option(("--port",), S + "port", "TCP port", int),
    Option(("--served-model-name",), S + "served_model_name", "model name(s) clients send", nargs="+",
           default_help="the model path"),
    Option(("--api-key",), S + "api_key", "require `Authorization: Bearer KEY` (all but /health)",
           default_help="no key"),
    Option(("--device",), E + "device", "where the model runs", choices=DEVICES),
    Option(("--dtype",), E + "dtype", "weights/activations: auto, float32, float16 (half), bfloat16", _dtype),
    Option(("--load-format",), E + "load_format", "dummy: random weights", choices=LOAD_FORMATS),
    Option(("--seed", "--random-seed"), E + "seed", "seed of dummy weights and unseeded sampling", int),
    Option(("--tp-size", "--tensor-parallel-size", "--tp"), E + "tp_size",
           "tensor-parallel ranks, one process each (must divide the attention heads)", int),
    Option(("--ep-size", "--expert-parallel-size", "--ep"), E + "ep_size",
           "MoE models: expert-parallel groups among the tensor-parallel ranks, each holding 1/N of the "
           "experts whole (must divide --tp-size)", int),
    Option(("--enable-expert-parallel",), E + "enable_expert_parallel",
           "MoE models: place whole experts on the tensor-parallel ranks (--ep-size = --tp-size)", None),
    Option(("--dp-size", "--data-parallel-size"), E + "dp_size",
           "data-parallel replicas: only 1 (data parallelism is not supported: run several servers behind a "
           "load balancer)", int),
    Option(("--nnodes",), E + "nnodes", "nodes the tensor-parallel ranks span", int),
    Option(("--node-rank",), E + "node_rank", "this node's index (node 0 serves HTTP)", int),
    Option(("--dist-init-addr",), E + "dist_init_addr", "HOST:PORT of node 0's rendezvous (multi-node)",
           default_help="127.0.0.1 and a free port (one node)"),
    Option(("--mem-fraction-static", "--gpu-memory-utilization"), E + "mem_fraction_static",
           "share of device memory for weights + KV pool (CPU: of RAM, pool capped at 4 GiB)", float),
    Option(("--swap-space",), E + "swap_space",
           "vLLM's CPU swap space (GiB): accepted, no effect; a preempted request is recomputed instead (said "
           "in the start-up log)", float, default_help="none"),
    Option(("--max-total-tokens",), E + "max_total_tokens", "KV pool size in tokens (overrides the fraction)",
           int, default_help="sized by --mem-fraction-static"),
    Option(("--page-size", "--block-size"), E + "page_size", "tokens per KV page", int),
    Option(("--context-length", "--max-model-len"), E + "context_length", "longest prompt + output", int,
           default_help="the model's max_position_embeddings, within the KV pool"),
    Option(("--chunked-prefill-size", "--max-num-batched-tokens"), E + "chunked_prefill_size",
           "prompt tokens of one engine step (long prompts are prefilled in chunks of it; the step's decodes "
           "ride on top)", int),
    Option(("--lone-prefill-chunk-size",), E + "lone_prefill_chunk_size",
           "prompt tokens of a step while one request's prompt is all the work (no decodes, nothing waiting); "
           "at least --chunked-prefill-size (equal: off)", int,
           default_help="32768 for integer weights (GPTQ, AWQ, W4A16/W8A16), dequantized once a step, on a GPU; "
           "else --chunked-prefill-size"),
    Option(("--max-prefill-chunk",), E + "max_prefill_chunk", "cap on one request's share of a step", int,
           default_help="the whole step budget"),
    Option(("--max-running-requests", "--max-num-seqs"), E + "max_running_requests", "concurrent requests",
           int),
    Option(("--max-logprobs",), E + "max_logprobs",
           "most top logprobs a request may ask for, per token and per prompt position (-1: the vocabulary)", int),
    Option(("--schedule-policy", "--scheduling-policy"), E + "schedule_policy",
           "short-first (default: a request with little left to compute goes before the rest of a long "
           "prefill; SGLang's lpm means it too) or fcfs", _schedule_policy),
    Option(("--enable-prefix-caching",), E + "enable_prefix_caching", "radix prefix cache on (default)",
           None),
    Option(("--disable-radix-cache", "--no-enable-prefix-caching"), E + "enable_prefix_caching",
           "radix prefix cache off", None, const=False),
    Option(("--attention-backend",), E + "attention_backend", attention_backend_help()),
    Option(("--disable-cuda-graph", "--enforce-eager"), E + "enforce_eager", "no CUDA graphs for decode",
           None),
    Option(("--enable-overlap-schedule", "--async-scheduling"), E + "overlap_schedule",
           "plan each step while the one before it runs (default: on a GPU at one rank)", None),
    Option(("--disable-overlap-schedule", "--no-async-scheduling"), E + "overlap_schedule",
           "read each step's tokens before planning the next", None, const=False),
    Option(("--cuda-graph-max-bs",), E + "cuda_graph_max_bs", "largest decode batch replayed as a graph",
           int),
    Option(("--cuda-graph-max-prefill-tokens",), E + "cuda_graph_max_prefill_tokens",
           "a lone prefill chunk up to this many tokens replays a graph (0: off)", int),
    Option(("--piecewise-cuda-graph-max-tokens",), E + "piecewise_cuda_graph_max_tokens",
           "a step of up to this many tokens replays its layers' dense parts as graphs, attention eager (0: off)",
           int),
    Option(("--piecewise-cuda-graph-tokens",), E + "piecewise_cuda_graph_tokens",
           "the step sizes (tokens, ascending) the piecewise graphs are captured at; a step runs as the smallest "
           "that holds it", int, nargs="+", default_help="64 apart up to 1024, then an eighth of each power of two"),
    Option(("--tp-overlap-min-tokens",), E + "tp_overlap_min_tokens",
           "tp > 1: a step of this many tokens runs as two halves whose all-reduces overlap (0: off)", int),
    Option(("--max-queued-requests",), S + "max_queued_requests", "waiting requests before 503s", int),
    Option(("--request-timeout",), S + "request_timeout", "seconds a request may take, then aborted", float,
           default_help="no limit"),
    Option(("--shutdown-timeout",), S + "shutdown_timeout",
           "on SIGTERM/SIGINT: seconds the requests in flight get to finish before they are ended with an "
           "error", float),
    Option(("--log-requests",), S + "log_requests",
           "log one line per finished request (token counts and timings; never the prompt)", None),
    Option(("--log-stats-interval",), S + "log_stats_interval",
           "seconds between engine stats log lines (tokens/s, queue, KV usage, hit rate); 0: off", float),
    Option(("--step-log",), S + "step_log",
           "write one JSON line per engine loop iteration to this file: its step's tokens, host time and "
           "time waiting for the device, idle time, commands, hand-out (where a workload's time goes)", str,
           default_help="off"),
    Option(("--enable-metrics",), S + "enable_metrics", "Prometheus metrics at GET /metrics (default)", None),
    Option(("--disable-metrics",), S + "enable_metrics", "no /metrics endpoint", None, const=False),
    Option(("--log-level",), S + "log_level", "logging level", choices=("debug", "info", "warning", "error")),
    Option(("--tokenizer-workers",), S + "tokenizer_workers", "threads that tokenize off the event loop",
           int),
    Option(("--tokenizer-prefix-cache-size",), S + "tokenizer_prefix_cache_size",
           "long prompts kept with their token ids: a conversation's next turn tokenizes only its new text; "
           "0: off", int),
    Option(("--runner",), E + "runner",
           "generate, or pooling (embeddings, rerank scores); auto: pooling when the checkpoint is an "
           "embedding model (sentence-transformers files) or a *ForSequenceClassification reranker",
           choices=RUNNERS),
    Option(("--is-embedding",), E + "runner", "serve a pooling model (SGLang's flag; --runner pooling)", None,
           const="pooling"),
    Option(("--convert", "--task"), E + "convert",
           "what a pooling model yields: embed, classify (rerank/score); auto: from the checkpoint. vLLM's "
           "--task embed|embedding|classify|score|generate means the same", _convert_task),
    Option(("--hf-overrides", "--hf_overrides"), E + "hf_overrides",
           "JSON object set on the model's HF config, e.g. Qwen3-Reranker's '{\"architectures\": "
           "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", \"yes\"]}'",
           default_help="none"),
    Option(("--quantization",), E + "quantization",
           "the checkpoint's weight format, vLLM's names: gptq, awq, compressed-tensors, fp8 (checked against "
           "config.json's quantization_config); fp8 on a float checkpoint quantizes it per channel while "
           "loading; with --load-format dummy, random weights in that format",
           default_help="config.json's quantization_config"),
    Option(("--kv-cache-dtype",), E + "kv_cache_dtype",
           "the KV cache's storage: auto (the model's dtype), fp8 or fp8_e4m3 (e4m3 with per-layer scales, "
           "from the checkpoint's k_scale/v_scale or 1.0): twice the tokens in the same memory",
           _kv_cache_dtype),
    Option(("--mamba-ssm-cache-dtype", "--mamba-ssm-dtype"), E + "mamba_ssm_cache_dtype",
           "a hybrid model's (Qwen3.5) linear-attention state: float32, bfloat16 (half the memory), float16, or "
           "auto (--mamba-cache-dtype's, else the model's dtype)", choices=MAMBA_SSM_DTYPES),
    Option(("--mamba-cache-dtype",), E + "mamba_cache_dtype",
           "a hybrid model's conv state (its last inputs) and, unless --mamba-ssm-cache-dtype says otherwise, its "
           "linear-attention state: float32, bfloat16, float16 or auto (the model's dtype; vLLM's)",
           choices=MAMBA_SSM_DTYPES),
    Option(("--mamba-cache-mode",), E + "mamba_cache_mode",
           "with prefix caching, a hybrid model's (Qwen3.5) prefix cache: align (linear-attention states saved "
           "on pages near a prompt's last full page and where it leaves a cached path) or none "
           "(no state kept: nothing shared)", choices=MAMBA_CACHE_MODES),
    Option(("--max-mamba-cache-size",), E + "max_mamba_cache_size",
           "a hybrid model's state rows at most, running requests' slots and prefix-cache checkpoints together "
           "(SGLang's)", int, default_help="what half the memory the weights leave holds"),
    Option(("--mamba-full-memory-ratio",), E + "mamba_full_memory_ratio",
           "a hybrid model's state rows may take the share r / (1 + r) of the memory the weights leave, the KV "
           "pool the rest (SGLang's; its default 0.9 gives the states 47%%)", float,
           default_help="1: half"),
    Option(("--mamba-scheduler-strategy",), E + "mamba_scheduler_strategy",
           "SGLang's hybrid-model radix-cache strategy: accepted, no effect (longserve's hybrid prefix cache keeps "
           "its own checkpoints: --mamba-cache-mode; said in the start-up log)", choices=MAMBA_SCHEDULER_STRATEGIES),
    Option(("--mamba-track-interval",), E + "mamba_track_interval",
           "with a hybrid model's prefix cache, a decoding request's linear-attention state is checkpointed "
           "every this many tokens (on a page; SGLang's flag), so a conversation's next turn resumes inside the "
           "last answer", int),
    *(
        Option((flag,), E + flag[2:].replace("-", "_"),
               "SGLang's kernel choice for a hybrid model's linear attention: accepted, no effect (longserve runs its "
               "own Triton kernels; said in the start-up log)", choices=KERNEL_CHOICES[flag[2:].replace("-", "_")])
        for flag in ("--mamba-backend", "--linear-attn-backend", "--linear-attn-decode-backend",
                     "--linear-attn-prefill-backend")
    ),
    Option(("--strict-model-name",), S + "strict_model_name",
           "answer 404 to a `model` this server does not serve (vLLM); by default any name is served, as "
           "SGLang does (\"default\" always is)", None),
    Option(("--metrics-names",), S + "metrics_names",
           "the Prometheus series' names: longserve (longserve:*), vllm (vllm:*, for vLLM's Grafana "
           "dashboards) or sglang (sglang:*)", choices=METRICS_NAMES),
    Option(("--tool-call-parser",), S + "tool_call_parser",
           "the syntax of the model's tool calls (vLLM's and SGLang's names): hermes/qwen/qwen25 "
           "(<tool_call>), llama3_json/llama3, mistral, qwen3_coder (Qwen3-Coder, Qwen3.5: <tool_call>"
           "<function=...>); read into message.tool_calls, and the syntax tool_choice required/named is "
           "forced in",
           choices=_registry_names("longserve.structured.tool_parsers", "TOOL_CALL_PARSERS"),
           default_help="none: tool_choice required/named use vLLM's JSON list of calls"),
    Option(("--enable-auto-tool-choice",), S + "enable_auto_tool_choice",
           "allow tool_choice auto (the default when a request has tools): the model decides whether to "
           "call a tool (needs --tool-call-parser)", None),
    Option(("--reasoning-parser",), S + "reasoning_parser",
           "split the model's <think> section into reasoning_content; constrained output starts after it",
           choices=_registry_names("longserve.structured.reasoning", "REASONING_PARSERS"),
           default_help="none"),
    Option(("--structured-outputs-max-whitespace",), E + "structured_outputs_max_whitespace",
           "most whitespace characters between JSON tokens of a constrained output (0: compact JSON; none: "
           "any amount)", _whitespace_limit),
    Option(("--constrained-json-disable-any-whitespace",), E + "structured_outputs_max_whitespace",
           "compact JSON in constrained outputs (SGLang's flag; --structured-outputs-max-whitespace 0)", None,
           const=0),
)  # fmt: skip
_BY_KEY = {key: opt for opt in OPTIONS for key in opt.keys}
