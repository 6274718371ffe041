"""Scheduler + KVCacheManager without tensors: exact chunks, order, page ids, preemption and release."""

from __future__ import annotations

import numpy as np

from longserve.cache.manager import KVCacheManager
from longserve.request import FinishReason, Request, RequestStatus
from longserve.sampling_params import SamplingParams
from longserve.sched.scheduler import Scheduler, SchedulerConfig


def make(budget=16, pages=32, page_size=4, max_running=8, chunk=None, caching=True):
    kv = KVCacheManager(pages, page_size, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(budget, max_running, chunk), kv)


def req(rid, n, start=0, max_new=4, group=None):
    return Request(rid, list(range(start, start + n)), SamplingParams(max_new_tokens=max_new), group_id=group)


def run_step(s, token=7):
    out = s.schedule()
    num_samples = sum(x.samples for x in out.scheduled)
    s.update(out, [token] * num_samples)
    return out


def plan(out):
    return [(x.request.request_id, x.num_new_tokens, x.samples) for x in out.scheduled]


def live(s):
    return list(s.running) + list(s.waiting)


def test_budget_splits_prompts_and_decodes_go_first():
    s = make(budget=16)
    for r in (req("a", 10), req("b", 20, 100), req("c", 5, 200)):
        s.add_request(r)
    assert plan(run_step(s)) == [("a", 10, True), ("b", 6, False)]
    # a decodes first (1 token, on top of the 16 prompt tokens), b continues, c gets what is left
    assert plan(run_step(s)) == [("a", 1, True), ("b", 14, True), ("c", 2, False)]
    assert plan(run_step(s)) == [("a", 1, True), ("b", 1, True), ("c", 3, True)]
    s.kv.check_integrity(live(s))


def test_pages_follow_tokens_exactly():
    s = make(budget=16, page_size=4)
    a = req("a", 10)
    s.add_request(a)
    run_step(s)  # 10 tokens -> 3 pages, lowest ids first
    assert a.page_ids == [1, 2, 3] and a.num_computed_tokens == 10 and a.output_token_ids == [7]
    run_step(s)  # token 11 fits in page 3
    assert a.page_ids == [1, 2, 3]
    run_step(s)
    run_step(s)  # 13th token needs page 4
    assert a.page_ids == [1, 2, 3, 4]
    s.kv.check_integrity(live(s))


def test_max_running_and_per_request_chunk_cap():
    s = make(budget=64, max_running=2, chunk=8)
    for r in (req("a", 20), req("b", 20, 100), req("c", 3, 200)):
        s.add_request(r)
    assert plan(run_step(s)) == [("a", 8, False), ("b", 8, False)]
    assert plan(run_step(s)) == [("a", 8, False), ("b", 8, False)]
    assert s.num_waiting == 1


def test_prefix_hit_is_page_aligned_and_leaves_one_token():
    s = make(budget=64, page_size=4)
    a = req("a", 14, max_new=1)  # 3 full pages + 2 tokens
    s.add_request(a)
    run_step(s)
    s.finish_request(a, FinishReason.LENGTH)
    b = Request("b", list(range(14)) + [99, 98], SamplingParams(max_new_tokens=1))
    s.add_request(b)
    out = s.schedule()
    assert b.num_cached_tokens == 12 and plan(out) == [("b", 4, True)]
    assert b.page_ids[:3] == [1, 2, 3]  # a's pages, served from the tree
    # an identical prompt still computes its last token
    s.update(out, [5])
    c = req("c", 12, max_new=1)
    s.add_request(c)
    assert plan(s.schedule()) == [("b", 1, True), ("c", 4, True)] and c.num_cached_tokens == 8
    s.kv.check_integrity(live(s))


def test_no_cache_when_disabled():
    s = make(caching=False)
    a = req("a", 12, max_new=1)
    s.add_request(a)
    run_step(s)
    s.finish_request(a, FinishReason.LENGTH)
    assert s.kv.num_free_pages == 32
    b = req("b", 12, max_new=1)
    s.add_request(b)
    assert plan(s.schedule()) == [("b", 12, True)] and b.num_cached_tokens == 0


