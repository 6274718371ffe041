"""EngineConfig: every engine setting in one frozen dataclass. The CLI, LONGSERVE_* env vars and YAML
files resolve onto these same fields (longserve/server/args.py); validation runs here so every entry point
shares it, and a refusal names the fields it is about (ConfigError.settings) so a CLI can say its flags.
The parallel layout's checks (tp_size, ep_size, nnodes, node_rank, dist_init_addr) live in config_parallel.py, the
hybrid models' state settings' (mamba_*) in config_hybrid.py, --chat-template's reading in chat_template_file.py,
and the refusals (ConfigError and its kin, re-exported here) in settings_errors.py.
The HTTP side of `longserve serve` is server/config.py's ServerConfig."""

from __future__ import annotations

import itertools
import json
import logging
import os
from dataclasses import dataclass

from longserve.chat_template_file import load_chat_template
from longserve.config_hybrid import check_hybrid_settings
from longserve.config_parallel import check_parallel_layout
from longserve.platform import normalize_attention_backend, resolve_attention_backend
from longserve.settings_errors import (  # noqa: F401 - the refusals' home for every importer of longserve.config
    ConfigError,
    ConfigPathError,
    SettingsError,
)

logger = logging.getLogger("longserve.config")

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
SCHEDULE_POLICIES = ("short-first", "fcfs")
RUNNERS = ("auto", "generate", "pooling")  # vLLM's --runner (models/pooler.py)
CONVERTS = ("auto", "none", "embed", "classify")  # vLLM's --convert
# weight formats (models/quant/config.py); vLLM's kernel-named spellings select the same formats
QUANTIZATIONS = ("awq", "compressed-tensors", "fp8", "gptq")
QUANTIZATION_ALIASES = {
    "gptq_marlin": "gptq",
    "awq_marlin": "awq",
    "compressed_tensors": "compressed-tensors",
}
# the KV cache's storage (attention/kv_quant.py): "auto" the model's dtype, "fp8_e4m3" e4m3 with per-layer scales;
# vLLM's "fp8" and SGLang's "fp8_e4m3" are the same format
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    seed: int = 0  # seed of dummy weights and of unseeded sampling

    # KV pool
    page_size: int = 16
    max_total_tokens: int | None = None  # pool size in tokens; None: sized by mem_fraction_static
    mem_fraction_static: float = 0.85  # share of device memory (CPU: of free RAM) for weights + KV pool
    enable_prefix_caching: bool = True

    # scheduling
    # prompt tokens of a step (vLLM: max_num_batched_tokens); the step's decodes ride on top (sched/scheduler.py)
    chunked_prefill_size: int = 8192
    max_prefill_chunk: int | None = None  # per-request cap per step; None: the whole budget
    # a step's prompt tokens while one request's prompt is all the work there is (no decodes, nothing waiting;
    # sched/scheduler.py; fewer past that many computed tokens: sched/chunk_size.py), at least chunked_prefill_size
    # (equal: off); None: the model's choice
    # (runner/step_tokens.py: 32768 on a GPU where the weights are dequantized once a step, as GPTQ / AWQ /
    # W4A16 ones are at prefill sizes; else chunked_prefill_size)
    lone_prefill_chunk_size: int | None = None
    max_running_requests: int = 256
    # the most top logprobs a request may ask for, per generated token (logprobs) and per prompt position
    # (prompt_logprobs): vLLM's --max-logprobs, 20 by default (OpenAI's top_logprobs limit); -1: the vocabulary
    max_logprobs: int = 20
    # "short-first": a waiting request with at most 1/8 of chunked_prefill_size to compute (after its cached
    # prefix) is served before the rest of a long prompt's prefill (SchedulerConfig.from_engine_config);
    # "fcfs": never
    schedule_policy: str = "short-first"
    context_length: int | None = None  # None: the model's max_position_embeddings

    # a name of platform.ATTENTION_BACKEND_CHOICES, stored canonical ("auto", "torch", "triton"); with an
    # explicit device, the backend that runs there (platform.resolve_attention_backend)
    attention_backend: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs (SGLang: --disable-cuda-graph)
    cuda_graph_max_bs: int = 128  # decode steps up to this batch size replay CUDA graphs
    cuda_graph_max_prefill_tokens: int = 256  # a lone chunk of up to this many tokens replays a graph; 0: off
    # steps of up to this many tokens (any mix of requests) replay each layer's dense parts as CUDA graphs,
    # the attention eager between them (runner/piecewise_graph.py); 0: off. Through HTTP against vLLM on an
    # H200 (RESULTS.md, 2026-12-03): the random workload's mixed steps 44.8 -> 26.8 ms, multi-turn's TTFT P50
    # 57.5 -> 44.5 ms and 4% more requests/s; 2.9 s of start-up and 0.8 GiB for the 8B shape
    piecewise_cuda_graph_max_tokens: int = 4096
    # the step sizes (tokens) those graphs are captured at, ascending (SGLang's --piecewise-cuda-graph-tokens);
    # None: 64 apart up to 1024, then an eighth of each power of two (runner/piecewise_graph.py). A step runs
    # as the smallest size that holds it, and its GEMMs pay for the padding as for real rows (RESULTS.md,
    # twenty-first session: ~21.6 ms per 1K padding tokens beside decodes, the 8B on an H200)
    piecewise_cuda_graph_tokens: tuple[int, ...] | None = None
    # plan and launch step N+1 before step N's tokens are read, so the host's work hides behind the device's
    # (SGLang's overlap schedule, vLLM's async scheduling); None: on a GPU at one rank, off on the CPU
    # (nothing to hide) and under tensor parallelism (works there, not yet measured on GPUs)
    overlap_schedule: bool | None = None
    # tp > 1: steps of this many tokens run as 2 overlapped halves; 0 (default until measured on 2 GPUs): off
    tp_overlap_min_tokens: int = 0
    tp_size: int = 1  # tensor-parallel ranks (one process each; must divide the attention heads)
    # MoE models: the tp ranks form ep_size groups, each holding 1/ep_size of the experts whole (SGLang's
    # --ep-size; must divide tp_size); enable_expert_parallel (vLLM's flag) means ep_size = tp_size
    ep_size: int = 1
    enable_expert_parallel: bool = False
    nnodes: int = 1  # nodes the tp ranks span (tp_size / nnodes ranks per node)
    node_rank: int = 0  # this node's index; node 0 runs the engine
    dist_init_addr: str | None = None  # HOST:PORT of node 0's rendezvous; None (one node): a temp file
    # each run of whitespace between the JSON tokens of a constrained output (structured outputs, forced tool
    # calls) has at most this many characters: small models otherwise may pad whitespace until max_tokens.
    # 0: none (compact JSON); None: any amount, as vLLM and SGLang allow by default
    structured_outputs_max_whitespace: int | None = 16
    # pooling models (embeddings, rerankers; models/pooler.py): "auto" pools when the checkpoint says so (a
    # sentence-transformers or *ForSequenceClassification checkpoint), "pooling" always (SGLang's
    # --is-embedding); convert: what a pooling model yields ("auto": from the checkpoint, "embed", "classify")
    runner: str = "auto"
    convert: str = "auto"
    hf_overrides: dict | None = None  # set on the model's HF config (vLLM's --hf-overrides; JSON text too)
    # vLLM's --quantization: the checkpoint's weight format (checked against config.json's
    # quantization_config); "fp8" on a float checkpoint quantizes it while loading. None: config.json's
    quantization: str | None = None
    # the KV cache's storage: "auto" (the model's dtype) or "fp8_e4m3" (vLLM's "fp8" means it too): half the
    # bytes per token, so the pool holds twice the tokens of a 16-bit one (attention/kv_quant.py)
    kv_cache_dtype: str = "auto"
    # a hybrid model's (Qwen3.5) linear-attention state between steps (vLLM's --mamba-ssm-cache-dtype, SGLang's
    # --mamba-ssm-dtype): auto, the model's dtype, as vLLM 0.24 keeps a Qwen3.5's; float32 as SGLang and
    # transformers keep it (the delta rule's state sums every token), at twice the memory (on an H100 the chunked
    # delta rule's fused kernel faulted with float32 states, bf16 ran: RESULTS.md forty-sixth session)
    mamba_ssm_cache_dtype: str = "auto"
    # vLLM's --mamba-cache-dtype: the convs' state (their last inputs) and, where mamba_ssm_cache_dtype is auto, the
    # delta rule's too; auto: the model's dtype
    mamba_cache_dtype: str = "auto"
    # with prefix caching, whether a hybrid model's prefix cache keeps state checkpoints (MAMBA_CACHE_MODES)
    mamba_cache_mode: str = "align"
    # SGLang's --max-mamba-cache-size: at most this many state rows, running slots and checkpoints together
    # (None: as many as half the memory the weights leave holds; runner/state_plan.py)
    max_mamba_cache_size: int | None = None
    # SGLang's --mamba-full-memory-ratio r: the states take at most r / (1 + r) of the memory the weights leave,
    # the KV pool the rest (None: half, r = 1; SGLang's default 0.9 gives them 47%); runner/state_plan.py
    mamba_full_memory_ratio: float | None = None
    # SGLang's --mamba-track-interval (its default): a decoding request's state is checkpointed every this many
    # tokens, so a conversation's next turn resumes inside the last answer (cache/manager.py track_target)
    mamba_track_interval: int = 256
    # SGLang's --mamba-scheduler-strategy (auto, no_buffer, extra_buffer) and its linear attention's kernel
    # choices, accepted from its Qwen3.5 / Qwen3-Next launch lines with no effect
    # (engine_checks.log_ignored_settings says why at start-up; config_hybrid.py checks their values)
    mamba_scheduler_strategy: str = "auto"
    mamba_backend: str | None = None
    linear_attn_backend: str | None = None
    linear_attn_decode_backend: str | None = None
    linear_attn_prefill_backend: str | None = None
    # a chat template used instead of the tokenizer's (vLLM's and SGLang's --chat-template): a file path or
    # the Jinja text itself, as given (chat_template_text: the template). Trusted (the operator's);
    # transformers renders it in its sandbox as it does the tokenizer's own. A request never brings one.
    chat_template: str | None = None
    # accepted for vLLM's and SGLang's launch lines, without effect: longserve runs only its own model code
    # (no checkpoint's Python), and recomputes a preempted request instead of swapping its KV to the CPU
    # (vLLM's swap_space, GiB); both are logged at start-up (Engine)
    trust_remote_code: bool = False
    swap_space: float | None = None
    dp_size: int = 1  # data-parallel replicas (SGLang's --dp-size, vLLM's --data-parallel-size): only 1

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str, *settings: str) -> None:
            if not ok:
                raise ConfigError(msg, *settings)

        need(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}", "dtype")
        need(
            self.device in DEVICES,
            f"device must be one of {', '.join(DEVICES)}; got {self.device!r}",
            "device",
        )
        need(
            self.load_format in LOAD_FORMATS,
            f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}",
            "load_format",
        )
        self._normalize_attention_backend()
        need(
            isinstance(self.page_size, int) and self.page_size >= 1,
            f"page_size must be an integer >= 1; got {self.page_size!r}",
            "page_size",
        )
        need(
            self.chunked_prefill_size >= 1,
            f"chunked_prefill_size must be >= 1; got {self.chunked_prefill_size}",
            "chunked_prefill_size",
        )
        need(
            self.lone_prefill_chunk_size is None or self.lone_prefill_chunk_size >= self.chunked_prefill_size,
            f"lone_prefill_chunk_size must be at least chunked_prefill_size ({self.chunked_prefill_size}); got "
            f"{self.lone_prefill_chunk_size}",
            "lone_prefill_chunk_size",
        )
        need(
            self.max_prefill_chunk is None or self.max_prefill_chunk >= 1,
            f"max_prefill_chunk must be >= 1; got {self.max_prefill_chunk}",
            "max_prefill_chunk",
        )
        need(
            self.cuda_graph_max_bs >= 1,
            f"cuda_graph_max_bs must be >= 1; got {self.cuda_graph_max_bs}",
            "cuda_graph_max_bs",
        )
        need(
            self.cuda_graph_max_prefill_tokens >= 0,
            f"cuda_graph_max_prefill_tokens must be >= 0; got {self.cuda_graph_max_prefill_tokens}",
            "cuda_graph_max_prefill_tokens",
        )
        need(
            self.piecewise_cuda_graph_max_tokens >= 0,
            f"piecewise_cuda_graph_max_tokens must be >= 0; got {self.piecewise_cuda_graph_max_tokens}",
            "piecewise_cuda_graph_max_tokens",
        )
        sizes = self.piecewise_cuda_graph_tokens
        if sizes is not None:
            object.__setattr__(self, "piecewise_cuda_graph_tokens", sizes := tuple(sizes))
            need(
                len(sizes) > 0
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes)
                and all(a < b for a, b in itertools.pairwise(sizes)),
                f"piecewise_cuda_graph_tokens must be token counts >= 1 in ascending order; got {list(sizes)}",
                "piecewise_cuda_graph_tokens",
            )
        need(
            self.tp_overlap_min_tokens >= 0,
            f"tp_overlap_min_tokens must be >= 0; got {self.tp_overlap_min_tokens}",
            "tp_overlap_min_tokens",
        )
        need(
            self.max_running_requests >= 1,
            f"max_running_requests must be >= 1; got {self.max_running_requests}",
            "max_running_requests",
        )
        need(
            isinstance(self.max_logprobs, int) and self.max_logprobs >= -1,
            f"max_logprobs must be an integer >= -1 (-1: the vocabulary); got {self.max_logprobs!r}",
            "max_logprobs",
        )
        need(
            self.schedule_policy in SCHEDULE_POLICIES,
            f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}; got {self.schedule_policy!r}",
            "schedule_policy",
        )
        need(
            self.max_total_tokens is None or self.max_total_tokens >= self.page_size,
            f"max_total_tokens must hold at least one page ({self.page_size} tokens); got {self.max_total_tokens}",
            "max_total_tokens",
        )
        need(
            0 < self.mem_fraction_static <= 1,
            f"mem_fraction_static must be in (0, 1]; got {self.mem_fraction_static}",
            "mem_fraction_static",
        )
        need(
            self.context_length is None or self.context_length >= 1,
            f"context_length must be >= 1; got {self.context_length}",
            "context_length",
        )
        check_parallel_layout(self, need)  # tp, ep, nodes (config_parallel.py)
        need(
            self.structured_outputs_max_whitespace is None
            or (
                isinstance(self.structured_outputs_max_whitespace, int)
                and self.structured_outputs_max_whitespace >= 0
            ),
            "structured_outputs_max_whitespace must be an integer >= 0 or None (no bound); got "
            f"{self.structured_outputs_max_whitespace!r}",
            "structured_outputs_max_whitespace",
        )
        need(
            self.runner in RUNNERS,
            f"runner must be one of {', '.join(RUNNERS)}; got {self.runner!r}",
            "runner",
        )
        need(
            self.convert in CONVERTS,
            f"convert must be one of {', '.join(CONVERTS)}; got {self.convert!r}",
            "convert",
        )
        self._parse_hf_overrides()
        if self.quantization is not None:
            name = QUANTIZATION_ALIASES.get(self.quantization.lower(), self.quantization.lower())
            need(
                name in QUANTIZATIONS,
                f"quantization must be one of {', '.join(QUANTIZATIONS)} (vLLM's gptq_marlin and awq_marlin "
                f"mean gptq and awq); got {self.quantization!r}",
                "quantization",
            )
            object.__setattr__(self, "quantization", name)
        self._normalize_kv_cache_dtype(need)
        check_hybrid_settings(self, need)
        self._check_compat_settings(need)
        if self.load_format != "dummy" and not os.path.isdir(self.model):
            raise ConfigPathError(
                f"model directory {self.model!r} does not exist; pass a local Hugging Face checkpoint "
                "directory (config.json, *.safetensors, tokenizer files), or load_format='dummy' with a "
                "directory holding config.json",
                "load_format",
            )

    def _check_compat_settings(self, need) -> None:
        """dp_size 1 only; swap_space a size or None; chat_template a readable file or a template."""
        need(
            isinstance(self.dp_size, int) and not isinstance(self.dp_size, bool) and self.dp_size >= 1,
            f"dp_size must be an integer >= 1; got {self.dp_size!r}",
            "dp_size",
        )
        need(
            self.dp_size == 1,
            f"dp_size={self.dp_size}: data parallelism is not supported; run {self.dp_size} servers (one "
            "per GPU or tensor-parallel group) behind a load balancer",
            "dp_size",
        )
        need(
            self.swap_space is None
            or (isinstance(self.swap_space, (int, float)) and not isinstance(self.swap_space, bool)
                and self.swap_space >= 0),
            f"swap_space must be a number of GiB >= 0; got {self.swap_space!r}",
            "swap_space",
        )  # fmt: skip
        need(
            isinstance(self.trust_remote_code, bool),
            f"trust_remote_code must be a boolean; got {self.trust_remote_code!r}",
            "trust_remote_code",
        )
        if self.chat_template is not None:  # a path that cannot be read fails now, not at the first chat
            load_chat_template(self.chat_template)

    def _normalize_kv_cache_dtype(self, need) -> None:
        """Store "auto" or "fp8_e4m3"; e5m2, fp4 and int8 caches (vLLM's and SGLang's other values) are refused."""
        given = self.kv_cache_dtype
        name = given.strip().lower() if isinstance(given, str) else given
        name = KV_CACHE_DTYPE_ALIASES.get(name, name)
        need(
            name in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be auto (the model's dtype), fp8 or fp8_e4m3 (the same: e4m3 with per-layer "
            f"scales); got {given!r}",
            "kv_cache_dtype",
        )
        object.__setattr__(self, "kv_cache_dtype", name)

    def _normalize_attention_backend(self) -> None:
        """Store the canonical name (platform's registry: SGLang's and vLLM's spellings are accepted); with an
        explicit device, the backend that runs there (on the CPU: torch)."""
        given = self.attention_backend
        try:
            backend = normalize_attention_backend(given)
        except ValueError as e:
            raise ConfigError(str(e), "attention_backend") from None
        if self.device != "auto":
            backend = resolve_attention_backend(backend, self.device)
        if given.lower() not in ("auto", backend):
            logger.info("attention backend %r: longserve uses its %r backend", given, backend)
        object.__setattr__(self, "attention_backend", backend)

    def _parse_hf_overrides(self) -> None:
        value = self.hf_overrides
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else None
            except ValueError as e:
                raise ConfigError(
                    f"hf_overrides must be a JSON object; got {self.hf_overrides!r} ({e})", "hf_overrides"
                ) from None
        if value is not None and not isinstance(value, dict):
            raise ConfigError(
                f"hf_overrides must be a JSON object; got {self.hf_overrides!r}", "hf_overrides"
            )
        object.__setattr__(self, "hf_overrides", value)

    @property
    def chat_template_text(self) -> str | None:
        """The template of chat_template (a file's contents, or the text given), None when not set."""
        return None if self.chat_template is None else load_chat_template(self.chat_template)

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model
