"""GPU probe: where the wall time of a prefix hit (32K cached + 64 new, Llama-3.1-8B shape, dummy weights) goes
on the host and on the device, segment by segment, without a profiler's overhead. Each segment's host time
is wall time inside it (no syncs added); `gpu` is CUDA-event time from the forward's start to the sampled
tokens; `wait` is how long reading them back blocked. On a CUDA GPU: python3 scripts/probes/probe_hit.py
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

from longserve.attention import metadata
from longserve.bench import latency
from longserve.bench.latency_cases import EngineBench
from longserve.kernels.launch import FastKernel
from longserve.runner import inputs, model_runner, sampled

SEGMENTS: dict[str, list[float]] = defaultdict(list)
CACHED = int(os.environ.get("PROBE_CACHED", "32768"))  # a smaller prefix for a CPU dry run
NEW = int(os.environ.get("PROBE_NEW", "64"))  # new tokens after the cached prefix
GC = os.environ.get("PROBE_GC", "on")  # on | freeze (gc.freeze() once the engine is built) | off
_gc_start: list[float] = []


def _gc_pause(phase: str, info: dict) -> None:
    """gc callback: each collection's pause, by generation, into SEGMENTS."""
    if phase == "start":
        _gc_start[:] = [time.perf_counter()]
    elif _gc_start:
        SEGMENTS[f"gc gen{info['generation']} pauses"].append((time.perf_counter() - _gc_start[0]) * 1e3)


def timed(name, fn):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            SEGMENTS[name].append((time.perf_counter() - t0) * 1e3)

    return wrapper


def probe(llm, args, skipped):
    eng, runner = llm.engine, llm.engine.runner
    eng.scheduler.schedule = timed("schedule", eng.scheduler.schedule)
    eng.scheduler.advance = timed("advance (cache insert)", eng.scheduler.advance)
    eng.scheduler.commit = timed("commit", eng.scheduler.commit)
    eng.tokens.process = timed("process token", eng.tokens.process)
    model_runner.build_step = timed("build_step", model_runner.build_step)
    model_runner.to_model_inputs = timed("to_model_inputs", model_runner.to_model_inputs)
    # inside to_model_inputs: the host's index math, and the two pinned copies to the device (metadata._to_device)
    inputs.build_step_tensors = timed("  build_step_tensors", inputs.build_step_tensors)
    metadata._to_device = timed("    pinned copies (2)", metadata._to_device)
    if (graphs := runner.extend_graphs) is not None:
        graphs.run = timed("graph replay (launch)", graphs.run)
        # inside it: the static inputs' copies, the backends' own (the packed call's page table), the launch
        graphs.tokens.load = timed("  static token copies", graphs.tokens.load)
        for b in {id(b): b for b in [*graphs.backends.values(), *graphs.packed.values()]}.values():
            b.prepare_for_replay = timed("  backend prepare_for_replay", b.prepare_for_replay)
        torch.cuda.CUDAGraph.replay = timed("  CUDAGraph.replay", torch.cuda.CUDAGraph.replay)
    runner.model.compute_logits = timed("logits (launch)", runner.model.compute_logits)
    events = []
    forward = runner.forward_step

    cuda = runner.device.type == "cuda"

    def forward_step(step, prev_tokens=None, early=None):
        if not cuda:
            return forward(step, prev_tokens, early)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = forward(step, prev_tokens, early)
        end.record()
        events.append((start, end))
        return out

    runner.forward_step = timed("forward_step (host)", forward_step)
    runner.step_sampler.sampler = timed("sampler (launch)", runner.step_sampler.sampler)
    runner.prepare = timed("runner.prepare (inputs)", runner.prepare)
    runner.launch = timed("runner.launch (all)", runner.launch)
    runner.sample = timed("runner.sample (all)", runner.sample)
    sampled.SampledStep.result = timed("read tokens (wait)", sampled.SampledStep.result)
    bench = EngineBench(llm, args)
    gc.callbacks.append(_gc_pause)
    if GC == "freeze":
        gc.collect()
        gc.freeze()
    elif GC == "off":
        gc.disable()
    ttfts, walls = [], []
    kept: dict[str, list[float]] = defaultdict(list)
    for i in range(8):
        eng.flush_cache()
        first, second = bench.hit_prompts(CACHED, NEW)
        bench.generate(first)
        SEGMENTS.clear()
        events.clear()
        out, wall = bench.generate(second)
        if i >= 2:
            ttfts.append(out.ttft * 1e3)
            walls.append(wall * 1e3)
            if events:
                SEGMENTS["gpu forward (events)"].append(events[-1][0].elapsed_time(events[-1][1]))
            for k, v in SEGMENTS.items():
                kept[k].append(sum(v))
    print(
        f"PROBE_GC={GC} PROBE_NEW={NEW} fast launch={FastKernel.enabled}; ttft runs "
        + " ".join(f"{t:.1f}" for t in ttfts)
    )
    print(
        f"ttft {statistics.median(ttfts):.2f} ms, generate wall {statistics.median(walls):.2f} ms (median of 6)"
    )
    for k, v in kept.items():
        if k.startswith("gc"):  # not every run collects: the pauses of each run that did
            print(f"  {k:<28} in {len(v)} of {len(ttfts)} runs: " + " ".join(f"{x:.2f}" for x in v) + " ms")
        else:
            print(f"  {k:<28} {statistics.median(v):7.3f} ms", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    extra = sys.argv[1:] or ["--config", "llama-3.1-8b", "--dtype", "bfloat16"]
    latency.run_latency(["--load-format", "dummy", "--prefix-hit", f"{CACHED}:{NEW}", *extra], measure=probe)
