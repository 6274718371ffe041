"""`longserve bench latency`, its command line: offline cold TTFT per prompt length, TTFT with a cached prefix
and decode inter-token latency per batch size, on one engine in one process, optionally against HF
transformers. The cases and their timing are in latency_cases, pool sizing in latency_plan, the HF
comparison in hf_compare, each case's floor (the bytes and FLOPs it must move) in roofline, the table and
JSON in report.

`longserve bench latency --config llama-3.1-8b --prompt-lens 8192,32768 --output-json out.json`
Imports torch only when run, so the CLI's --help stays cheap.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import sys
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from longserve.bench.configs import BUILTIN_CONFIGS
from longserve.bench.hf_compare import run_hf
from longserve.bench.latency_cases import Measure, bench_engine, free_memory, log
from longserve.bench.latency_plan import (
    dtype_bytes,
    graph_plan,
    plan,
    read_model_config,
    running_requests,
)
from longserve.bench.report import report, run_metadata
from longserve.bench.roofline import attach_floors, card_peaks

if TYPE_CHECKING:
    from longserve.config import EngineConfig


# ---- arguments ----------------------------------------------------------------------------------
def _count(text: str) -> int:
    """A positive token count; '32k' means 32768."""
    t = text.strip().lower()
    value = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    if value < 1:
        raise ValueError(text)
    return value


def _decode_cases(text: str) -> list[int | tuple[int, int]]:
    """Decode cases: a batch size B (contexts of --decode-context-len) or B@C (contexts of C tokens)."""
    try:
        cases: list[int | tuple[int, int]] = []
        for part in (p.strip() for p in text.split(",")):
            if part:
                b, sep, c = part.partition("@")
                cases.append((_count(b), _count(c)) if sep else _count(b))
    except ValueError:
        cases = []
    if not cases:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated batch sizes, each optionally @ its context length (e.g. 1,64 or "
            f"1@32k,64@4k), got {text!r}"
        )
    return cases


def _counts(text: str) -> list[int]:
    try:
        values = [_count(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of positive integers (e.g. 8192,32768 or 8k,32k), got {text!r}"
        )
    return values


def _prefix_pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for part in (p for p in text.split(",") if p.strip()):
        try:
            cached, new = part.split(":")
            pairs.append((_count(cached), _count(new)))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected CACHED:NEW token counts, both >= 1 (e.g. 32768:64; several: 8192:64,32768:64), "
                f"got {part.strip()!r}"
            ) from None
    if not pairs:
        raise argparse.ArgumentTypeError(f"expected CACHED:NEW token counts (e.g. 32768:64), got {text!r}")
    return pairs


def _config_arg(text: str) -> str:
    if text in BUILTIN_CONFIGS:
        return text
    if text.endswith(".json") or os.sep in text or os.path.exists(text):
        if not os.path.isfile(text):
            raise argparse.ArgumentTypeError(f"config file {text!r} does not exist")
        return text
    raise argparse.ArgumentTypeError(
        f"unknown config {text!r}: give a config.json path or a built-in name ({', '.join(BUILTIN_CONFIGS)})"
    )


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    return parse


# engine options `bench latency` decides itself: the model is --model-path or --config; the running-request cap
# and the prefix cache follow from the cases (the context length too, unless --context-length asks for more); one node
_ENGINE_FLAGS_EXCLUDED = (
    "model", "tokenizer", "max_running_requests", "enable_prefix_caching",
    "nnodes", "node_rank", "dist_init_addr",
)  # fmt: skip


def add_latency_args(p: argparse.ArgumentParser) -> None:
    """The flags of `longserve bench latency`: the cases, and the engine options of `serve`'s table
    (server/args.py) with their spellings and defaults."""
    from longserve.server.args import add_engine_args

    src = p.add_mutually_exclusive_group(required=True)
    add_engine_args(src, only=("model",), default_help={"model": ""})  # one of the two is required
    src.add_argument(
        "--config",
        type=_config_arg,
        help=f"a config.json path or a built-in shape ({', '.join(BUILTIN_CONFIGS)}); random weights",
    )
    p.add_argument("--prompt-lens", type=_counts, default=[], help="cold TTFT cases, e.g. 8192,32768")
    p.add_argument(
        "--prefix-hit", type=_prefix_pairs, default=[], help="cached-prefix cases CACHED:NEW, e.g. 32768:64"
    )
    p.add_argument(
        "--decode-batch-sizes",
        type=_decode_cases,
        default=[],
        help="decode latency cases: batch sizes, each optionally @ its own context length, e.g. 1,64 or "
        "1@32k,64@4k (one engine for all: one model load)",
    )
    p.add_argument(
        "--decode-context-len",
        type=_count,
        default=32768,
        help="context tokens per decode request (B without @C)",
    )
    p.add_argument("--decode-steps", type=_count, default=32, help="timed decode steps per decode run")
    p.add_argument("--warmup", type=_int_at_least(0), default=1, help="untimed warm-up runs per case")
    p.add_argument("--repeat", type=_int_at_least(1), default=3, help="timed runs per case (median reported)")
    p.add_argument("--output-json", default=None, help="write the records to this file")
    p.add_argument(
        "--compare-hf",
        action="store_true",
        help="also time the cold cases with HF transformers (sdpa, random weights, same dtype/device)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="one extra run of each case under torch.profiler (decode: --decode-steps steps): time per category "
        "(GEMM, attention, collectives, ...) in the JSON and the log",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the GPU's measured GEMM ceiling, TFLOP/s, for each case's floor (default: the H200's bf16, which an "
        "H100's chip shares)",
    )
    p.add_argument(
        "--peak-gbps",
        type=float,
        default=None,
        help="the GPU's measured memory bandwidth, GB/s, for each case's floor (default: the H200's; on an H100 "
        "the H100's)",
    )
    p.add_argument(
        "--host-profile",
        action="store_true",
        help="one extra run of each case under cProfile: the host functions with the most self time "
        "(in the JSON and the log); for host-bound cases such as a prefix hit or a decode step",
    )
    engine = p.add_argument_group("engine options (as `longserve serve`; --seed also seeds the prompts)")
    add_engine_args(
        engine,
        exclude=_ENGINE_FLAGS_EXCLUDED,
        default_help={
            "load_format": "dummy with --config, auto with --model-path",
            "max_total_tokens": "what the cases need, x1.1, within memory",
            "context_length": "the cases' longest request; a longer one plans the engine as a server with it",
            "cuda_graph_max_bs": "the cases' largest decode batch; a server's with --context-length",
            "piecewise_cuda_graph_max_tokens": "0 with decode cases alone, else a server's",
        },
    )


def run_from_args(
    args: argparse.Namespace, command: str | None = None, measure: Measure | None = None
) -> list[dict[str, Any]]:
    """Run every case of parsed arguments; print the table, write --output-json, return the records.
    `measure` replaces what runs on the built engine (latency_cases.bench_engine): a probe's own cases."""
    from longserve.server.args import engine_config_from_args, given_engine_options

    if not (args.prompt_lens or args.prefix_hit or args.decode_batch_sizes):
        raise ValueError(
            "nothing to run: give --prompt-lens, --prefix-hit and/or --decode-batch-sizes "
            "(e.g. --prompt-lens 8192,32768 --prefix-hit 32768:64)"
        )
    given = given_engine_options(args)
    model = given.get("model")
    load_format = given.get("load_format") or ("auto" if model else "dummy")
    if args.config and load_format != "dummy":
        raise ValueError(f"--config has no weights: use --load-format dummy, not {load_format!r}")
    if command is None:
        command = shlex.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
    cfg = read_model_config(model, args.config)
    with contextlib.ExitStack() as stack:
        if model is None:
            model = stack.enter_context(tempfile.TemporaryDirectory(prefix="longserve-bench-"))
            with open(os.path.join(model, "config.json"), "w") as f:
                json.dump(cfg, f, indent=2)
        config = engine_config_from_args(args, model=model, load_format=load_format)
        # the pool is sized from the model the engine builds: --hf-overrides (e.g. num_hidden_layers, as the
        # 35B-A3B runs take 20 of its 40 layers) set on the config as the runner sets them (top-level keys)
        cfg = {**cfg, **(config.hf_overrides or {})}
        context_length, pool, skipped = plan(args, config, cfg)
        config = dataclasses.replace(
            config,
            max_total_tokens=pool,
            context_length=context_length,
            max_running_requests=running_requests(args, config),
            # a probe's own cases (measure) may run steps args' cases do not: a server's graphs
            **({} if measure else graph_plan(args, given, config)),
        )
        records, engine_meta = _run_engine(config, args, skipped, measure or bench_engine)
        free_memory()  # the engine is gone: HF gets the whole device
        if args.compare_hf and args.prompt_lens:
            run_hf(config, args.warmup, args.repeat, engine_meta, records)
    # what each case must move at least (weights of the experts touched, KV, GEMM and attention FLOPs), at the
    # ceilings given or the card's
    card_tflops, card_gbps = card_peaks(engine_meta.get("device", ""))
    floors = attach_floors(
        records,
        cfg,
        dtype_bytes(config, cfg),
        config.chunked_prefill_size,
        config.tp_size,
        getattr(args, "peak_tflops", None) or card_tflops,
        getattr(args, "peak_gbps", None) or card_gbps,
        measured_bytes(engine_meta, config.tp_size),
        # each case's prompt runs alone, in the engine's lone steps (a probe's meta may not say: the configured)
        lone=engine_meta.get("lone_prefill_chunk_size", config.lone_prefill_chunk_size),
        granule=engine_meta.get("chunk_granule", 1),
    )
    for line in floors:
        log(line)
    meta = run_metadata(given.get("model") or args.config, config, engine_meta, command)
    report(records, meta, args.output_json)
    if args.output_json:
        log(f"wrote {len(records)} records to {args.output_json}")
    return records