def test_preemption_takes_the_latest_request_and_it_still_finishes():
    s = make(budget=64, pages=6, page_size=4, caching=False)
    a, b = req("a", 10, max_new=8), req("b", 10, 100, max_new=8)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # a: pages 1-3, b: pages 4-6 (pool full)
    assert a.page_ids == [1, 2, 3] and b.page_ids == [4, 5, 6]
    run_step(s)  # computes token 11 of each: still 3 pages
    run_step(s)  # token 12: still 3 pages
    out = run_step(s)  # a's token 13 needs a 4th page: b (admitted last) is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.page_ids == []
    assert a.page_ids == [1, 2, 3, 4] and s.num_preemptions == 1
    assert b.output_token_ids == [7, 7, 7]  # generated tokens are kept and recomputed
    s.kv.check_integrity(live(s))
    while s.has_unfinished():
        run_step(s)
        for r in list(s.running):
            if r.num_output_tokens >= 8:
                s.finish_request(r, FinishReason.LENGTH)
        s.kv.check_integrity(live(s))
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert s.kv.num_free_pages == 6


def test_preempted_request_reuses_its_cached_pages():
    s = make(budget=64, pages=6, page_size=4)
    a, b = req("a", 8, max_new=20), req("b", 8, 100, max_new=20)
    s.add_request(a)
    s.add_request(b)
    for _ in range(5):  # each computes 12 tokens on 3 pages: the pool is full
        run_step(s)
    out = run_step(s)  # a needs a 4th page: b is preempted, b's newest page is evicted for a
    assert [r.request_id for r in out.preempted] == ["b"]
    assert a.page_ids == [1, 2, 5, 6]  # b had pages [3, 4, 6]
    s.kv.check_integrity(live(s))
    s.finish_request(a, FinishReason.ABORT)
    out = s.schedule()  # b comes back: its first two pages are still cached
    assert plan(out) == [("b", b.num_tokens - 8, True)] and b.page_ids[:2] == [3, 4]
    s.kv.check_integrity(live(s))


def test_siblings_wait_for_the_leader_prompt_then_share_it():
    for caching in (True, False):
        s = make(budget=64, page_size=4, caching=caching)
        members = [req(f"g#{i}", 13, group="g") for i in range(3)]
        for m in members:
            s.add_request(m)
        assert plan(run_step(s)) == [("g#0", 13, True)]
        out = s.schedule()
        assert plan(out) == [("g#0", 1, True), ("g#1", 1, True), ("g#2", 1, True)]
        assert members[1].page_ids[:3] == members[0].page_ids[:3]
        s.update(out, [1, 2, 3])
        s.kv.check_integrity(live(s))


def test_finish_and_abort_release_every_page():
    s = make(budget=8, pages=16)
    rs = [req(str(i), 9, i * 50) for i in range(4)]
    for r in rs:
        s.add_request(r)
    run_step(s)
    run_step(s)
    for r in rs:
        s.finish_request(r, FinishReason.ABORT)
    s.kv.check_integrity([])
    s.kv.flush()
    assert s.kv.num_free_pages == 16 and not s.has_unfinished()


def test_generated_pages_enter_the_cache_when_the_request_ends():
    # prompt pages are shared as soon as computed; pages that decoding fills wait for the release (a
    # re-insert per filled page would walk the whole sequence), then a follow-up turn reuses them
    s = make(budget=64, pages=16, page_size=4)
    a = req("a", 8, max_new=9)
    s.add_request(a)
    run_step(s)  # the prompt: 2 full pages cached
    assert s.kv.prefix_cache.num_cached_pages == 2
    for _ in range(8):
        run_step(s)  # 8 decode steps fill pages 3 and 4
    assert a.num_computed_tokens == 16 and s.kv.prefix_cache.num_cached_pages == 2
    s.finish_request(a, FinishReason.LENGTH)  # released: its 16 computed tokens fill 4 pages
    assert s.kv.prefix_cache.num_cached_pages == 4
    follow = Request("b", a.all_token_ids() + [1, 2], SamplingParams(max_new_tokens=1))
    s.add_request(follow)
    assert plan(s.schedule()) == [("b", follow.num_tokens - 16, True)]
    s.kv.check_integrity(live(s))


def test_token_slice_equals_slicing_all_tokens():
    r = req("r", 7)
    r.output_token_ids.extend([100, 101, 102])
    for a in range(11):
        for b in range(a, 11):
            assert r.token_slice(a, b) == r.all_token_ids()[a:b], (a, b)
            assert r.token_array(a, b).tolist() == r.all_token_ids()[a:b], (a, b)
            assert r.token_array(a, b).dtype == np.int64
    assert r.token_array().tolist() == r.all_token_ids()
    assert np.shares_memory(r.token_array(2, 5), r.prompt_array)  # within the prompt: a view, no copy


