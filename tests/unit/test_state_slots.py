"""A hybrid model's recurrent-state slots on the cache side (cache/state_slots.py) and through the KV manager: one
slot a running request, the lowest free first, taken with the first pages and given back with them; no pages
taken when no slot is free; no prompt sharing (prefix cache, forked siblings) for these models; the integrity
check catches a slot held twice or lost."""

from __future__ import annotations

import pytest

from longserve.cache.manager import KVCacheManager
from longserve.cache.prefix_cache import NoPrefixCache
from longserve.cache.radix_tree import RadixTree
from longserve.cache.state_slots import NoStateSlots, StateSlots
from longserve.request import Request
from longserve.sampling_params import SamplingParams


def req(rid: str, n: int = 10) -> Request:
    return Request(
        request_id=rid, prompt_token_ids=list(range(100, 100 + n)), sampling_params=SamplingParams()
    )


def test_slots_lowest_first_and_back():
    slots = StateSlots(3)
    a, b, c, d = req("a"), req("b"), req("c"), req("d")
    assert all(slots.acquire(r) for r in (a, b, c))
    assert (a.state_slot, b.state_slot, c.state_slot) == (0, 1, 2)
    assert slots.acquire(a) and a.state_slot == 0  # held already: the same slot
    assert not slots.acquire(d) and d.state_slot is None and slots.num_free == 0
    slots.release(b)
    slots.release(b)  # twice: nothing
    assert b.state_slot is None and slots.acquire(d) and d.state_slot == 1
    slots.check([a, c, d])
    with pytest.raises(AssertionError, match="held slots"):
        slots.check([a, c])  # d's slot lost
    c.state_slot = 0
    with pytest.raises(AssertionError, match="held by a and c"):
        slots.check([a, c, d])
    with pytest.raises(ValueError, match="at least one state slot"):
        StateSlots(0)


def test_no_state_slots_hold_nothing():
    slots, r = NoStateSlots(), req("a")
    assert slots.acquire(r) and r.state_slot is None and not slots.holds_states
    slots.check([r])
    r.state_slot = 3
    with pytest.raises(AssertionError, match="holds state slot 3"):
        slots.check([r])


def test_manager_takes_a_slot_with_the_first_pages():
    kv = KVCacheManager(num_pages=8, page_size=4, enable_prefix_caching=True, num_state_slots=2)
    assert isinstance(kv.prefix_cache, NoPrefixCache) and not kv.shares_prompts and not kv.siblings_fork
    a, b, c = req("a"), req("b"), req("c")
    assert kv.allocate(a, 6) and kv.allocate(b, 6)
    assert (a.state_slot, b.state_slot, len(a.page_ids)) == (0, 1, 2)
    free = kv.num_free_pages
    assert not kv.allocate(c, 6)  # pages enough, no slot: nothing taken
    assert c.state_slot is None and not c.page_ids and kv.num_free_pages == free
    a.num_computed_tokens = 6
    assert kv.allocate(a, 4) and a.state_slot == 0 and len(a.page_ids) == 3  # grows in its slot
    kv.check_integrity([a, b])
    kv.release(a)
    assert a.state_slot is None and kv.states.num_free == 1 and kv.allocate(c, 6) and c.state_slot == 0
    kv.check_integrity([b, c])


def test_attention_only_manager_unchanged():
    kv = KVCacheManager(num_pages=8, page_size=4, enable_prefix_caching=True)
    assert isinstance(kv.prefix_cache, RadixTree) and kv.shares_prompts and not kv.siblings_fork
    a = req("a")
    assert kv.allocate(a, 6) and a.state_slot is None
    assert KVCacheManager(8, 4, enable_prefix_caching=False).siblings_fork
