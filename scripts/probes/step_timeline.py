"""GPU probe: when does a prompt's first token leave the engine, against when the device finished its
prefill? Four requests decode; a prompt A arrives, and a prompt B one step later (the HTTP random workload's
pattern: 2026-12-02, a prefill's first token reached clients one whole step late when the next step held
another prefill: that step's eager launch took the host as long as the device took to run it, 31 ms for
1.2K tokens of an 8B model, and the engine read the earlier step only after it). Per Engine.step call, the
host's phases (launch, the earlier step read, sampling queued) and the device's span of the step's forward
(CUDA events), in ms from A's arrival; then when A's and B's first tokens were handed out. Three modes: the
overlapped schedule, the plain one, and the overlapped one with on_outputs (the server's: tokens in flight
handed out before a prefill step's launch). PROBE_PROFILE=1: one more run, its mixed step under
torch.profiler (host time by op and by Python function).
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
PROFILE = os.environ.get("PROBE_PROFILE", "0") == "1"  # one more run: torch.profiler around its mixed step
RUNNING, LEN_A, LEN_B = int(1500 * SCALE), int(1232 * SCALE), int(1683 * SCALE)


class Timeline:
    """Wraps the engine's runner.launch, runner.sample and _complete with host clocks and device events."""

    def __init__(self, eng) -> None:  # noqa: ANN001
        import torch

        self.eng, self.cuda = eng, eng.runner.device.type == "cuda"
        self.rows: list[dict] = []
        self.t0 = time.perf_counter()
        self.base = None
        launch, sample, complete = eng.runner.launch, eng.runner.sample, eng._complete

        def timed_launch(step, prev=None, early=None):  # noqa: ANN001, ANN202
            row = self.row()
            row["forward_in"] = self.now()
            if self.cuda:
                row["ev0"] = torch.cuda.Event(enable_timing=True)
                row["ev0"].record()
            result = launch(step, prev, early)
            if self.cuda:
                row["ev1"] = torch.cuda.Event(enable_timing=True)
                row["ev1"].record()
            row["forward_out"] = self.now()
            row["tokens"] = len(step.input_ids)
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

        eng.runner.launch, eng.runner.sample, eng._complete = timed_launch, timed_sample, timed_complete

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

    def step(self, first: dict[str, float], hand_out_first: bool) -> None:
        """One Engine.step; `first`: request id -> when its first token was handed out (ms)."""

        def seen(outs: list) -> None:
            for out in outs:
                if out.outputs[0].token_ids and out.request_id not in first:
                    first[out.request_id] = self.now()

        self.rows.append({"call": self.now()})
        seen(self.eng.step(on_outputs=seen if hand_out_first else None))
        self.rows[-1]["end"] = self.now()

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
    modes = [
        ("overlapped", True, False),
        ("plain", False, False),
        ("overlapped, handed out first", True, True),
    ]
    runs = modes * 2 + ([modes[0]] if PROFILE else [])  # the first three warm up; the profiled one is extra
    for n_run, (label, overlap, hand_out_first) in enumerate(runs):
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
            profile = i == 0 and n_run == 6  # a run of its own: the timelines stay clean
            with host_profile(profile) as prof:
                timeline.step(first, hand_out_first)
            if profile:
                print_host_waits(prof)
            if i == 0:
                b = eng.add_request(bench.prompt(LEN_B), params)
        if n_run < len(modes):
            while eng.has_unfinished():
                eng.step()
            continue
        print(f"\n{label}: 4 decoding, A ({LEN_A}) at 0, B ({LEN_B}) after the first step (ms):")
        print("call  tokens  launch         earlier read  sampling queued  returned  device span")
        for n, row in enumerate(timeline.rows):
            d0, d1 = timeline.device_span(row)
            print(
                f"{n:>4}  {row.get('tokens', 0):>6}  {row.get('forward_in', float('nan')):6.1f}"
                f"-{row.get('forward_out', float('nan')):<7.1f} {row.get('complete_out', float('nan')):11.1f}"
                f"  {row.get('sample_out', float('nan')):15.1f}  {row['end']:8.1f}  {d0:7.1f}-{d1:.1f}"
            )
        for name, rid in (("A", a), ("B", b)):
            print(f"  {name}: first token handed out at {first.get(rid, float('nan')):.1f} ms")
        while eng.has_unfinished():
            eng.step()
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
    # kernels, memcpys and memsets only: an aten op's row carries the device time of the kernels it launched, which
    # have rows of their own (with them the sum read 35.5 ms where torch's self CUDA total was 31.0: RESULTS.md
    # twentieth session)
    kernels = [
        e for e in prof.key_averages() if e.self_device_time_total > 0 and not e.key.startswith("aten::")
    ]
    if kernels:  # the step's device time by kernel: what a prompt step costs beyond its tokens' GEMMs
        total = sum(e.self_device_time_total for e in kernels) / 1e3
        print(f"the step's kernels by device time (sum {total:.2f} ms):")
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]:
            print(f"  {e.self_device_time_total / 1e3:8.3f} ms {e.count:5d}x  {e.key[:100]}")
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
