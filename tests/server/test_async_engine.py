"""The AsyncEngine bridge in-process: a failing step fails its requests and the loop keeps serving, a full
queue answers 503, a deadline aborts with 504, and every page comes back."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from longserve.config import EngineConfig
from longserve.engine import Engine
from longserve.sampling_params import SamplingParams

pytest.importorskip("fastapi")
from longserve.server.async_engine import AsyncEngine  # noqa: E402 - needs the server extra
from longserve.server.errors import APIError  # noqa: E402

LONG = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(EngineConfig(tiny_model, device="cpu", dtype="float32", max_total_tokens=2048))


def assert_clean(engine: Engine) -> None:
    assert not engine.has_unfinished()
    engine.check_integrity()
    engine.flush_cache()
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


async def run(ae: AsyncEngine, ids, params, deadline=None):
    rid = await ae.add(ids, params)
    outs = [out async for out in ae.stream(rid, deadline)]
    return outs[-1]


def with_engine(engine: Engine, body, **kw) -> None:
    async def main():
        ae = AsyncEngine(engine, **kw)
        ae.start(asyncio.get_running_loop())
        try:
            await body(ae)
        finally:
            ae.stop()

    asyncio.run(main())
    assert_clean(engine)


def test_step_failure_fails_requests_and_keeps_serving(engine, monkeypatch, caplog):
    real = engine.runner.launch
    calls = {"n": 0}

    def flaky(step, *args, **kwargs):
        # the first step holding both requests (by launch count, a busy machine's event loop could add the
        # second request after the failing step, and that one would finish)
        if len(step.query_lens) == 2 and not calls["n"]:
            calls["n"] += 1
            raise RuntimeError("injected fault")
        return real(step, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "launch", flaky)

    async def body(ae: AsyncEngine):
        results = await asyncio.gather(
            run(ae, [5, 6, 7, 8], LONG), run(ae, [9, 10, 11], LONG), return_exceptions=True
        )
        assert all(isinstance(r, APIError) and r.status == 500 for r in results), results
        assert ae.num_step_errors == 1 and ae.is_alive
        # the body names an error id; the exception's text goes only to the log, under that id
        error_id = results[0].message.split("[")[1].split("]")[0]
        assert "injected fault" not in results[0].message and "server log" in results[0].message
        assert any(error_id in r.getMessage() and "injected fault" in r.exc_text for r in caplog.records)
        out = await run(ae, [5, 6, 7, 8], SamplingParams(max_new_tokens=5, temperature=0))
        assert out.finished and len(out.token_ids) == 5

    with_engine(engine, body)


def test_queue_limit_counts_requests_waiting_for_a_running_slot(tiny_model):
    """--max-queued-requests bounds the requests beyond the running slots: with 2 slots and a limit of 1,
    the engine takes 3 (two run, one waits) while its thread is busy, and the 4th gets a 503."""
    small = Engine(
        EngineConfig(tiny_model, device="cpu", dtype="float32", max_total_tokens=2048, max_running_requests=2)
    )

    async def body(ae: AsyncEngine):
        gate = threading.Event()
        blocked = asyncio.ensure_future(ae.call(lambda _: gate.wait(10)))  # the engine thread waits
        await asyncio.sleep(0.05)
        params = SamplingParams(max_new_tokens=3)
        accepted = [asyncio.ensure_future(run(ae, [5, 6, 7], params)) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert ae.num_queued == 1
        with pytest.raises(APIError) as err:
            await run(ae, [5, 6, 7], params)
        assert err.value.status == 503 and "max-queued-requests" in err.value.message
        gate.set()
        await blocked
        assert all(out.finished for out in await asyncio.gather(*accepted))
        assert ae.num_queued == 0 and ae.num_inflight == 0

    with_engine(small, body, max_queued_requests=1)


def test_a_burst_within_the_running_slots_is_all_admitted(engine):
    """200 requests at once with a queue limit of 64 and 256 running slots: none is refused."""

    async def body(ae: AsyncEngine):
        gate = threading.Event()
        blocked = asyncio.ensure_future(ae.call(lambda _: gate.wait(10)))
        await asyncio.sleep(0.05)
        params = SamplingParams(max_new_tokens=2, temperature=0)
        burst = [asyncio.ensure_future(run(ae, [5 + i % 50, 6, 7], params)) for i in range(200)]
        await asyncio.sleep(0.1)
        gate.set()
        await blocked
        outs = await asyncio.gather(*burst, return_exceptions=True)
        assert all(not isinstance(o, BaseException) and o.finished for o in outs), outs[:3]

    with_engine(engine, body, max_queued_requests=64)


def test_drain_lets_requests_finish_then_ends_the_rest(engine, monkeypatch):
    """drain(): new requests get 503 at once; a short request in flight finishes; a long one is ended
    with a 503 after the timeout; every page comes back."""
    real_step = engine.step

    def slow_step(**kw):  # >= 20 ms a step: the long request needs >= 10 s, the short one >= 0.16 s
        time.sleep(0.02)
        return real_step(**kw)

    monkeypatch.setattr(engine, "step", slow_step)

    async def body(ae: AsyncEngine):
        short = asyncio.ensure_future(run(ae, [5, 6, 7], SamplingParams(max_new_tokens=8, temperature=0)))
        long = asyncio.ensure_future(run(ae, [9, 10, 11], LONG.clone(max_new_tokens=500)))
        await asyncio.sleep(0.05)
        drained = asyncio.ensure_future(ae.drain(timeout=3.0))
        await asyncio.sleep(0.01)
        with pytest.raises(APIError) as err:
            await run(ae, [5, 6, 7], SamplingParams(max_new_tokens=2))
        assert err.value.status == 503 and "shutting down" in err.value.message
        assert len((await short).token_ids) == 8
        assert await drained == 1
        with pytest.raises(APIError) as err:
            await long
        assert err.value.status == 503 and "--shutdown-timeout" in err.value.message
        assert ae.num_inflight == 0

    with_engine(engine, body)


def test_deadline_aborts_with_504(engine):
    async def body(ae: AsyncEngine):
        loop = asyncio.get_running_loop()
        with pytest.raises(APIError) as err:
            await run(ae, [5, 6, 7], LONG, deadline=time.monotonic() + 0.05)
        assert err.value.status == 504 and "timed out" in err.value.message
        for _ in range(100):  # the abort reaches the engine thread
            if await ae.call(lambda e: not e.has_unfinished()):
                break
            await asyncio.sleep(0.01)
        assert ae.num_aborted == 1 and loop.is_running()

    with_engine(engine, body)


def test_refused_input_is_400_and_leaves_nothing(engine):
    async def body(ae: AsyncEngine):
        for ids, words in (([5] * 600, "context length"), ([99999], "token ids")):
            with pytest.raises(APIError) as err:
                await run(ae, ids, SamplingParams(max_new_tokens=2))
            assert err.value.status == 400 and words in err.value.message

    with_engine(engine, body)


def test_timings_count_from_the_http_arrival(engine, tiny_model):
    """meta_info's ttft and queue_time (and so the metrics) start when the server got the request, not when
    the engine thread did: a tokenizer that takes 0.3 s shows in both, as it does in the client's TTFT."""
    import httpx

    from longserve.server.app import create_app
    from longserve.server.config import ServerConfig
    from longserve.server.state import ServerState
    from longserve.tokenization.pool import TokenizerPool

    async def main():
        pool = TokenizerPool(tiny_model, 1)
        slow_encode = pool.encode

        async def encode(*a, **kw):
            await asyncio.sleep(0.3)
            return await slow_encode(*a, **kw)

        pool.encode = encode
        state = ServerState(engine.config, ServerConfig(), AsyncEngine(engine), pool)
        state.engine.start(asyncio.get_running_loop())
        transport = httpx.ASGITransport(app=create_app(state))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
                t0 = time.perf_counter()
                r = await client.post(
                    "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}}
                )
                wall = time.perf_counter() - t0
                meta = r.json()["meta_info"]
                assert 0.3 <= meta["queue_time"] <= meta["ttft"] <= meta["e2e_latency"] <= wall
                r = await client.post(
                    "/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
                )
                assert r.json()["meta_info"]["ttft"] < 0.3  # ids need no tokenizing
        finally:
            state.engine.stop()
            state.tokenizers.shutdown()

    asyncio.run(main())
    assert_clean(engine)


