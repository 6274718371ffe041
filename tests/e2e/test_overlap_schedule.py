"""The overlapped schedule (EngineConfig.overlap_schedule) against the plain one: step N+1 is planned and
launched before step N's tokens are read, its decodes taking their input ids from N's sampled ids on the
device. On the CPU nothing runs concurrently, but every path of the mechanism does (pending tokens, the
device gather, wasted rows of requests that stop, preemption and aborts with a step in flight), so the
outputs must equal the plain schedule's token for token, and the pages must all come back."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch

from longserve import LLM, SamplingParams
from longserve.testing.checkpoints import make_tiny_checkpoint
from tests.e2e.test_engine import DEVICE, assert_clean


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def prompts(n, seed=0, shared=24):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(10, 500, (shared,), generator=g).tolist()
    return [head + torch.randint(10, 500, (3 + 11 * i,), generator=g).tolist() for i in range(n)]


def make(ckpt, overlap, **kw):
    kw.setdefault("max_total_tokens", 4096)
    return LLM(ckpt, dtype="float32", device=DEVICE, overlap_schedule=overlap, **kw)


class Probe:
    """Counts, on an engine's runner, the inputs taken from a previous step's ids on the device."""

    def __init__(self, engine):
        self.gathered = 0
        self.steps_left_running = 0
        forward = engine.runner.forward_step

        def forward_step(step, prev_tokens=None, early=None):
            self.gathered += len(step.pending_dst)
            return forward(step, prev_tokens, early)

        engine.runner.forward_step = forward_step


def drive(engine, ids_list, params_list, probe=None, between=None):
    """Add the requests, step until all end; {request id: final RequestOutput}. `between(step_index)` runs
    between steps (aborts, new requests)."""
    for i, (ids, p) in enumerate(zip(ids_list, params_list)):
        engine.add_request(ids, p, request_id=f"r{i}")
    final, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if probe is not None and engine._in_flight is not None:
            probe.steps_left_running += 1
        steps += 1
        if between is not None:
            between(steps)
        assert steps < 2000
    return final


def summary(final):
    return {
        rid: (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason, o.error)
        for rid, o in sorted(final.items())
    }


def mixed_params(eos_like):
    """Greedy and seeded sampling, lengths that end by max_tokens, a stop token that greedy decoding hits,
    min_tokens, logprobs."""
    return [
        SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True, logprobs=3),
        SamplingParams(max_new_tokens=30, temperature=0.0, stop_token_ids=[eos_like]),
        SamplingParams(max_new_tokens=1, temperature=0.0),
        SamplingParams(
            max_new_tokens=16, temperature=1.0, top_k=20, seed=3, min_new_tokens=5, ignore_eos=True
        ),
        SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0),
    ]


def a_token_greedy_emits(ckpt, ids):
    """A token the plain engine's greedy output of `ids` reaches after a few steps: as a stop token it
    ends that request early, mid-batch (the wasted row of the overlapped schedule)."""
    out = make(ckpt, False).generate(ids, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    return out[0].token_ids[6]


def test_overlap_equals_plain_schedule(ckpt):
    ids = prompts(6)
    stop = a_token_greedy_emits(ckpt, ids[2])
    results = {}
    for overlap in (False, True):
        m = make(ckpt, overlap, page_size=16, chunked_prefill_size=64)
        probe = Probe(m.engine)
        final = drive(m.engine, ids, mixed_params(stop), probe)
        results[overlap] = summary(final)
        if overlap:
            assert m.engine.overlap
            assert probe.gathered > 20 and probe.steps_left_running > 10  # it did overlap
            logprobs = [(o.outputs[0].logprobs, o.outputs[0].top_logprobs) for _, o in sorted(final.items())]
        else:
            assert probe.gathered == 0 and probe.steps_left_running == 0
            plain_logprobs = [
                (o.outputs[0].logprobs, o.outputs[0].top_logprobs) for _, o in sorted(final.items())
            ]
        assert_clean(m.engine)
    assert results[True] == results[False]
    assert results[True]["r2"][1] == "stop" and len(results[True]["r2"][0]) == 7  # stopped mid-batch
    # equal up to rounding: a wasted row changes the batch, and with it the matmuls' reduction order
    for (lps, tops), (plain_lps, plain_tops) in zip(logprobs, plain_logprobs):
        assert (lps is None) == (plain_lps is None) and (tops is None) == (plain_tops is None)
        if lps is not None:
            assert lps == pytest.approx(plain_lps, abs=1e-4)
        for row, plain_row in zip(tops or [], plain_tops or []):
            assert [t for t, _ in row] == [t for t, _ in plain_row]
            assert [v for _, v in row] == pytest.approx([v for _, v in plain_row], abs=1e-4)


def test_no_wasted_rows_when_the_last_token_is_known(ckpt):
    """Requests that end by max_tokens are never planned past their last token: the overlapped engine
    computes exactly the plain engine's tokens (a stop token costs one row, checked above)."""
    ids = prompts(4, seed=1)
    params = [SamplingParams(max_new_tokens=5 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(4)]
    computed = {}
    for overlap in (False, True):
        m = make(ckpt, overlap, enable_prefix_caching=False)
        outs = m.generate(ids, params)
        computed[overlap] = (m.engine.runner.num_tokens_computed, [o.token_ids for o in outs])
        assert_clean(m.engine)
    assert computed[True] == computed[False]


def test_preemption_and_chunks_with_a_step_in_flight(ckpt):
    """A pool too small for every request: requests are preempted while their token is pending, and
    recompute it; chunked prefill and the prefix cache run alongside. Same tokens as the plain schedule."""
    ids = prompts(5, seed=2, shared=40)
    params = [SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)] * 5
    results = {}
    for overlap in (False, True):
        m = make(ckpt, overlap, page_size=16, max_total_tokens=16 * 14, chunked_prefill_size=32)
        final = drive(m.engine, ids, params)
        results[overlap] = summary(final)
        assert m.engine.scheduler.num_preemptions > 0
        assert_clean(m.engine)
    assert results[True] == results[False]


