"""A prompt's chunk sizes (sched/chunk_size.py). A lone prompt's (SchedulerConfig.lone_prefill_chunk_size): exact
chunks and page ids within their bound, back to the usual budget as soon as anything else is there, and a usual chunk
when the pool has no room for a lone one. Every long chunk ending on the chunk granule where it costs no step."""

from __future__ import annotations

import pytest

from longserve.cache.manager import KVCacheManager
from longserve.config import ConfigError, EngineConfig
from longserve.request import FinishReason, Request
from longserve.runner.step_tokens import max_step_prompt_tokens
from longserve.sampling_params import SamplingParams
from longserve.sched.chunk_size import aligned_chunk, bounded_lone_chunk, lone_chunk_bound
from longserve.sched.scheduler import Scheduler, SchedulerConfig


def make(budget=16, lone=40, pages=64, page_size=4):
    kv = KVCacheManager(pages, page_size, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(budget, 8, lone_prefill_chunk_size=lone), kv)


def req(rid, n, start=0, max_new=4):
    return Request(rid, list(range(start, start + n)), SamplingParams(max_new_tokens=max_new))


def run_step(s, token=7):
    out = s.schedule()
    s.update(out, [token] * sum(x.samples for x in out.scheduled))
    return [(x.request.request_id, x.num_new_tokens, x.samples) for x in out.scheduled]


def test_a_lone_prompt_takes_lone_chunks_and_exact_pages():
    """The first chunk takes lone tokens; each after it at most as much attention work (n * (n + 2 * done) <=
    lone^2), never less than the usual budget."""
    s = make(budget=8, lone=40, page_size=4)
    a = req("a", 100)
    s.add_request(a)
    assert run_step(s) == [("a", 40, False)]
    assert a.page_ids == list(range(1, 11))
    assert [run_step(s) for _ in range(5)] == [[("a", n, False)] for n in (16, 12, 10, 9, 8)]
    assert run_step(s) == [("a", 5, True)]
    assert a.page_ids == list(range(1, 26)) and a.num_computed_tokens == 100
    s.kv.check_integrity(list(s.running))


def test_the_bound_keeps_a_lone_chunks_attention_work():
    """lone 32K: 13,572 tokens after 32K, 10,415 after those, under the usual 8K from 64K on; the work of each
    (n * done + n^2 / 2) within the first chunk's, and one token more past it."""
    lone = 32768
    assert lone_chunk_bound(0, lone) == lone
    assert lone_chunk_bound(lone, lone) == 13572
    assert lone_chunk_bound(lone + 13572, lone) == 10415
    assert lone_chunk_bound(2 * lone, lone) == 7735
    for done in (1, 1000, lone, 3 * lone, 10**6):
        n = lone_chunk_bound(done, lone)
        assert n * (n + 2 * done) <= lone * lone < (n + 1) * (n + 1 + 2 * done)
    assert bounded_lone_chunk(50000, 2 * lone, lone, 8192) == 8192  # never below the usual budget
    assert bounded_lone_chunk(9000, lone, lone, 8192) == 9000  # what is left, when less


def test_lone_chunks_end_on_the_granule():
    """With chunk_granule (the attention backend's), each bounded chunk ends on a multiple of it, the
    prompt's last excepted; pages follow exactly. At the 8B's sizes: 12,288 after 32K (not 13,572), then 8K. A bound
    under two granules is kept as it is (a lone size below the granule: each lone chunk would round to nothing)."""
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(8, 8, lone_prefill_chunk_size=40, chunk_granule=4), kv)
    a = req("a", 100)
    s.add_request(a)
    steps = [run_step(s) for _ in range(7)]
    # bounds 16, 12, 10, 9, 9 end on 56, 68, 76, 84, 92; then the prompt's last 8
    sizes = (40, 16, 12, 8, 8, 8, 8)
    assert steps == [[("a", n, i == len(sizes) - 1)] for i, n in enumerate(sizes)]
    assert a.page_ids == list(range(1, 26)) and a.num_computed_tokens == 100
    s.kv.check_integrity(list(s.running))
    assert bounded_lone_chunk(50000, 32768, 32768, 8192, 2048) == 12288
    assert bounded_lone_chunk(50000, 32768 + 12288, 32768, 8192, 2048) == 10240
    assert bounded_lone_chunk(11000, 32768, 32768, 8192, 2048) == 11000  # the prompt's end: on no granule
    # after a cached 1,000: realigned
    assert bounded_lone_chunk(50000, 1000, 32768, 8192, 2048) == 32768 - 1000
    # a bound under two granules (a GPU's 2,048 with a test's lone 32): kept, not rounded down to the budget
    assert bounded_lone_chunk(100, 0, 32, 7, 2048) == 32 and bounded_lone_chunk(100, 32, 32, 7, 2048) == 13
    assert bounded_lone_chunk(100, 0, 32, 7, 16) == 32 and bounded_lone_chunk(100, 32, 32, 7, 4) == 12
    cfg = EngineConfig(model="unused", load_format="dummy")
    assert SchedulerConfig.from_engine_config(cfg, None, 96, 2048).chunk_granule == 2048