def test_request_timeout_over_http(engine, tiny_model):
    """--request-timeout through the app: a 504 error object, or an error event in a stream."""
    import httpx

    from longserve.server.app import create_app
    from longserve.server.config import ServerConfig
    from longserve.server.state import ServerState
    from longserve.tokenization.pool import TokenizerPool

    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
    }

    async def main():
        state = ServerState(
            engine.config,
            ServerConfig(request_timeout=0.05),
            AsyncEngine(engine),
            TokenizerPool(tiny_model, 1),
        )
        state.engine.start(asyncio.get_running_loop())
        transport = httpx.ASGITransport(app=create_app(state))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                r = await client.post("/generate", json=body)
                assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
                r = await client.post("/generate", json={**body, "stream": True})
                assert r.status_code == 200 and "timed out" in r.text and r.text.endswith("data: [DONE]\n\n")
                for _ in range(100):
                    if await state.engine.call(lambda e: not e.has_unfinished()):
                        break
                    await asyncio.sleep(0.01)
        finally:
            state.engine.stop()
            state.tokenizers.shutdown()

    asyncio.run(main())
    assert_clean(engine)


def test_text_is_assembled_off_the_step_loop(tiny_model):
    """With detokenize=False the engine thread only handles token ids; the bridge builds the text on the
    event loop, ends a request at a stop string, and matches the offline engine exactly."""
    offline = Engine(EngineConfig(tiny_model, device="cpu", dtype="float32", max_total_tokens=2048))
    served = Engine(
        EngineConfig(tiny_model, device="cpu", dtype="float32", max_total_tokens=2048), detokenize=False
    )
    ids = offline.encode("Once upon a time")
    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    full = _run_offline(offline, ids, greedy)
    stop = full.text[5:9]
    stopped = _run_offline(offline, ids, greedy.clone(stop=[stop]))
    assert stopped.finish_reason == "stop" and stopped.text == full.text[: full.text.index(stop)]

    steps = []
    real_step = served.step

    def step(**kw):
        outs = real_step(**kw)
        steps.extend(c.text for out in outs for c in out.outputs)  # what the engine thread produced
        return outs

    served.step = step

    async def body(ae: AsyncEngine):
        out = await run(ae, ids, greedy)
        assert out.text == full.text and out.token_ids == full.token_ids
        rid = await ae.add(ids, greedy.clone(stop=[stop]))
        outs = [o async for o in ae.stream(rid)]
        final = outs[-1].outputs[0]
        assert final.finish_reason == "stop" and final.stop_reason == stop
        assert final.text == stopped.text and final.token_ids == stopped.token_ids
        assert "".join(o.outputs[0].new_text for o in outs) == stopped.text  # streamed deltas add up
        assert all(stop not in o.outputs[0].new_text for o in outs)

    with_engine(served, body)
    assert steps and all(t == "" for t in steps)  # no decoding on the engine thread