def test_abort_and_arrivals_between_overlapped_steps(ckpt):
    """Aborting a request whose token is in flight drops that token and frees its pages at once; a request
    arriving mid-run joins; the others' tokens are unchanged."""
    ids = prompts(4, seed=3)
    params = [SamplingParams(max_new_tokens=18, temperature=0.0, ignore_eos=True)] * 3
    late = ids[3]

    aborted = {}

    def events(engine, overlap):
        def between(step):
            if step == 4:
                out = engine.abort("r1")
                assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
                aborted[overlap] = out.outputs[0].token_ids
                engine.check_integrity()
            if step == 6:
                engine.add_request(late, params[0], request_id="late")

        return between

    results = {}
    for overlap in (False, True):
        m = make(ckpt, overlap)
        final = drive(m.engine, ids[:3], params, between=events(m.engine, overlap))
        results[overlap] = summary(final)
        assert_clean(m.engine)
    assert results[True] == results[False] and len(results[True]["late"][0]) == 18
    # the overlapped engine reports a step later, so the abort finds fewer tokens read; the same ones
    assert 1 <= len(aborted[True]) <= len(aborted[False]) < 18
    assert aborted[True] == aborted[False][: len(aborted[True])]


def test_penalties_and_grammars_see_every_token(ckpt, tmp_path):
    """Penalties count the output so far and a grammar's mask needs the last token accepted: the
    overlapped engine samples step N+1 only after step N is read (its forward pass queued first), so they
    see the same tokens as in the plain schedule; the grammars' outputs hold."""
    from tests.fixtures.tool_checkpoints import make_tool_checkpoint

    ids = prompts(3, seed=4)
    params = [
        SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_new_tokens=24, temperature=0.7, seed=5, ignore_eos=True, frequency_penalty=0.5),
    ]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"]}  # fmt: skip
    tool_ckpt = make_tool_checkpoint(tmp_path / "qwen25", "qwen25")
    constrained = [
        SamplingParams(max_new_tokens=300, temperature=1.0, seed=9, structured_outputs={"json": schema}),
        SamplingParams(
            max_new_tokens=40, temperature=0.0, structured_outputs={"regex": r"[a-z]{2,5}-[0-9]{3}"}
        ),
        SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True),
    ]
    results, texts = {}, {}
    for overlap in (False, True):
        m = make(ckpt, overlap)
        probe = Probe(m.engine)
        results[overlap] = summary(drive(m.engine, ids, params, probe))
        assert (probe.steps_left_running > 5) == overlap
        assert_clean(m.engine)
        g = LLM(tool_ckpt, dtype="float32", device=DEVICE, max_total_tokens=4096, overlap_schedule=overlap,
                structured_outputs_max_whitespace=2)  # fmt: skip
        outs = g.generate(["The weather in Paris is", "Code:", "Hello"], constrained)
        texts[overlap] = [(o.text, o.token_ids, o.finish_reason) for o in outs]
        assert_clean(g.engine)
    assert results[True] == results[False]
    assert texts[True] == texts[False]
    obj = json.loads(texts[True][0][0])
    assert set(obj) == {"n", "ok"} and texts[True][0][2] == "stop"
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", texts[True][1][0])


