"""ServerConfig: the HTTP side of `longserve serve` (the engine's settings are longserve.config.EngineConfig),
resolved from the same option table (server/options.py) and refused with the same ConfigError."""

from __future__ import annotations

import os
from dataclasses import dataclass

from longserve.config import ConfigError

METRICS_NAMES = ("longserve", "vllm", "sglang")  # whose names /metrics serves (server/metrics_names.py)


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side settings of `longserve serve`; the engine's live in EngineConfig."""

    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 30000  # SGLang's default port
    api_key: str | None = None  # when set, every endpoint but /health needs `Authorization: Bearer KEY`
    served_model_name: tuple[str, ...] = ()  # names clients may ask for; empty: the model path
    max_queued_requests: int = 1024  # requests waiting for admission; more are answered 503
    request_timeout: float | None = None  # seconds from arrival to the last token; None: no limit
    shutdown_timeout: float = 30.0  # on SIGTERM/SIGINT, seconds the requests in flight get to finish
    log_requests: bool = False  # one log line per finished request (counts and timings, never the prompt)
    log_level: str = "info"
    enable_metrics: bool = True  # GET /metrics in Prometheus text format
    log_stats_interval: float = 10.0  # seconds between engine stats log lines; 0: none
    step_log: str | None = None  # a JSON line per engine loop iteration to this file (server/step_log.py)
    tokenizer_workers: int = 2  # threads that tokenize and render chat templates off the event loop
    # long prompts kept with their token ids, so that a conversation's next turn tokenizes only its new text
    # (longserve.tokenization.prefix_token_cache); 0: off
    tokenizer_prefix_cache_size: int = 64
    strict_model_name: bool = False  # 404 for a `model` not served (vLLM); else any name is served (SGLang)
    metrics_names: str = "longserve"  # /metrics series under longserve's, vLLM's or SGLang's names
    # tool calls: the syntax the model writes them in (structured.tool_parsers: vLLM's and SGLang's names);
    # tool_choice "auto" also needs enable_auto_tool_choice, as in vLLM
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None  # <think> sections -> reasoning_content (structured.reasoning)

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str, setting: str) -> None:
            if not ok:
                raise ConfigError(msg, setting)

        need(
            isinstance(self.port, int) and 0 <= self.port <= 65535,
            f"port must be an integer in [0, 65535]; got {self.port!r}",
            "port",
        )
        need(
            self.step_log is None or os.path.isdir(os.path.dirname(os.path.abspath(self.step_log))),
            f"step_log: the folder of {self.step_log!r} does not exist",
            "step_log",
        )
        need(
            self.max_queued_requests >= 1,
            f"max_queued_requests must be >= 1; got {self.max_queued_requests}",
            "max_queued_requests",
        )
        need(
            self.request_timeout is None or self.request_timeout > 0,
            f"request_timeout must be > 0 seconds; got {self.request_timeout}",
            "request_timeout",
        )
        need(
            self.shutdown_timeout >= 0,
            f"shutdown_timeout must be >= 0 seconds; got {self.shutdown_timeout}",
            "shutdown_timeout",
        )
        need(
            self.log_stats_interval >= 0,
            f"log_stats_interval must be >= 0 seconds (0: off); got {self.log_stats_interval}",
            "log_stats_interval",
        )
        need(
            self.tokenizer_workers >= 1,
            f"tokenizer_workers must be >= 1; got {self.tokenizer_workers}",
            "tokenizer_workers",
        )
        need(
            self.tokenizer_prefix_cache_size >= 0,
            f"tokenizer_prefix_cache_size must be >= 0 (0: off); got {self.tokenizer_prefix_cache_size}",
            "tokenizer_prefix_cache_size",
        )
        need(
            self.log_level in ("debug", "info", "warning", "error"),
            f"log_level must be debug, info, warning or error; got {self.log_level!r}",
            "log_level",
        )
        need(
            self.api_key != "", "api_key must not be empty; leave it unset to serve without a key", "api_key"
        )
        need(
            self.metrics_names in METRICS_NAMES,
            f"metrics_names must be one of {', '.join(METRICS_NAMES)}; got {self.metrics_names!r}",
            "metrics_names",
        )
        from longserve.structured.reasoning import REASONING_PARSERS
        from longserve.structured.tool_parsers import TOOL_CALL_PARSERS

        need(
            self.tool_call_parser is None or self.tool_call_parser in TOOL_CALL_PARSERS,
            f"tool_call_parser must be one of {', '.join(sorted(TOOL_CALL_PARSERS))}; got {self.tool_call_parser!r}",
            "tool_call_parser",
        )
        need(
            not self.enable_auto_tool_choice or self.tool_call_parser is not None,
            "enable_auto_tool_choice needs tool_call_parser: the syntax of the model's tool calls",
            "enable_auto_tool_choice",
        )
        need(
            self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
            f"reasoning_parser must be one of {', '.join(sorted(REASONING_PARSERS))}; got {self.reasoning_parser!r}",
            "reasoning_parser",
        )