def _run_offline(engine: Engine, ids, params):
    rid = engine.add_request(ids, params)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def test_request_timeout_covers_tokenizing(engine, tiny_model):
    """--request-timeout counts from the HTTP arrival: a prompt whose tokenizing outlasts it is a 504."""
    import httpx

    from longserve.server.app import create_app
    from longserve.server.config import ServerConfig
    from longserve.server.state import ServerState
    from longserve.tokenization.pool import TokenizerPool

    async def main():
        pool = TokenizerPool(tiny_model, 1)
        real_encode = pool.prompts.encode

        def slow_encode(*a, **kw):  # in the tokenizer thread
            time.sleep(2.0)
            return real_encode(*a, **kw)

        pool.prompts.encode = slow_encode
        state = ServerState(engine.config, ServerConfig(request_timeout=0.2), AsyncEngine(engine), pool)
        state.engine.start(asyncio.get_running_loop())
        transport = httpx.ASGITransport(app=create_app(state))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
                t0 = time.perf_counter()
                r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
                assert r.status_code == 504 and "tokenized" in r.json()["error"]["message"]
                assert time.perf_counter() - t0 < 1.5  # answered at the deadline, not after the tokenizer
        finally:
            state.engine.stop()
            state.tokenizers.shutdown()

    asyncio.run(main())
    assert_clean(engine)


