"""Sizing of `bench latency`'s engine before it is built: the context length the cases need and a KV pool
that holds the largest case that fits in memory (the rest of memory is the activations' headroom); decode
cases that cannot fit are skipped with the reason."""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from longserve.bench.configs import BUILTIN_CONFIGS
from longserve.bench.weight_bytes import layer_bytes_per_param, quant_format
from longserve.config import EngineConfig
from longserve.models.quant.config import QuantFormat

_GIB = 2**30


def read_model_config(model: str | None, shape: str | None) -> dict[str, Any]:
    """config.json of the checkpoint directory `model`, else of `shape` (a built-in name or a file)."""
    if model:
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--model-path {model!r}: {path} not found")
    elif shape in BUILTIN_CONFIGS:
        return dict(BUILTIN_CONFIGS[shape])
    else:
        path = shape
    with open(path) as f:
        return json.load(f)


def dtype_bytes(config: EngineConfig, cfg: dict[str, Any]) -> int:
    name = (
        config.dtype
        if config.dtype != "auto"
        else str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    )
    return 4 if "32" in name or name == "float" else 2


def estimate_bytes(
    cfg: dict[str, Any],
    itemsize: int,
    tp: int = 1,
    quant: QuantFormat | None = None,
    kv_itemsize: int | None = None,
) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) per device of a decoder from its config.json, for pool sizing:
    every expert of an MoE model counts (roofline.model_costs), its layers in their quantization format's bytes
    (`quant`: bench/weight_bytes.py), its K/V in kv_itemsize (an fp8 cache: 1; default itemsize); under tensor
    or expert parallelism a rank holds 1/tp of the weights and of the kv heads (at least one)."""
    from longserve.bench.roofline import model_costs, text_model_config
    from longserve.models.moe_layout import moe_spec

    costs = model_costs(cfg, itemsize)
    text = text_model_config(cfg)
    spec = moe_spec(text)
    dense_b, expert_b = layer_bytes_per_param(
        quant,
        itemsize,
        hybrid="linear_attention" in (text.get("layer_types") or []),
        moe=costs.moe_layers > 0,
        shared=bool(spec and spec.shared_intermediate_size),
        dense_mlp=spec is None or spec.num_dense_layers > 0,
    )
    experts = costs.moe_layers * costs.num_experts * costs.expert_params
    weights = costs.embed_params * itemsize + costs.dense_params * dense_b + experts * expert_b
    kv_heads = max(1, costs.num_kv_heads // tp)
    return int(weights) // tp, costs.num_layers * kv_heads * costs.head_dim * 2 * (kv_itemsize or itemsize)


def hybrid_state_bytes(
    cfg: dict[str, Any], config: EngineConfig, itemsize: int, budget: float, want: int
) -> int:
    """The bytes a hybrid model's state rows take on a rank, sized as runner/state_plan.py sizes them from the
    memory the weights leave (`budget`) before the KV pool gets the rest: a slot a running request (`want`) and,
    with prefix caching, as many checkpoints, within the states' share and --max-mamba-cache-size; 0 for a model
    without linear-attention layers."""
    import torch

    from longserve.attention.recurrent_state import RecurrentStateSpec
    from longserve.bench.roofline import text_model_config
    from longserve.runner.state_plan import keeps_checkpoints, state_dtypes, state_rows, state_share

    text = text_model_config(cfg)
    kinds = list(text.get("layer_types") or [])[: text["num_hidden_layers"]]
    linear = sum(kind == "linear_attention" for kind in kinds)
    if not linear:
        return 0
    tp = config.tp_size
    spec = RecurrentStateSpec.for_heads(
        text["linear_num_key_heads"] // tp,
        text["linear_num_value_heads"] // tp,
        text["linear_key_head_dim"],
        text["linear_value_head_dim"],
        text["linear_conv_kernel_dim"],
    )
    per_slot = linear * spec.bytes_per_slot(
        *state_dtypes(config, torch.float32 if itemsize == 4 else torch.bfloat16)
    )
    fits = int(max(budget, 0) * state_share(config.mamba_full_memory_ratio) // per_slot)
    if config.max_mamba_cache_size is not None:
        fits = min(fits, config.max_mamba_cache_size)
    return sum(state_rows(fits, want, keeps_checkpoints(config))) * per_slot if fits else 0


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def decode_new_tokens(decode_steps: int, batch: int, config: EngineConfig) -> int:
    """max_new_tokens of a decode case's requests: settling steps (each request recomputes at most one page)
    + the timed steps + a margin (one untimed step before the timed ones among it)."""
    return decode_steps + math.ceil(batch * config.page_size / config.chunked_prefill_size) + 4


def running_requests(args: argparse.Namespace, config: EngineConfig) -> int:
    """The most requests the benchmark's engine runs at once: the config's, at least the largest decode batch."""
    return max([config.max_running_requests, *(b for b, _ in decode_cases(args))])


def decode_cases(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(batch size, context tokens per request) of each decode case, in the order given."""
    return [c if isinstance(c, tuple) else (c, args.decode_context_len) for c in args.decode_batch_sizes]


