"""The cases of `bench latency` and their timing on one engine: cold TTFT per prompt length, TTFT over a
cached prefix, and decode inter-token latency per batch size (warm-up runs, then timed runs, medians), each
optionally profiled in one more, untimed run. Engine settings are read from the engine's own config."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from longserve.bench.latency_plan import decode_cases, decode_new_tokens
from longserve.bench.report import device_name

_GIB = 2**30

# measure(llm, args, skipped decode batch sizes) -> (records, engine metadata): what runs on the built engine
Measure = Callable[[Any, argparse.Namespace, dict[int, str]], tuple[list[dict[str, Any]], dict[str, Any]]]


def log(msg: str) -> None:
    print(f"[bench latency {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def free_memory() -> None:
    """Collect what a finished engine or model left, so that the next one gets the whole device."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Timer:
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


class EngineBench:
    """The timed cases on `llm` (an LLM); `args` holds the cases' own options (warm-up, repeats, steps)."""

    def __init__(self, llm: Any, args: argparse.Namespace) -> None:
        import torch

        from longserve.sampling_params import SamplingParams

        self.llm, self.engine, self.args = llm, llm.engine, args
        self.config = llm.config
        self.timer = Timer(llm.engine.runner.device)
        self.vocab = llm.engine.runner.model.vocab_size
        self.gen = torch.Generator().manual_seed(self.config.seed)
        self.one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        self.runs = range(args.warmup + args.repeat)
        self.decode_prompts: dict[tuple[int, int], list[list[int]]] = {}  # (batch, context) -> prompts

    def prompt(self, n: int) -> list[int]:
        import torch

        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()

    def hit_prompts(self, cached: int, new: int, n: int = 2) -> list[list[int]]:
        """prefix + A, prefix + B, ... (n of them), each tail's first token unlike the others': each after the
        first reuses exactly the page-aligned prefix."""
        prefix, tails = self.prompt(cached), [self.prompt(new) for _ in range(n)]
        for i, tail in enumerate(tails):
            tail[0] = (tails[0][0] + i) % self.vocab
        return [prefix + tail for tail in tails]

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
            ttft_s=median(ttfts),
            wall_s=median(walls),
            tokens_per_s=n / median(walls),
            ttft_s_runs=ttfts,
            wall_s_runs=walls,
        )

    def prefix_hit(self, cached: int, new: int) -> dict[str, Any]:
        """Each run: a cold prompt of prefix + A (times cold TTFT and caches the prefix's full pages), then
        prefix + B with B[0] != A[0] (times the hit: exactly the page-aligned prefix is reused). A hybrid model
        (Qwen3.5) resumes only where a state was saved: an untimed prefix + C between them leaves A's path at
        the prefix's end and saves it there (cache/state_radix_tree.py), as a document's second question does."""
        ttfts, walls, cold_ttfts, cold_walls, hits = [], [], [], [], []
        states = self.engine.kv.prefix_cache.keeps_states
        for i in self.runs:
            self.engine.flush_cache()
            first, second, *junction = self.hit_prompts(cached, new, 3 if states else 2)
            cold_out, cold_wall = self.generate(first)
            for prompt in junction:
                self.generate(prompt)
            out, wall = self.generate(second)
            if i >= self.args.warmup:
                ttfts.append(out.ttft)
                walls.append(wall)
                cold_ttfts.append(cold_out.ttft)
                cold_walls.append(cold_wall)
                hits.append(out.cached_tokens)
        expected = cached // self.config.page_size * self.config.page_size
        if min(hits) != expected:
            log(f"warning: prefix-hit {cached}:{new} reused {min(hits)} tokens, expected {expected}")
        return dict(
            cached_tokens=min(hits),
            expected_cached_tokens=expected,
            ttft_s=median(ttfts),
            wall_s=median(walls),
            tokens_per_s=(cached + new) / median(walls),
            cold_ttft_s=median(cold_ttfts),
            cold_wall_s=median(cold_walls),
            speedup=median(cold_ttfts) / median(ttfts),
            ttft_s_runs=ttfts,
            wall_s_runs=walls,
            cold_ttft_s_runs=cold_ttfts,
        )

    def decode_params(self, batch: int) -> Any:
        from longserve.sampling_params import SamplingParams

        new_tokens = decode_new_tokens(self.args.decode_steps, batch, self.config)
        return SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def decode(self, batch: int, context: int) -> dict[str, Any]:
        """Prefill B distinct prompts once (they stay in the prefix cache); each run re-adds them, steps until
        every request decodes (each recomputes at most one page), then times `decode_steps` pure decode steps."""
        from longserve.sampling_params import SamplingParams

        self.engine.flush_cache()
        prompts = [self.prompt(context) for _ in range(batch)]
        fill = SamplingParams(max_new_tokens=0, temperature=0.0, ignore_eos=True)
        _, prefill_s = self.timer.time(lambda: self.llm.generate(prompts, fill, use_tqdm=False))
        params = self.decode_params(batch)
        self.decode_prompts[(batch, context)] = prompts
        run_means, steps_ms, mixed = [], [], 0
        for i in self.runs:
            ids = self.start_decodes(prompts, params)
            times = []
            # each step() returns once a step's tokens are read, so the time between returns is a step's,
            # also when the overlapped schedule leaves the next step running: no sync between steps. Under
            # that schedule a step is in flight here, finished by the sync: the first step() after it only
            # reads it and launches the next (host time), so one untimed step() first. Timed from the sync,
            # 1 of 32 intervals was ~1 ms (8B on an H200, 0949067: the mean 2-3% under the median)
            self.timer.sync()
            self.engine.step()
            last = time.perf_counter()
            for _ in range(self.args.decode_steps):
                self.engine.step()
                now = time.perf_counter()
                stats = self.engine.last_step_stats
                mixed += stats.num_decode_tokens != batch or stats.num_prefill_tokens > 0
                times.append((now - last) * 1e3)
                last = now
            for rid in ids:
                self.engine.abort(rid)
            if i >= self.args.warmup:
                steps_ms.extend(times)
                run_means.append(statistics.fmean(times))
        if mixed:
            log(f"warning: decode b={batch}: {mixed} timed steps were not pure {batch}-token decodes")
        mean_ms = statistics.fmean(steps_ms)
        return dict(
            itl_ms_median=median(steps_ms),
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
        ids = self.start_decodes(self.decode_prompts[(batch, context)], self.decode_params(batch))

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
        log(f"{record['name']}: running ({self.args.warmup} warm-up + {self.args.repeat} timed)")
        self.timer.reset_peak()
        record.update(fn())
        record["peak_mem_gib"] = self.timer.peak_gib()
        self.engine.check_integrity()
        if self.args.profile and profiled is not None:
            from longserve.bench.profile import format_profile, profile_call

            _, record["profile"] = profile_call(profiled(), self.timer.device.type)
            log(format_profile(record["name"], record["profile"]))
            self.engine.check_integrity()
        if self.args.host_profile and profiled is not None:
            from longserve.bench.profile import format_host_profile, host_profile_call

            _, record["host_profile"] = host_profile_call(profiled())
            log(format_host_profile(record["name"], record["host_profile"]))
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


def bench_engine(
    llm: Any, args: argparse.Namespace, skipped: dict[int, str]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every case of `args` on `llm`, in order (cold, prefix hit, decode); (records, engine metadata)."""
    bench = EngineBench(llm, args)
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
    for b, c in decode_cases(args):
        rec = _record("decode", f"decode-b{b}-c{c}", c, b, args)
        rec.update(batch_size=b, context_len=c, decode_steps=args.decode_steps)
        if (b, c) in skipped:
            rec["skipped"] = skipped[b, c]
            log(f"{rec['name']}: skipped: {skipped[b, c]}")
        else:
            bench.run_case(
                rec, lambda b=b, c=c: bench.decode(b, c), lambda b=b, c=c: bench.profiled_decode(b, c)
            )
        records.append(rec)
    runner = llm.engine.runner
    meta = dict(
        device=device_name(runner.device),
        dtype=str(runner.dtype).removeprefix("torch."),
        attention_backend=type(runner.backend).__name__,
        pool_tokens=runner.num_pages * llm.config.page_size,
        context_length=llm.engine.context_length,
        tp_size=llm.config.tp_size,
        cuda_graphs=runner.graph_runner is not None,
        weight_bytes=runner.memory_plan["weight_bytes"],  # this rank's, quantized formats' scales included
        kv_bytes_per_token=runner.memory_plan["kv_bytes_per_token"],
        lone_prefill_chunk_size=runner.lone_prefill_chunk_size,  # as resolved for the model
        chunk_granule=runner.backend.chunk_granule,  # where its chunks past the first end
    )
    return records, meta