def make_short_first(budget=16, pages=64, page_size=4, short=4, max_running=8):
    kv = KVCacheManager(pages, page_size, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(budget, max_running, None, short_prefill_tokens=short), kv)


def test_fcfs_makes_a_short_request_wait_for_the_whole_long_prefill():
    s = make(budget=16, pages=64)
    s.add_request(req("long", 60, 100))
    assert plan(run_step(s)) == [("long", 16, False)]
    s.add_request(req("short", 3))
    assert plan(run_step(s)) == [("long", 16, False)]
    assert plan(run_step(s)) == [("long", 16, False)]
    assert plan(run_step(s)) == [("long", 12, True), ("short", 3, True)]  # its first token: step 4


def test_short_first_serves_a_short_request_in_the_next_step():
    s = make_short_first(budget=16, short=4)
    s.add_request(req("long", 60, 100))
    assert plan(run_step(s)) == [("long", 16, False)]
    s.add_request(req("short", 3))
    assert plan(run_step(s)) == [("short", 3, True)]  # the long prefill waits one step
    assert s.num_deferred_prefill_steps == 1
    assert plan(run_step(s)) == [("short", 1, True), ("long", 16, False)]  # whole chunks beside the decode
    assert plan(run_step(s)) == [("short", 1, True), ("long", 16, False)]
    assert plan(run_step(s)) == [("short", 1, True), ("long", 12, True)]
    s.kv.check_integrity(live(s))


def test_short_first_counts_the_cached_prefix_and_never_defers_twice_in_a_row():
    s = make_short_first(budget=16, short=4, page_size=4)
    warm = req("warm", 16, 500, max_new=1)
    s.add_request(warm)
    run_step(s)
    s.finish_request(warm, FinishReason.LENGTH)  # its 4 pages stay cached
    s.add_request(req("long", 60, 100))
    assert plan(run_step(s)) == [("long", 16, False)]
    # 18 tokens, 16 of them cached: 2 to compute (a conversation's next turn) -> short
    s.add_request(Request("turn", list(range(500, 516)) + [1, 2], SamplingParams(max_new_tokens=2)))
    s.add_request(req("cold", 12, 300))  # 12 to compute: not short
    s.add_request(req("tiny", 2, 900))
    assert plan(run_step(s)) == [("turn", 2, True), ("tiny", 2, True)]
    assert s.requests["turn"].num_cached_tokens == 16
    s.add_request(req("tiny2", 2, 950))
    # the last step put "long" off: this one runs it even though tiny2 is short
    assert plan(run_step(s)) == [("turn", 1, True), ("tiny", 1, True), ("long", 16, False)]
    assert plan(run_step(s)) == [("turn", 1, True), ("tiny", 1, True), ("tiny2", 2, True)]  # off again, once
    s.kv.check_integrity(live(s))


def test_peek_matches_match_prefix_and_leaves_the_tree_as_it_was():
    s = make(budget=64, page_size=4)
    a = req("a", 30, max_new=1)
    s.add_request(a)
    run_step(s)
    s.finish_request(a, FinishReason.LENGTH)
    tree = s.kv.prefix_cache
    b = Request("b", list(range(22)) + [99] * 8, SamplingParams(max_new_tokens=1))  # diverges mid-node

    def state():
        return sorted((n.last_access, len(n.key), tuple(n.pages)) for n in tree._nodes())

    before = state()
    assert s.kv.peek_prefix_len(b) == 20
    assert state() == before  # no split, no LRU stamp
    s.add_request(b)
    run_step(s)
    assert b.num_cached_tokens == 20


def test_short_first_lets_a_short_request_pass_a_long_one_that_arrived_just_before():
    s = make_short_first(budget=16, short=4)
    s.add_request(req("long", 60, 100))
    s.add_request(req("short", 3))
    assert plan(run_step(s)) == [("short", 3, True)]  # not behind long's first 16-token chunk
    assert plan(run_step(s)) == [("short", 1, True), ("long", 16, False)]
    fcfs = make(budget=16, pages=64)
    fcfs.add_request(req("long", 60, 100))
    fcfs.add_request(req("short", 3))
    assert plan(run_step(fcfs)) == [("long", 16, False)]
    only_short = make_short_first(budget=16, short=4)  # nothing long to pass: plain FCFS admission
    only_short.add_request(req("a", 3))
    only_short.add_request(req("b", 2, 50))
    assert plan(run_step(only_short)) == [("a", 3, True), ("b", 2, True)]
    assert only_short.num_deferred_prefill_steps == 0