def test_usual_chunks_end_on_the_granule_where_it_costs_no_step():
    """A long usual chunk that more of its prompt follows ends on the granule when it keeps half its tokens and the
    prompt takes no more steps; short ones (a budget share), last ones and granule 1 are left alone."""
    assert aligned_chunk(8192, 16400, 40000, 8192, 2048) == 8176  # behind a cached 16,400: ends at 24,576
    assert aligned_chunk(8192, 24576, 31824, 8192, 2048) == 8192  # on the granule already
    assert aligned_chunk(8192, 100, 16300, 8192, 2048) == 8192  # 8,092 would leave 8,208: a third step
    # the prompt's last (n >= what is left: as given)
    assert aligned_chunk(8192, 100, 8000, 8192, 2048) == 8192
    assert aligned_chunk(1024, 1500, 50000, 8192, 2048) == 1024  # a share beside decodes: too short to bother
    assert aligned_chunk(5000, 1500, 50000, 8192, 2048) == 4644  # to 6,144
    assert aligned_chunk(5000, 3000, 50000, 8192, 2048) == 3144  # to 6,144 (two granules or more keep half)
    assert aligned_chunk(8192, 16400, 40000, 8192, 1) == 8192  # a backend without a granule (the CPU's)


def test_a_prompt_behind_a_cached_prefix_takes_chunks_on_the_granule():
    """Scheduler: the second request shares 20 cached tokens with the first; its chunks end on multiples of 8 (its
    first 28 tokens, to 48), and it still takes three steps; pages exact."""
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(32, 8, chunk_granule=8), kv)
    a = req("a", 20, max_new=1)
    s.add_request(a)
    assert run_step(s) == [("a", 20, True)]
    s.finish_request(a, FinishReason.LENGTH)  # its 20 tokens' pages stay in the prefix cache
    b = Request("b", list(range(20)) + list(range(500, 580)), SamplingParams(max_new_tokens=4))
    s.add_request(b)
    assert [run_step(s) for _ in range(3)] == [[("b", 28, False)], [("b", 32, False)], [("b", 20, True)]]
    assert b.num_cached_tokens == 20 and b.num_computed_tokens == 100
    s.kv.check_integrity(list(s.running))


def test_without_the_setting_the_budget_is_the_usual_one():
    s = make(budget=16, lone=None)
    s.add_request(req("a", 40))
    assert [run_step(s) for _ in range(3)] == [[("a", 16, False)], [("a", 16, False)], [("a", 8, True)]]


def test_an_arrival_puts_the_steps_back_to_the_usual_budget():
    s = make(budget=16, lone=40)
    s.add_request(req("a", 100))
    assert run_step(s) == [("a", 40, False)]
    s.add_request(req("b", 30, 1000))  # waiting beside a's prefill: not lone any more
    assert run_step(s) == [("a", 16, False)]
    assert run_step(s) == [("a", 16, False)]
    assert run_step(s) == [("a", 16, False)]
    # a's last 12 tokens, then b in what is left of the step
    assert run_step(s) == [("a", 12, True), ("b", 4, False)]


def test_decodes_beside_a_prompt_keep_the_usual_budget_until_they_end():
    s = make(budget=16, lone=40)
    a = req("a", 8, max_new=2)
    s.add_request(a)
    assert run_step(s) == [("a", 8, True)]  # alone: its whole prompt (under both budgets)
    s.add_request(req("b", 100, 1000))
    assert run_step(s) == [("a", 1, True), ("b", 16, False)]  # a decodes: b gets a usual chunk
    s.finish_request(a, FinishReason.LENGTH)  # its 2 tokens (the engine's stop check)
    # b alone now, 16 of its tokens computed: 27 more (27 * (27 + 32) <= 40^2), then the usual 16
    assert [run_step(s) for _ in range(4)] == [[("b", n, False)] for n in (27, 16, 16, 16)]
    assert run_step(s) == [("b", 9, True)]


def test_a_pool_with_no_room_for_a_lone_chunk_gives_a_usual_one():
    s = make(budget=16, lone=40, pages=15, page_size=4)
    held = req("held", 40, 5000)
    assert s.kv.allocate(held, 40)  # 10 of 15 pages held outside the scheduler: 5 pages (20 tokens) free
    a = req("a", 40)
    s.add_request(a)
    assert run_step(s) == [("a", 16, False)]  # 40 tokens need 10 pages; 16 need 4
    assert a.page_ids == [11, 12, 13, 14]
    s.kv.release(held, cache=False)
    assert run_step(s) == [("a", 24, True)]  # room again: the rest in one lone chunk
    s.kv.check_integrity(list(s.running))


def test_the_engine_setting_reaches_the_scheduler_and_is_checked():
    cfg = EngineConfig(
        model="unused", load_format="dummy", chunked_prefill_size=32, lone_prefill_chunk_size=96
    )
    assert SchedulerConfig.from_engine_config(cfg, None, 96).lone_prefill_chunk_size == 96
    assert max_step_prompt_tokens(cfg, 96) == 96
    assert max_step_prompt_tokens(EngineConfig(model="unused", load_format="dummy"), None) == 8192
    with pytest.raises(ConfigError, match="lone_prefill_chunk_size must be at least chunked_prefill_size"):
        EngineConfig(model="unused", load_format="dummy", chunked_prefill_size=32, lone_prefill_chunk_size=16)