def test_stop_strings_and_siblings(ckpt):
    """Text stop strings (found after the token is read, so the next row is wasted) and n > 1 siblings
    sharing a prompt, through LLM.generate."""
    m0 = make(ckpt, False)
    text = m0.generate(
        "The quick brown fox", SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    )
    stop = text[0].text[len(text[0].text) // 2 :][:3]
    assert stop.strip(), "the tiny model's text has no usable stop string"
    params = [
        SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop]),
        SamplingParams(max_new_tokens=8, temperature=0.9, seed=11, n=3, ignore_eos=True),
    ]
    outs = {}
    for overlap in (False, True):
        m = make(ckpt, overlap)
        res = m.generate(["The quick brown fox", "Once upon a time"], params)
        outs[overlap] = [[(c.text, c.token_ids, c.finish_reason) for c in r.outputs] for r in res]
        assert_clean(m.engine)
    assert outs[True] == outs[False]
    assert outs[True][0][0][2] == "stop"


def test_tokens_in_flight_are_handed_out_before_a_prefill_launch(ckpt):
    """With on_outputs (the server's), a step that computes prompt tokens reads the step in flight and hands
    its tokens out as its own launch begins (an eager launch takes as long as the device's run of it; in the
    piecewise graphs once its first layers are queued: tests/unit/test_piecewise_graphs.py), not after it; the
    tokens equal the plain schedule's and the pages all come back."""
    first, second = prompts(2, seed=5, shared=0)  # no shared head: b computes its whole prompt
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    plain = make(ckpt, False).generate([first, second], params)
    m = make(ckpt, True)
    engine, events = m.engine, []
    launch = engine.runner.launch
    engine.runner.launch = lambda step, prev=None, early=None: (
        events.append(("launch", len(step.input_ids))) or launch(step, prev, early)
    )

    def on_outputs(outs):
        events.append(("out", [(o.request_id, len(o.outputs[0].token_ids)) for o in outs]))

    engine.add_request(first, params, request_id="a")
    engine.step(on_outputs=on_outputs)  # a's prompt
    assert engine.last_step_stats.read_time == -1.0  # nothing was in flight: nothing read (the step log's -1)
    engine.step(on_outputs=on_outputs)  # a's first decode, in flight; a's first token read
    engine.add_request(second, params, request_id="b")
    events.clear()
    assert engine.step(on_outputs=on_outputs) == []  # what it read went out during the launch
    assert events == [("launch", 1 + len(second)), ("out", [("a", 2)])]
    stats = engine.last_step_stats  # the read's end, logged as read_ms, lies within the step
    assert 0 <= stats.wait_time <= stats.read_time <= stats.step_time
    final = {}
    while engine.has_unfinished():
        for out in engine.step(on_outputs=on_outputs):
            final[out.request_id] = out
    assert [final[r].outputs[0].token_ids for r in ("a", "b")] == [o.token_ids for o in plain]
    assert_clean(engine)


