"""The `longserve` command: `serve` runs the HTTP server (SGLang and vLLM flag spellings), `generate` the
offline engine on prompts from the command line, `bench` the offline and serving benchmarks."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _generate(args: argparse.Namespace) -> int:
    from longserve import LLM, SamplingParams
    from longserve.server.args import resolve

    given = {k: getattr(args, k) for k in ("top_p", "top_k") if getattr(args, k) is not None}
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        stop=args.stop or [],
        seed=args.sample_seed,
        **given,  # the others: SamplingParams' own defaults
    )
    engine_config, _ = resolve(args)  # the same flags, env vars and YAML keys as `longserve serve`
    llm = LLM.from_config(engine_config)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    for prompt, out in zip(args.prompt, outputs):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": out.text,
                        "token_ids": out.token_ids,
                        "finish_reason": out.finish_reason,
                        "prompt_tokens": out.prompt_tokens,
                        "cached_tokens": out.cached_tokens,
                        "ttft": out.ttft,
                        "e2e_latency": out.e2e_latency,
                    }
                )
            )
        else:
            print(
                f"--- {prompt!r} ({out.prompt_tokens} prompt tokens, ttft {out.ttft:.3f}s, {out.finish_reason})"
            )
            print(out.text)
    return 0


def _bench_latency(args: argparse.Namespace) -> int:
    from longserve.bench.latency import run_from_args

    run_from_args(args)  # the recorded command line is sys.argv
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from longserve.bench.serve import run_from_args

    record = run_from_args(args)
    # every request failed, or the asked-for cache flush did not happen: say so in the exit code
    return 0 if record["summary"]["completed"] and not record["metadata"]["cache_flush_error"] else 1


def _bench_compare(args: argparse.Namespace) -> int:
    from longserve.bench.compare import run_from_args

    return run_from_args(args)


def _bench_accuracy(args: argparse.Namespace) -> int:
    from longserve.bench.accuracy import run_from_args

    run_from_args(args)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from longserve.server.launch import run_from_args

    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    from longserve import __version__

    parser = argparse.ArgumentParser(prog="longserve", description="LLM serving engine for long prompts")
    parser.add_argument("--version", action="version", version=f"longserve {__version__}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)
    from longserve.server.args import add_server_args

    serve = sub.add_parser(
        "serve",
        help="serve a model over HTTP (OpenAI API, SGLang /generate)",
        description="Serve a model over HTTP: OpenAI API (/v1/...), SGLang's /generate, admin endpoints. "
        "Takes SGLang's and vLLM's flag spellings.",
    )
    add_server_args(serve)
    serve.set_defaults(func=_serve)
    gen = sub.add_parser(
        "generate",
        help="generate offline for prompts given on the command line",
        description="Generate offline for prompts given on the command line; the engine options, env vars "
        "and YAML keys are those of `longserve serve`.",
    )
    add_server_args(gen, sections=("engine.",))
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default: 64)"
    )
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (the default here): greedy")
    gen.add_argument("--top-p", type=float, help="nucleus sampling (default: off)")
    gen.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (default: off)")
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--sample-seed", type=int, default=None, help="seed of the sampling")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.set_defaults(func=_generate)

    from longserve.bench.latency import add_latency_args

    bench = sub.add_parser("bench", help="offline and serving benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    latency = bench_sub.add_parser(
        "latency", help="cold TTFT, cached-prefix TTFT and decode latency on random prompts (no server)"
    )
    add_latency_args(latency)
    latency.set_defaults(func=_bench_latency)
    from longserve.bench.compare import add_compare_args
    from longserve.bench.serve import add_serve_args

    bench_serve = bench_sub.add_parser(
        "serve", help="online benchmark of a running server (longserve, SGLang, vLLM, OpenAI API)"
    )
    add_serve_args(bench_serve)
    bench_serve.set_defaults(func=_bench_serve)
    compare = bench_sub.add_parser(
        "compare", help="one workload against several servers in turn: Markdown, JSON and PNG report"
    )
    add_compare_args(compare)
    compare.set_defaults(func=_bench_compare)
    from longserve.bench.accuracy import add_accuracy_args

    accuracy = bench_sub.add_parser(
        "accuracy",
        help="a quantized model (or fp8 KV cache) against its original: agreement, KL, perplexity, answers",
    )
    add_accuracy_args(accuracy)
    accuracy.set_defaults(func=_bench_accuracy)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError) as e:
        from longserve.server.args import cli_message

        print(f"error: {cli_message(e)}", file=sys.stderr)  # settings named as this command's flags
        return 2


if __name__ == "__main__":
    sys.exit(main())