def measured_bytes(engine_meta: dict[str, Any], tp_size: int) -> tuple[float, float] | None:
    """(weight bytes, KV bytes per token) of the engine that ran, all ranks together (a rank's times tp_size:
    replicated routers and norms counted tp_size times, a rounding at these sizes); None when not recorded."""
    if "weight_bytes" not in engine_meta:
        return None
    return engine_meta["weight_bytes"] * tp_size, engine_meta["kv_bytes_per_token"] * tp_size


def _run_engine(
    config: EngineConfig, args: argparse.Namespace, skipped: dict[int, str], measure: Measure
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from longserve.llm import LLM

    log(
        f"building the engine: {args.config or config.model} ({config.load_format} weights), context "
        f"{config.context_length:,}, KV pool {config.max_total_tokens:,} tokens, decode graphs up to batch "
        f"{config.cuda_graph_max_bs}, piecewise graphs up to {config.piecewise_cuda_graph_max_tokens:,} tokens"
    )
    llm = LLM.from_config(config)
    try:
        return measure(llm, args, skipped)
    finally:
        llm.close()  # stops tensor-parallel workers: their GPUs are free for what runs next


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longserve bench latency", description=__doc__.splitlines()[0])
    add_latency_args(parser)
    return parser


def run_latency(args_list: list[str] | None = None, measure: Measure | None = None) -> list[dict[str, Any]]:
    """Parse `longserve bench latency` flags (None: sys.argv[1:]) and run; bad flags exit with code 2."""
    argv = sys.argv[1:] if args_list is None else list(args_list)
    args = build_parser().parse_args(argv)
    return run_from_args(args, command=shlex.join(["longserve", "bench", "latency", *argv]), measure=measure)


def main(argv: list[str] | None = None) -> int:
    import logging

    from longserve.server.args import cli_message

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_latency(argv)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {cli_message(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