def test_scheduler_config_from_engine_config_sets_the_short_first_threshold():
    """The engine's settings become the scheduler's in one place: the step budget, the caps, and under
    short-first a threshold of 1/8 of the budget (a request with that many tokens to compute passes a long
    prefill; one more token and it waits); fcfs never lets one pass."""
    from longserve.config import EngineConfig

    def derived(**kw) -> SchedulerConfig:
        return SchedulerConfig.from_engine_config(EngineConfig(model="unused", load_format="dummy", **kw))

    caps = derived(chunked_prefill_size=48, max_running_requests=8, max_prefill_chunk=24)
    assert (caps.token_budget, caps.max_running_requests, caps.max_prefill_chunk) == (48, 8, 24)
    cfg = derived(chunked_prefill_size=32)
    assert cfg.short_prefill_tokens == 32 // 8
    for n, passes in ((cfg.short_prefill_tokens, True), (cfg.short_prefill_tokens + 1, False)):
        s = Scheduler(cfg, KVCacheManager(64, 4, enable_prefix_caching=True))
        s.add_request(req("long", 100, 100))
        s.add_request(req("next", n))
        first = [x.request.request_id for x in s.schedule().scheduled]
        assert first == (["next"] if passes else ["long"]), (n, first)
    assert derived(schedule_policy="fcfs").short_prefill_tokens == 0
    assert derived(chunked_prefill_size=4).short_prefill_tokens == 1  # never 0 under short-first
    # the share that arrivals beside decodes are admitted by: the same 1/8 under short-first, none under fcfs
    assert cfg.admit_tokens_beside_decodes == 32 // 8
    assert derived(schedule_policy="fcfs").admit_tokens_beside_decodes == 0


def make_shares(budget=32, share=4, pages=128, page_size=4):
    kv = KVCacheManager(pages, page_size, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(budget, 8, None, admit_tokens_beside_decodes=share), kv)


def test_beside_decodes_prompts_that_arrive_together_are_admitted_a_share_at_a_time():
    s = make_shares(budget=32, share=4)
    s.add_request(req("d", 3, 900, max_new=20))
    assert plan(run_step(s)) == [("d", 3, True)]
    for r in (req("a", 6, 100), req("b", 5, 200), req("c", 2, 300), req("e", 2, 400)):
        s.add_request(r)
    # d decodes: the step takes a (6 tokens, past the share of 4) and no more, with 26 of 32 budget tokens left
    assert plan(run_step(s)) == [("d", 1, True), ("a", 6, True)]
    assert plan(run_step(s)) == [("d", 1, True), ("a", 1, True), ("b", 5, True)]
    # c's 2 tokens leave the step under the share: e joins it
    assert plan(run_step(s)) == [
        ("d", 1, True),
        ("a", 1, True),
        ("b", 1, True),
        ("c", 2, True),
        ("e", 2, True),
    ]
    s.kv.check_integrity(live(s))


def test_without_decodes_or_under_fcfs_the_arrivals_share_one_step():
    idle = make_shares(budget=32, share=4)
    for r in (req("a", 6, 100), req("b", 5, 200), req("c", 2, 300)):
        idle.add_request(r)
    assert plan(run_step(idle)) == [("a", 6, True), ("b", 5, True), ("c", 2, True)]  # nothing decodes yet
    fcfs = make(budget=32, pages=128)
    fcfs.add_request(req("d", 3, 900, max_new=20))
    run_step(fcfs)
    for r in (req("a", 6, 100), req("b", 5, 200), req("c", 2, 300)):
        fcfs.add_request(r)
    assert plan(run_step(fcfs)) == [("d", 1, True), ("a", 6, True), ("b", 5, True), ("c", 2, True)]


