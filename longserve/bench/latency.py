"""Offline latency benchmark, no server: cold TTFT per prompt length, TTFT with a cached prefix, and decode
inter-token latency per batch size, on one engine in one process, optionally against HF transformers.

`longserve bench latency --config llama-3.1-8b --prompt-lens 8192,32768 --output-json out.json`
Imports torch only when run, so the CLI's --help stays cheap.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from longserve.bench.configs import BUILTIN_CONFIGS
from longserve.bench.report import device_name, format_table, run_metadata

_GIB = 2**30


# ---- arguments ----------------------------------------------------------------------------------
def _count(text: str) -> int:
    """A positive token count; '32k' means 32768."""
    t = text.strip().lower()
    value = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    if value < 1:
        raise ValueError(text)
    return value


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


def add_latency_args(p: argparse.ArgumentParser) -> None:
    """The flags of `longserve bench latency` (scripts rely on these spellings)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", "--model-path", dest="model", help="Hugging Face checkpoint directory")
    src.add_argument(
        "--config",
        type=_config_arg,
        help=f"a config.json path or a built-in shape ({', '.join(BUILTIN_CONFIGS)}); random weights",
    )
    p.add_argument(
        "--load-format",
        default=None,
        choices=["auto", "safetensors", "dummy"],
        help="default: dummy with --config, auto with --model",
    )
    p.add_argument("--prompt-lens", type=_counts, default=[], help="cold TTFT cases, e.g. 8192,32768")
    p.add_argument(
        "--prefix-hit", type=_prefix_pairs, default=[], help="cached-prefix cases CACHED:NEW, e.g. 32768:64"
    )
    p.add_argument("--decode-batch-sizes", type=_counts, default=[], help="decode latency cases, e.g. 1,64")
    p.add_argument(
        "--decode-context-len", type=_count, default=32768, help="context tokens per decode request"
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
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--page-size", type=_int_at_least(1), default=16)
    p.add_argument(
        "--chunked-prefill-size", type=_int_at_least(1), default=8192, help="per-step token budget"
    )
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument(
        "--max-total-tokens",
        type=_int_at_least(1),
        default=None,
        help="KV pool size in tokens (default: what the cases need, x1.1, within memory)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    p.add_argument(
        "--tp-size",
        "--tensor-parallel-size",
        dest="tp_size",
        type=_int_at_least(1),
        default=1,
        help="tensor-parallel ranks (one GPU each)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    p.add_argument(
        "--cuda-graph-max-prefill-tokens",
        type=_int_at_least(0),
        default=256,
        help="a lone chunk of up to this many tokens replays a CUDA graph (0: off)",
    )
    p.add_argument(
        "--tp-overlap-min-tokens",
        type=_int_at_least(0),
        default=0,
        help="tp > 1: steps of this many tokens run as two halves with overlapped all-reduces (0, the "
        "default: off; e.g. 4096)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="one extra run of each case under torch.profiler (decode: --decode-steps steps): time per category "
        "(GEMM, attention, collectives, ...) in the JSON and the log",
    )
    p.add_argument(
        "--host-profile",
        action="store_true",
        help="one extra run of each case under cProfile: the host functions with the most self time "
        "(in the JSON and the log); for host-bound cases such as a prefix hit or a decode step",
    )


# ---- planning -----------------------------------------------------------------------------------
def _read_config(args: argparse.Namespace) -> dict[str, Any]:
    if args.model:
        path = os.path.join(args.model, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--model {args.model!r}: {path} not found")
    elif args.config in BUILTIN_CONFIGS:
        return dict(BUILTIN_CONFIGS[args.config])
    else:
        path = args.config
    with open(path) as f:
        return json.load(f)


def _dtype_bytes(args: argparse.Namespace, cfg: dict[str, Any]) -> int:
    name = (
        args.dtype if args.dtype != "auto" else str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    )
    return 4 if "32" in name or name == "float" else 2


def _estimate_bytes(cfg: dict[str, Any], itemsize: int, tp: int = 1) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) per device of a decoder from its config.json, for pool sizing;
    under tensor parallelism a rank holds 1/tp of the weights and of the kv heads (at least one)."""
    h, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    n_q = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_q
    hd = cfg.get("head_dim") or h // n_q
    per_layer = h * hd * (2 * n_q + 2 * n_kv) + 3 * h * cfg["intermediate_size"]
    embed = cfg["vocab_size"] * h * (1 if cfg.get("tie_word_embeddings") else 2)
    kv_heads = max(1, n_kv // tp)
    return (embed + n_layers * per_layer) * itemsize // tp, n_layers * kv_heads * hd * 2 * itemsize


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _decode_new_tokens(args: argparse.Namespace, batch: int) -> int:
    # settling steps (each request recomputes at most one page) + timed steps + margin
    return args.decode_steps + math.ceil(batch * args.page_size / args.chunked_prefill_size) + 4


def _plan(args: argparse.Namespace, cfg: dict[str, Any]) -> tuple[int, int, dict[int, str]]:
    """(context_length, max_total_tokens, {decode batch size: why it is skipped})."""
    ps = args.page_size
    singles = [n + 1 for n in args.prompt_lens] + [c + m + 1 for c, m in args.prefix_hit]
    decode_need = {}
    for b in args.decode_batch_sizes:
        per_req = args.decode_context_len + _decode_new_tokens(args, b) + 1
        singles.append(per_req)
        decode_need[b] = b * (_round_up(per_req, ps) + ps)
    context_length = _round_up(max(singles), ps)
    single_need = context_length + ps
    if args.max_total_tokens is not None:
        pool = limit = args.max_total_tokens
        holds = f"the pool holds {pool:,} (--max-total-tokens)"
    else:
        from longserve.platform import available_memory_bytes, resolve_device

        weights, kv_per_token = _estimate_bytes(cfg, _dtype_bytes(args, cfg), args.tp_size)
        total, free = available_memory_bytes(resolve_device(args.device))
        budget = total * args.mem_fraction_static - (total - free) - weights
        limit = max(int(budget // kv_per_token) // ps * ps, ps)
        # size the pool for the largest case that fits: the memory left over is the activations' headroom
        fitting = [n for n in (single_need, *decode_need.values()) if n <= limit]
        pool = min(_round_up(int(max(fitting or [single_need]) * 1.1), ps), limit)
        holds = (
            f"memory allows a pool of {limit:,} after ~{weights / _GIB:.1f} GiB of weights "
            f"(--mem-fraction-static {args.mem_fraction_static})"
        )
    if single_need > limit:
        raise ValueError(
            f"the longest request needs {single_need:,} KV tokens; {holds}: "
            "shorten the cases or raise --max-total-tokens / --mem-fraction-static"
        )
    skipped = {
        b: f"{b} x {args.decode_context_len:,}-token contexts need {need:,} KV tokens; {holds}"
        for b, need in decode_need.items()
        if need > limit
    }
    return context_length, pool, skipped


# ---- measuring ----------------------------------------------------------------------------------
def _log(msg: str) -> None:
    print(f"[bench latency {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


class _Timer:
    """Wall-clock timing and peak memory on CPU or CUDA (synchronizing around each timed region)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        self.sync()
        t0 = time.perf_counter()
        result = fn()
        self.sync()
        return result, time.perf_counter() - t0

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float | None:
        return self.torch.cuda.max_memory_allocated(self.device) / _GIB if self.cuda else None


class _EngineBench:
    def __init__(self, llm: Any, args: argparse.Namespace) -> None:
        import torch

        from longserve.sampling_params import SamplingParams

        self.llm, self.engine, self.args = llm, llm.engine, args
        self.timer = _Timer(llm.engine.runner.device)
        self.vocab = llm.engine.runner.model.vocab_size
        self.gen = torch.Generator().manual_seed(args.seed)
        self.one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        self.runs = range(args.warmup + args.repeat)
        self.decode_prompts: dict[tuple[int, int], list[list[int]]] = {}  # (batch, context) -> prompts

    def prompt(self, n: int) -> list[int]:
        import torch

        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()

    def hit_prompts(self, cached: int, new: int) -> tuple[list[int], list[int]]:
        """prefix + A and prefix + B with B[0] != A[0]: the second reuses exactly the page-aligned prefix."""
        prefix, tail_a, tail_b = self.prompt(cached), self.prompt(new), self.prompt(new)
        tail_b[0] = (tail_a[0] + 1) % self.vocab
        return prefix + tail_a, prefix + tail_b

    def generate(self, prompt: list[int]) -> tuple[Any, float]:
        out, wall = self.timer.time(lambda: self.llm.generate(prompt, self.one, use_tqdm=False)[0])
        if out.error or out.ttft is None:
            raise RuntimeError(f"a {len(prompt):,}-token request failed: {out.error or 'no first token'}")
        return out, wall

    def cold(self, n: int) -> dict[str, Any]:
        ttfts, walls = [], []
        for i in self.runs:
            self.engine.flush_cache()
            out, wall = self.generate(self.prompt(n))
            assert out.cached_tokens == 0, "a cold run hit the prefix cache"
            if i >= self.args.warmup:
                ttfts.append(out.ttft)
                walls.append(wall)
        return dict(
            ttft_s=_median(ttfts),
            wall_s=_median(walls),
            tokens_per_s=n / _median(walls),
            ttft_s_runs=ttfts,
            wall_s_runs=walls,
        )

    def prefix_hit(self, cached: int, new: int) -> dict[str, Any]:
        """Each run: a cold prompt of prefix + A (times cold TTFT and caches the prefix's full pages), then
        prefix + B with B[0] != A[0] (times the hit: exactly the page-aligned prefix is reused)."""
        ttfts, walls, cold_ttfts, cold_walls, hits = [], [], [], [], []
        for i in self.runs:
            self.engine.flush_cache()
            first, second = self.hit_prompts(cached, new)
            cold_out, cold_wall = self.generate(first)
            out, wall = self.generate(second)
            if i >= self.args.warmup:
                ttfts.append(out.ttft)
                walls.append(wall)
                cold_ttfts.append(cold_out.ttft)
                cold_walls.append(cold_wall)
                hits.append(out.cached_tokens)
        expected = cached // self.args.page_size * self.args.page_size
        if min(hits) != expected:
            _log(f"warning: prefix-hit {cached}:{new} reused {min(hits)} tokens, expected {expected}")
        return dict(
            cached_tokens=min(hits),
            expected_cached_tokens=expected,
            ttft_s=_median(ttfts),
            wall_s=_median(walls),
            tokens_per_s=(cached + new) / _median(walls),
            cold_ttft_s=_median(cold_ttfts),
            cold_wall_s=_median(cold_walls),
            speedup=_median(cold_ttfts) / _median(ttfts),
            ttft_s_runs=ttfts,
            wall_s_runs=walls,
            cold_ttft_s_runs=cold_ttfts,
        )

    def decode(self, batch: int, context: int) -> dict[str, Any]:
        """Prefill B distinct prompts once (they stay in the prefix cache); each run re-adds them, steps until
        every request decodes (each recomputes at most one page), then times `decode_steps` pure decode steps."""
        from longserve.sampling_params import SamplingParams

        self.engine.flush_cache()
        prompts = [self.prompt(context) for _ in range(batch)]
        fill = SamplingParams(max_new_tokens=0, temperature=0.0, ignore_eos=True)
        _, prefill_s = self.timer.time(lambda: self.llm.generate(prompts, fill, use_tqdm=False))
        params = SamplingParams(
            max_new_tokens=_decode_new_tokens(self.args, batch), temperature=0.0, ignore_eos=True
        )
        self.decode_prompts[(batch, context)] = prompts
        run_means, steps_ms, mixed = [], [], 0
        for i in self.runs:
            ids = self.start_decodes(prompts, params)
            times = []
            for _ in range(self.args.decode_steps):
                _, dt = self.timer.time(self.engine.step)
                stats = self.engine.last_step_stats
                mixed += stats.num_decode_tokens != batch or stats.num_prefill_tokens > 0
                times.append(dt * 1e3)
            for rid in ids:
                self.engine.abort(rid)
            if i >= self.args.warmup:
                steps_ms.extend(times)
                run_means.append(statistics.fmean(times))
        if mixed:
            _log(f"warning: decode b={batch}: {mixed} timed steps were not pure {batch}-token decodes")
        mean_ms = statistics.fmean(steps_ms)
        return dict(
            itl_ms_median=_median(steps_ms),
            itl_ms_mean=mean_ms,
            itl_ms_runs=run_means,
            tokens_per_s=batch / (mean_ms / 1e3),
            prefill_s=prefill_s,
            num_mixed_steps=mixed,
        )

    def start_decodes(self, prompts: list[list[int]], params: Any) -> list[str]:
        """Add the (prefix-cached) prompts and step until every request has its first token; their ids."""
        ids = [self.engine.add_request(p, params) for p in prompts]
        started: set[str] = set()
        while len(started) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    raise RuntimeError(
                        f"decode request {out.request_id} finished before the timed steps ({out.error or 'length'}): "
                        "its prompt fell out of the prefix cache; raise --max-total-tokens"
                    )
                if out.token_ids:
                    started.add(out.request_id)
        return ids

    def profiled_decode(self, batch: int, context: int) -> Callable[[], Any]:
        """The timed case's prompts started again outside the profiler; the profiled call is decode_steps
        pure decode steps (then the requests are aborted)."""
        from longserve.sampling_params import SamplingParams

        params = SamplingParams(
            max_new_tokens=_decode_new_tokens(self.args, batch), temperature=0.0, ignore_eos=True
        )
        ids = self.start_decodes(self.decode_prompts[(batch, context)], params)

        def steps() -> None:
            try:
                for _ in range(self.args.decode_steps):
                    self.engine.step()
            finally:
                for rid in ids:
                    self.engine.abort(rid)

        return steps

    def run_case(
        self,
        record: dict[str, Any],
        fn: Callable[[], dict[str, Any]],
        profiled: Callable[[], Callable[[], Any]] | None = None,
    ) -> None:
        """Run `fn`'s warm-up and timed runs; with --profile / --host-profile, `profiled()` sets up one more
        run (untimed) and returns the call to profile."""
        _log(f"{record['name']}: running ({self.args.warmup} warm-up + {self.args.repeat} timed)")
        self.timer.reset_peak()
        record.update(fn())
        record["peak_mem_gib"] = self.timer.peak_gib()
        self.engine.check_integrity()
        if self.args.profile and profiled is not None:
            from longserve.bench.profile import format_profile, profile_call

            _, record["profile"] = profile_call(profiled(), self.timer.device.type)
            _log(format_profile(record["name"], record["profile"]))
            self.engine.check_integrity()
        if self.args.host_profile and profiled is not None:
            from longserve.bench.profile import format_host_profile, host_profile_call

            _, record["host_profile"] = host_profile_call(profiled())
            _log(format_host_profile(record["name"], record["host_profile"]))
            self.engine.check_integrity()

    def profiled_cold(self, n: int) -> Callable[[], Any]:
        """One more cold run of n tokens (the prompt drawn before the profiler starts)."""
        self.engine.flush_cache()
        prompt = self.prompt(n)
        return lambda: self.generate(prompt)

    def profiled_hit(self, cached: int, new: int) -> Callable[[], Any]:
        """A cold prefix + A run outside the profiler; the profiled call is the prefix + B hit."""
        self.engine.flush_cache()
        first, second = self.hit_prompts(cached, new)
        self.generate(first)
        return lambda: self.generate(second)


def _record(
    case: str, name: str, prompt_len: int, num_requests: int, args: argparse.Namespace
) -> dict[str, Any]:
    return dict(
        case=case,
        name=name,
        prompt_len=prompt_len,
        num_requests=num_requests,
        warmup=args.warmup,
        repeat=args.repeat,
        skipped=None,
        peak_mem_gib=None,
    )


def _run_engine(
    args: argparse.Namespace, model_dir: str, load_format: str, plan: tuple[int, int, dict[int, str]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from longserve.llm import LLM

    context_length, pool, skipped = plan
    _log(
        f"building the engine: {args.model or args.config} ({load_format} weights), context {context_length:,}, "
        f"KV pool {pool:,} tokens"
    )
    llm = LLM(
        model_dir,
        load_format=load_format,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        page_size=args.page_size,
        chunked_prefill_size=args.chunked_prefill_size,
        mem_fraction_static=args.mem_fraction_static,
        max_total_tokens=pool,
        context_length=context_length,
        attention_backend=args.attention_backend,
        max_running_requests=max([256, *args.decode_batch_sizes]),
        tp_size=args.tp_size,
        enforce_eager=args.enforce_eager,
        tp_overlap_min_tokens=args.tp_overlap_min_tokens,
        cuda_graph_max_prefill_tokens=args.cuda_graph_max_prefill_tokens,
    )
    try:
        return _bench_engine(llm, args, skipped)
    finally:
        llm.close()  # stops tensor-parallel workers: their GPUs are free for what runs next


def _bench_engine(
    llm: Any, args: argparse.Namespace, skipped: dict[int, str]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    bench = _EngineBench(llm, args)
    records = []
    for n in args.prompt_lens:
        rec = _record("cold", f"cold-{n}", n, 1, args)
        rec.update(hf_wall_s=None, hf_wall_s_runs=None, hf_ratio=None, hf_peak_mem_gib=None)
        bench.run_case(rec, lambda n=n: bench.cold(n), lambda n=n: bench.profiled_cold(n))
        records.append(rec)
    for cached, new in args.prefix_hit:
        rec = _record("prefix_hit", f"prefix-{cached}:{new}", cached + new, 1, args)
        rec.update(cached_len=cached, new_len=new)
        bench.run_case(
            rec,
            lambda c=cached, m=new: bench.prefix_hit(c, m),
            lambda c=cached, m=new: bench.profiled_hit(c, m),
        )
        records.append(rec)
    c = args.decode_context_len
    for b in args.decode_batch_sizes:
        rec = _record("decode", f"decode-b{b}-c{c}", c, b, args)
        rec.update(batch_size=b, context_len=c, decode_steps=args.decode_steps)
        if b in skipped:
            rec["skipped"] = skipped[b]
            _log(f"{rec['name']}: skipped: {skipped[b]}")
        else:
            bench.run_case(rec, lambda b=b: bench.decode(b, c), lambda b=b: bench.profiled_decode(b, c))
        records.append(rec)
    runner = llm.engine.runner
    meta = dict(
        device=device_name(runner.device),
        dtype=str(runner.dtype).removeprefix("torch."),
        attention_backend=type(runner.backend).__name__,
        pool_tokens=runner.num_pages * runner.page_size,
        context_length=llm.engine.context_length,
        tp_size=args.tp_size,
        cuda_graphs=runner.graph_runner is not None,
    )
    return records, meta


def _run_hf(
    args: argparse.Namespace, model_dir: str, meta: dict[str, Any], records: list[dict[str, Any]]
) -> None:
    """Cold cases through HF transformers (sdpa, random weights from the same config): one prefill forward
    keeping only the last position's logits, like generate(max_new_tokens=1)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from longserve.platform import resolve_device

    device = resolve_device(args.device)
    dtype = getattr(torch, meta["dtype"])
    timer = _Timer(device)
    _log("building the HF transformers model (random weights, sdpa)")
    torch.manual_seed(args.seed)
    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    gen = torch.Generator().manual_seed(args.seed + 1)
    vocab = hf_config.vocab_size

    def forward(ids: torch.Tensor) -> int:
        with torch.inference_mode():
            logits = model(input_ids=ids, use_cache=True, logits_to_keep=1).logits
            return int(logits[0, -1].argmax())

    try:
        for rec in (r for r in records if r["case"] == "cold"):
            _log(f"{rec['name']}: running HF transformers")
            timer.reset_peak()
            walls = []
            for i in range(args.warmup + args.repeat):
                ids = torch.randint(0, vocab, (1, rec["prompt_len"]), generator=gen).to(device)
                _, wall = timer.time(lambda ids=ids: forward(ids))
                if i >= args.warmup:
                    walls.append(wall)
            rec.update(hf_wall_s=_median(walls), hf_wall_s_runs=walls, hf_peak_mem_gib=timer.peak_gib())
            rec["hf_ratio"] = rec["hf_wall_s"] / rec["wall_s"]
    finally:
        model = None  # drop the weights before anything else runs
        _free_memory()


def _free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_from_args(args: argparse.Namespace, command: str | None = None) -> list[dict[str, Any]]:
    """Run every case of parsed arguments; print the table, write --output-json, return the records."""
    if not (args.prompt_lens or args.prefix_hit or args.decode_batch_sizes):
        raise ValueError(
            "nothing to run: give --prompt-lens, --prefix-hit and/or --decode-batch-sizes "
            "(e.g. --prompt-lens 8192,32768 --prefix-hit 32768:64)"
        )
    load_format = args.load_format or ("dummy" if args.config else "auto")
    if args.config and load_format != "dummy":
        raise ValueError(f"--config has no weights: use --load-format dummy, not {load_format!r}")
    if command is None:
        command = shlex.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
    cfg = _read_config(args)
    plan = _plan(args, cfg)
    with contextlib.ExitStack() as stack:
        model_dir = args.model
        if model_dir is None:
            model_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="longserve-bench-"))
            with open(os.path.join(model_dir, "config.json"), "w") as f:
                json.dump(cfg, f, indent=2)
        records, engine_meta = _run_engine(args, model_dir, load_format, plan)
        _free_memory()  # the engine is gone: HF gets the whole device
        if args.compare_hf and args.prompt_lens:
            _run_hf(args, model_dir, engine_meta, records)
    meta = run_metadata(args, engine_meta, command, load_format)
    for rec in records:
        rec["metadata"] = meta
    print(f"# {meta['model']} on {meta['device']}, {meta['dtype']}, commit {meta['commit']}, {meta['date']}")
    print(format_table(records), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(records, f, indent=2)
        _log(f"wrote {len(records)} records to {args.output_json}")
    return records


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longserve bench latency", description=__doc__.splitlines()[0])
    add_latency_args(parser)
    return parser


def run_latency(args_list: list[str] | None = None) -> list[dict[str, Any]]:
    """Parse `longserve bench latency` flags (None: sys.argv[1:]) and run; bad flags exit with code 2."""
    argv = sys.argv[1:] if args_list is None else list(args_list)
    args = build_parser().parse_args(argv)
    return run_from_args(args, command=shlex.join(["longserve", "bench", "latency", *argv]))


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_latency(argv)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