def test_the_warm_up_runs_on_the_stepping_thread_before_the_first_step(engine, monkeypatch, caplog):
    """cuDNN keeps its plans per thread: the server's warm-up must run on the engine thread, which runs the
    steps, and before the first of them; a warm-up that fails is logged and the engine serves anyway."""
    seen: list[tuple[str, str]] = []
    real_step = engine.step
    monkeypatch.setattr(engine, "warm_up", lambda: seen.append(("warm_up", threading.current_thread().name)))
    monkeypatch.setattr(
        engine, "step", lambda **kw: seen.append(("step", threading.current_thread().name)) or real_step(**kw)
    )

    async def body(ae: AsyncEngine):
        out = await run(ae, [5, 6, 7], SamplingParams(max_new_tokens=3, temperature=0))
        assert out.finished and len(out.token_ids) == 3

    with_engine(engine, body)
    assert seen[0] == ("warm_up", "longserve-engine") and ("step", "longserve-engine") in seen[1:]
    assert [kind for kind, _ in seen].count("warm_up") == 1

    def failing() -> None:
        raise RuntimeError("no plans today")

    monkeypatch.setattr(engine, "warm_up", failing)
    with_engine(engine, body)
    assert any("warm-up failed" in r.getMessage() and r.exc_text for r in caplog.records)


def test_overlapped_engine_hands_tokens_out_before_a_prefill(tiny_model):
    """The server's loop over an overlapped engine: requests arriving while others decode stream the plain
    engine's tokens, the tokens in flight went out before a prefill step's launch (on_outputs), and every
    page comes back."""
    params = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13], list(range(20, 60))]
    results = {}
    for overlap in (False, True):
        engine = Engine(EngineConfig(tiny_model, device="cpu", dtype="float32", max_total_tokens=2048,
                                     overlap_schedule=overlap))  # fmt: skip
        handed_out = []
        real_step = engine.step

        def step(on_outputs=None, real_step=real_step, handed_out=handed_out):
            def counted(outs):
                handed_out.extend(outs)
                on_outputs(outs)

            return real_step(on_outputs=counted if on_outputs is not None else None)

        engine.step = step

        async def body(ae: AsyncEngine):
            tasks = []
            for ids in prompts:  # each arrives while the ones before it decode
                tasks.append(asyncio.ensure_future(run(ae, ids, params)))
                await asyncio.sleep(0.01)
            return [out.token_ids for out in await asyncio.gather(*tasks)]

        async def main(engine=engine, overlap=overlap):
            ae = AsyncEngine(engine)
            ae.start(asyncio.get_running_loop())
            try:
                results[overlap] = await body(ae)
            finally:
                ae.stop()

        asyncio.run(main())
        assert_clean(engine)
        assert bool(handed_out) == overlap, len(handed_out)
    assert results[True] == results[False] and all(len(t) == 64 for t in results[True])


def test_step_log_accounts_for_every_step_and_token(engine, tmp_path):
    """--step-log (server/step_log.py): one line per loop iteration; the steps' prompt and generated tokens
    add up to what the requests computed, and the time waiting for the device, and when the read ended, are
    within each step's."""
    import json

    path = tmp_path / "steps.jsonl"
    engine.flush_cache()
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((300, 41, 7))]
    params = SamplingParams(max_new_tokens=9, temperature=0, ignore_eos=True)

    async def main():
        ae = AsyncEngine(engine)
        ae.configure_stats(None, 0.0, str(path))
        ae.start(asyncio.get_running_loop())
        try:
            outs = await asyncio.gather(*(run(ae, p, params) for p in prompts))
        finally:
            ae.stop()
        return ae, outs

    ae, outs = asyncio.run(main())
    assert_clean(engine)
    assert all(len(o.token_ids) == 9 for o in outs)
    head, *lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert abs(head["opened_unix"] - time.time()) < 600
    steps = [line for line in lines if "step_ms" in line]
    assert len(steps) == ae.num_steps > 0
    assert sum(s["prefill"] for s in steps) == sum(map(len, prompts))
    assert sum(s["decode"] for s in steps) == len(prompts) * (9 - 1)  # each first token comes with its prompt
    assert all(0 <= s["wait_ms"] <= s["step_ms"] for s in steps)
    # the plain schedule (CPU) reads each step's own tokens within it: when, into the step, is logged
    assert not engine.overlap and all(0 <= s["wait_ms"] <= s["read_ms"] <= s["step_ms"] for s in steps)
    assert sum(line["commands"] for line in lines) == len(prompts)  # the three adds
    assert sum(line["outputs"] + line["early"] for line in lines) >= len(prompts) * 9
    times = [line["t"] for line in lines]
    assert times == sorted(times)