def test_a_long_queue_fills_the_steps_beside_decodes():
    """More than LIGHT_QUEUE_BUDGETS budgets of prompt tokens waiting: full steps (throughput), as fcfs; once the
    queue is short again, one share a step."""
    from longserve.sched.scheduler import LIGHT_QUEUE_BUDGETS

    s = make_shares(budget=32, share=2)
    s.add_request(req("d", 3, 900, max_new=20))
    run_step(s)
    for i, (rid, n) in enumerate((("a", 20), ("b", 20), ("c", 20), ("e", 5))):
        s.add_request(req(rid, n, 100 * (i + 1)))
    assert LIGHT_QUEUE_BUDGETS * 32 < 20 + 20 + 20 + 5
    assert plan(run_step(s)) == [("d", 1, True), ("a", 20, True), ("b", 12, False)]
    # 25 tokens wait now, within two budgets: after b's running chunk only c, the first, is admitted (fcfs
    # would give e the budget's last 4 tokens too)
    assert plan(run_step(s)) == [("d", 1, True), ("a", 1, True), ("b", 8, True), ("c", 20, True)]
    s.kv.check_integrity(live(s))


def test_many_decodes_fill_the_steps(monkeypatch):
    """More than LIGHT_QUEUE_MAX_DECODES requests decoding: prompts that wait together share one step (as fcfs),
    where with fewer decoding they are admitted a share a step."""
    from longserve.sched import scheduler

    monkeypatch.setattr(scheduler, "LIGHT_QUEUE_MAX_DECODES", 2)
    plans = []
    for decoding in (2, 3):
        s = make_shares(budget=32, share=2)
        for i in range(decoding):
            s.add_request(req(f"d{i}", 3, 900 + 10 * i, max_new=20))
        run_step(s)
        for i, rid in enumerate(("a", "b")):
            s.add_request(req(rid, 5, 100 * (i + 1)))
        plans.append([x for x in plan(run_step(s)) if x[0] in ("a", "b")])
        s.kv.check_integrity(live(s))
    assert plans == [[("a", 5, True)], [("a", 5, True), ("b", 5, True)]]


def test_short_requests_put_before_a_long_prefill_all_go_in_their_step():
    """The share a step beside decodes does not apply to short-first's own step: every short one of the
    lookahead goes there, not one of them left for after the long prefill's next chunk."""
    kv = KVCacheManager(128, 4, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(32, 8, None, short_prefill_tokens=4, admit_tokens_beside_decodes=4), kv)
    s.add_request(req("d", 3, 900, max_new=20))
    run_step(s)
    s.add_request(req("long", 100, 100))
    assert plan(run_step(s)) == [("d", 1, True), ("long", 32, False)]
    for i, rid in enumerate(("s1", "s2", "s3")):
        s.add_request(req(rid, 4, 200 + 10 * i))
    assert plan(run_step(s)) == [("d", 1, True), ("s1", 4, True), ("s2", 4, True), ("s3", 4, True)]
    s.kv.check_integrity(live(s))


def test_a_prompts_chunks_are_not_cut_by_the_decodes_beside_it():
    """The budget counts prompt tokens; decodes ride on top (SGLang's mixed chunks): a prompt beside decodes
    takes whole chunks and finishes in as many steps as alone (cut by the decodes, a 64-token prompt beside
    three took a fifth step for its last 12 tokens, and its later chunks' prefixes were not multiples of the
    chunk). A step takes at most as many decodes as the budget; the rest decode in the next."""
    s = make(budget=16, pages=64)
    for i in range(3):
        s.add_request(req(f"d{i}", 2, 900 + 10 * i, max_new=20))
    run_step(s)
    s.add_request(req("p", 64, 100))
    plans = [plan(run_step(s)) for _ in range(4)]
    decodes = [("d0", 1, True), ("d1", 1, True), ("d2", 1, True)]
    assert plans == [decodes + [("p", 16, i == 3)] for i in range(4)]
    s.kv.check_integrity(live(s))
    busy = make(budget=4, pages=64)
    for i in range(6):
        busy.add_request(req(f"r{i}", 1, 10 * i, max_new=8))
    assert plan(run_step(busy)) == [(f"r{i}", 1, True) for i in range(4)]  # 4 prompt tokens
    # r0..r3 decode (4, the most a step takes), r4 and r5 are admitted with the budget's prompt tokens
    assert plan(run_step(busy)) == [(f"r{i}", 1, True) for i in range(6)]
    assert len(plan(run_step(busy))) == 4  # six decoding: four this step
    busy.kv.check_integrity(live(busy))