def graph_plan(args: argparse.Namespace, given: dict[str, Any], config: EngineConfig) -> dict[str, int]:
    """The CUDA graphs the engine captures, planned for the cases where neither the flag nor --context-length (an
    engine planned as a server) is given: decode graphs up to the cases' largest decode batch (at least 1), and no
    piecewise graphs (mixed steps up to 4,096 tokens) when only decode cases run (their mixed steps, each request's
    last page recomputed, are untimed).
    A decode step replays the graph of its own batch size whatever else is captured; the server's 13 decode sizes
    up to 128 took 10.8 s and the piecewise graphs 4.4 s of a ~50 s b1 run (the 8B int4 on an H100,
    benchmarks/results/2026-12-05_f4bba8e_norm_epilogue/)."""
    if "context_length" in given:
        return {}
    out = {}
    if "cuda_graph_max_bs" not in given:
        out["cuda_graph_max_bs"] = max([1, *(b for b, _ in decode_cases(args))])
    if "piecewise_cuda_graph_max_tokens" not in given and not (args.prompt_lens or args.prefix_hit):
        out["piecewise_cuda_graph_max_tokens"] = 0
    return out


def plan(
    args: argparse.Namespace, config: EngineConfig, cfg: dict[str, Any]
) -> tuple[int, int, dict[int, str]]:
    """(context_length, max_total_tokens, {(decode batch size, context): why it is skipped}) for the cases of `args` on
    the engine `config` (its max_total_tokens, when given, is the pool; its context_length, when given, at least
    the cases' longest request, is the context)."""
    ps = config.page_size
    singles = [n + 1 for n in args.prompt_lens] + [c + m + 1 for c, m in args.prefix_hit]
    decode_need = {}
    for b, c in decode_cases(args):
        per_req = c + decode_new_tokens(args.decode_steps, b, config) + 1
        singles.append(per_req)
        decode_need[b, c] = b * (_round_up(per_req, ps) + ps)
    if config.context_length is not None:  # --context-length: an engine planned for longer requests than the
        # cases' (its attention plans, graphs and pool as a server with that context would have them)
        if config.context_length < max(singles):
            raise ValueError(
                f"--context-length {config.context_length:,} is shorter than the longest case "
                f"({max(singles):,} tokens with its generated ones): raise it or leave it out"
            )
        singles.append(config.context_length)
    context_length = _round_up(max(singles), ps)
    single_need = context_length + ps
    if config.max_total_tokens is not None:
        pool = limit = config.max_total_tokens
        holds = f"the pool holds {pool:,} (--max-total-tokens)"
    else:
        from longserve.platform import available_memory_bytes, resolve_device

        quant = quant_format(cfg, config.quantization, config.load_format)
        kv_itemsize = 1 if config.kv_cache_dtype.startswith("fp8") else None
        weights, kv_per_token = estimate_bytes(
            cfg, dtype_bytes(config, cfg), config.tp_size, quant=quant, kv_itemsize=kv_itemsize
        )
        total, free = available_memory_bytes(resolve_device(config.device))
        budget = total * config.mem_fraction_static - (total - free) - weights
        # a hybrid model's state rows come first (the engine sizes them, then its KV pool from the rest), for as
        # many running requests as the engine will be built for
        states = hybrid_state_bytes(
            cfg, config, dtype_bytes(config, cfg), budget, running_requests(args, config)
        )
        budget -= states
        limit = max(int(budget // kv_per_token) // ps * ps, ps)
        # size the pool for the largest case that fits: the memory left over is the activations' headroom
        fitting = [n for n in (single_need, *decode_need.values()) if n <= limit]
        pool = min(_round_up(int(max(fitting or [single_need]) * 1.1), ps), limit)
        beside = f" and {states / _GIB:.1f} GiB of linear-attention states" if states else ""
        holds = (
            f"memory allows a pool of {limit:,} after ~{weights / _GIB:.1f} GiB of weights{beside} "
            f"(--mem-fraction-static {config.mem_fraction_static})"
        )
    if single_need > limit:
        raise ValueError(
            f"the longest request needs {single_need:,} KV tokens; {holds}: "
            "shorten the cases or raise --max-total-tokens / --mem-fraction-static"
        )
    skipped = {
        (b, c): f"{b} x {c:,}-token contexts need {need:,} KV tokens; {holds}"
        for (b, c), need in decode_need.items()
        if need > limit
    }
    return context_length, pool, skipped
