"""GPU probe: when does a prompt's first token leave the engine, against when the device finished its
prefill? Four requests decode; a prompt A arrives, and a prompt B one step later (the HTTP random workload's
pattern: 2026-12-02, a prefill's first token reached clients one whole step late when the next step held
another prefill). Per Engine.step call, the host's phases (schedule, forward queued, the earlier step read,
sampling queued) and the device's span of the step's forward (CUDA events), in ms from A's arrival; then
A's and B's first token: device done vs handed out. Overlapped schedule on, then off.
On a CUDA GPU: python3 scripts/probes/step_timeline.py (PROBE_SCALE=0.05 and --config tiny: a CPU dry run).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from longserve.bench import latency
from longserve.bench.latency_cases import EngineBench

SCALE = float(os.environ.get("PROBE_SCALE", "1"))
PROFILE = os.environ.get("PROBE_PROFILE", "1") == "1"  # torch.profiler around the measured mixed step
RUNNING, LEN_A, LEN_B = int(1500 * SCALE), int(1232 * SCALE), int(1683 * SCALE)


class Timeline:
    """Wraps the engine's runner.forward, runner.sample and _complete with host clocks and device events."""

    def __init__(self, eng) -> None:  # noqa: ANN001
        import torch

        self.eng, self.cuda = eng, eng.runner.device.type == "cuda"
        self.rows: list[dict] = []
        self.t0 = time.perf_counter()
        self.base = None
        forward, sample, complete = eng.runner.forward, eng.runner.sample, eng._complete

        def timed_forward(out, prev=None):  # noqa: ANN001, ANN202
            row = self.row()
            row["forward_in"] = self.now()
            if self.cuda:
                row["ev0"] = torch.cuda.Event(enable_timing=True)
                row["ev0"].record()
            result = forward(out, prev)
            if self.cuda:
                row["ev1"] = torch.cuda.Event(enable_timing=True)
                row["ev1"].record()
            row["forward_out"] = self.now()
            row["tokens"] = out.num_batched_tokens
            return result

        def timed_sample(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            result = sample(*a, **kw)
            self.row()["sample_out"] = self.now()
            return result

        def timed_complete(launched, touched):  # noqa: ANN001, ANN202
            row = self.row()
            row.setdefault("complete_in", self.now())
            complete(launched, touched)
            row["complete_out"] = self.now()

        eng.runner.forward, eng.runner.sample, eng._complete = timed_forward, timed_sample, timed_complete

    def row(self) -> dict:
        """The record of the Timeline.step call running now (a scratch one outside them)."""
        return self.rows[-1] if self.rows and "end" not in self.rows[-1] else {}

    def now(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3

    def start(self) -> None:
        import torch

        self.t0 = time.perf_counter()
        self.rows.clear()
        if self.cuda:
            self.base = torch.cuda.Event(enable_timing=True)
            self.base.record()

    def step(self) -> list:
        self.rows.append({"call": self.now()})
        outs = self.eng.step()
        self.rows[-1]["end"] = self.now()
        return outs

    def device_span(self, row: dict) -> tuple[float, float]:
        if not self.cuda or "ev1" not in row:
            return float("nan"), float("nan")
        row["ev1"].synchronize()
        return self.base.elapsed_time(row["ev0"]), self.base.elapsed_time(row["ev1"])


def probe(llm, args, skipped):  # noqa: ANN001, ANN201
    from longserve.sampling_params import SamplingParams

    eng = llm.engine
    bench = EngineBench(llm, args)
    timeline = Timeline(eng)
    params = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
    results: list[bool] = []
    for overlap in (True, False, True, False, True):  # the first pair warms up; the last is profiled
        eng.overlap = overlap
        for _ in range(4):
            eng.add_request(bench.prompt(RUNNING), params)
        while any(len(r.output_token_ids) < 2 for r in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()
        timeline.start()
        a = eng.add_request(bench.prompt(LEN_A), params)
        first: dict[str, float] = {}
        b = None
        for i in range(8):
            profile = PROFILE and i == 0 and len(results) == 4  # a run of its own: the timelines stay clean
            with host_profile(profile) as prof:
                outs = timeline.step()
            if profile:
                print_host_waits(prof)
            for out in outs:
                if out.outputs[0].token_ids and out.request_id not in first:
                    first[out.request_id] = timeline.now()
            if i == 0:
                b = eng.add_request(bench.prompt(LEN_B), params)
                timeline.rows[-1]["added B"] = timeline.now()
        print(f"\noverlap={overlap}: 4 decoding, A ({LEN_A}) at 0, B ({LEN_B}) after the first step (ms):")
        print("call  tokens  forward queued  earlier read  sampling queued  returned  device span")
        for n, row in enumerate(timeline.rows):
            d0, d1 = timeline.device_span(row)
            print(
                f"{n:>4}  {row.get('tokens', 0):>6}  {row.get('forward_in', float('nan')):7.1f}"
                f"-{row.get('forward_out', float('nan')):<7.1f} {row.get('complete_out', float('nan')):11.1f}"
                f"  {row.get('sample_out', float('nan')):15.1f}  {row['end']:8.1f}  {d0:7.1f}-{d1:.1f}"
            )
        for name, rid in (("A", a), ("B", b)):
            print(f"  {name}: first token handed out at {first.get(rid, float('nan')):.1f} ms")
        while eng.has_unfinished():
            eng.step()
        results.append(overlap)
    sys.exit(0)


@contextlib.contextmanager
def host_profile(on: bool):  # noqa: ANN201
    """torch.profiler around one step (CPU ops and CUDA runtime calls, with Python stacks), or nothing."""
    if not on:
        yield None
        return
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, with_stack=True, record_shapes=False) as prof:
        yield prof


def print_host_waits(prof) -> None:  # noqa: ANN001
    """Where the profiled step's host time went: the ops and CUDA runtime calls by their own time (a wait
    for the device shows as a long cudaStreamSynchronize / cudaMemcpy...), then the Python functions by
    their own time (interpreter overhead: a step whose launch is slower than its kernels)."""
    print("\nthe first overlapped step's host time, ops and runtime calls by self time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
    frames: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CPU" and ".py(" in e.name:
            acc = frames.setdefault(e.name.split("/")[-1][:90], [0.0, 0.0, 0])
            acc[0] += e.self_cpu_time_total / 1e3
            acc[1] += e.cpu_time_total / 1e3
            acc[2] += 1
    print("Python functions by self ms (self, total, calls):")
    for name, (own, total, calls) in sorted(frames.items(), key=lambda kv: -kv[1][0])[:30]:
        print(f"  {own:7.2f} {total:8.2f} {calls:5d}  {name}")


if __name__ == "__main__":
    extra = sys.argv[1:] or ["--config", "llama-3.1-8b", "--dtype", "bfloat16"]
    latency.run_latency(["--load-format", "dummy", "--prompt-lens", "8192", *extra], measure=probe)