@pytest.mark.parametrize("scenario", range(4))
def test_random_traffic_overlapped_equals_plain(ckpt, scenario):
    """Random traffic on a pool small enough to preempt: arrivals between steps, aborts, stop tokens the
    greedy rows hit, seeded sampling, n > 1; overlapped, handing tokens out before a launch, and in small steps
    with lone ones. Every request not aborted ends with the plain schedule's tokens and finish reason; an aborted
    one with a prefix of them; the page accounting holds after every step."""
    rng = torch.Generator().manual_seed(100 + scenario)

    def draw(n):
        return int(torch.randint(0, n, (1,), generator=rng))

    prompts_ = [torch.randint(10, 500, (5 + draw(60),), generator=rng).tolist() for _ in range(12)]
    # stop tokens these prompts' outputs do emit (the tiny model's favourites), so that requests stop mid-run
    emitted = make(ckpt, False).generate(
        prompts_, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    )
    common = [t for t, _ in Counter(t for o in emitted for t in o.token_ids[2:]).most_common(6)]
    plan = []  # (arrival step, request id, prompt, params, abort step or None)
    for i, prompt in enumerate(prompts_):
        greedy = draw(2) == 0
        params = SamplingParams(
            max_new_tokens=1 + draw(24),
            temperature=0.0 if greedy else 0.9,
            seed=None if greedy else draw(1000),
            ignore_eos=True,
            stop_token_ids=[common[draw(len(common))] for _ in range(1 + draw(2))],
            n=1 if draw(4) else 2,
        )
        plan.append((draw(12), f"q{i}", prompt, params, 2 + draw(20) if draw(3) == 0 else None))
    # and one long prompt once the rest is over: alone, it takes lone steps where they are on
    late = torch.randint(10, 500, (90,), generator=rng).tolist()
    plan.append((80, "late", late, SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True), None))

    def run(overlap, hand_out_first=False, **kw):
        kw.setdefault("chunked_prefill_size", 48)
        m = make(ckpt, overlap, page_size=16, max_total_tokens=16 * 16, **kw)
        engine, final, step = m.engine, {}, 0
        schedule = engine.scheduler.schedule

        def recorded():  # the largest prompt chunk a step took
            out = schedule()
            chunks[kw.get("lone_prefill_chunk_size")] = max(
                [chunks[kw.get("lone_prefill_chunk_size")]] + [x.num_new_tokens for x in out.scheduled]
            )
            return out

        engine.scheduler.schedule = recorded
        early: list = []  # outputs handed out before a prefill step's launch (the server's on_outputs)
        step_kw = {"on_outputs": early.extend} if hand_out_first else {}
        while step < 400:
            for arrival, rid, prompt, params, _ in plan:
                if arrival == step:
                    engine.add_request(prompt, params, request_id=rid)
            for _, rid, _, _, abort_at in plan:
                if abort_at == step and rid in engine.groups:
                    final[rid] = ("aborted", engine.abort(rid))
            outs = engine.step(**step_kw)
            handed_out[hand_out_first] += len(early)
            for out in [*early, *outs]:
                if out.finished:
                    final[out.request_id] = ("done", out)
            early.clear()
            engine.check_integrity()
            step += 1
            if step > 80 and not engine.has_unfinished():
                break
        assert not engine.has_unfinished()
        stats.append((engine.scheduler.num_preemptions, sum(k == "aborted" for k, _ in final.values()),
                      sum(c.finish_reason == "stop" for k, o in final.values() if k == "done" for c in o.outputs)))  # fmt: skip
        assert_clean(engine)
        return {
            rid: (kind, [(c.token_ids, c.finish_reason) for c in out.outputs])
            for rid, (kind, out) in final.items()
        }

    stats, handed_out, chunks = [], Counter(), Counter()
    plain, overlapped, first = run(False), run(True), run(True, hand_out_first=True)
    # steps of 16 prompt tokens, but up to 96 while a prompt is alone (sched/chunk_size.py)
    lone = run(True, chunked_prefill_size=16, lone_prefill_chunk_size=96)
    # (preemptions, aborts, stops) of each run: the traffic reached the paths it is meant to
    assert all(sum(counts) >= 3 for counts in stats) and handed_out[True] > 0, (stats, handed_out)
    assert chunks[None] <= 48 and chunks[96] > 16, chunks
    assert set(plain) == set(overlapped) == set(first) == set(lone) == {rid for _, rid, _, _, _ in plan}
    for rid, (kind_p, outs_p) in plain.items():
        for kind_o, outs_o in (overlapped[rid], first[rid], lone[rid]):
            assert_same(rid, kind_p, outs_p, kind_o, outs_o)


def assert_same(rid, kind_p, outs_p, kind_o, outs_o):
    """A request's outputs in two runs: equal, or (aborted in one run, the overlapped one reads a step
    later; or in both) prefixes of each other."""
    if kind_p == kind_o == "done":
        assert outs_o == outs_p, rid
        return
    for (toks_p, _), (toks_o, _) in zip(outs_p, outs_o):
        short, long = sorted((toks_p, toks_o), key=len)
        assert long[: len(short)] == short, rid
