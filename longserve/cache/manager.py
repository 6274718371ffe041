"""KVCacheManager: the scheduler's one door to pages and the prefix cache (pure Python, no torch).

Ownership: every page is held by reference counts in the PagePool. A request holds one reference on each
page in `req.page_ids`; the prefix cache (the radix tree, or NoPrefixCache holding nothing) holds one on each
page it stores. A request also keeps the deepest cache node covering its pages locked, so no page it reads is
evicted. Invariant (checked by `check_integrity`): pool.ref(p) == (1 if p is in the prefix cache) + (number of
live requests holding p). The page size is the pool's.

A hybrid model's running request also holds a recurrent-state slot (cache/state_slots.py), taken with its first
pages and given back with them; its prompt's tokens are never shared (no prefix cache, no forked siblings: a
state cannot be cut at a page boundary).
"""

from __future__ import annotations

from collections.abc import Iterable

from longserve.cache.page_pool import PagePool
from longserve.cache.prefix_cache import NoPrefixCache, PrefixCache
from longserve.cache.radix_tree import RadixTree
from longserve.cache.state_slots import NoStateSlots, StateSlots
from longserve.request import Request


class KVCacheManager:
    def __init__(
        self, num_pages: int, page_size: int, enable_prefix_caching: bool = True, num_state_slots: int = 0
    ) -> None:
        self.pool = PagePool(num_pages, page_size)
        self.states: StateSlots | NoStateSlots = (
            StateSlots(num_state_slots) if num_state_slots else NoStateSlots()
        )
        share = enable_prefix_caching and not self.states.holds_states
        self.prefix_cache: PrefixCache = RadixTree(self.pool) if share else NoPrefixCache()

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def shares_prompts(self) -> bool:
        """Whether a request may start from pages another computed (a prefix hit, a forked sibling): not with
        recurrent states, which hold the whole history and cannot be shared."""
        return not self.states.holds_states

    @property
    def siblings_fork(self) -> bool:
        """Whether the siblings of an n > 1 request take their leader's prompt pages with `fork_prefix`:
        so when the prefix cache keeps no pages for `match_prefix` to find."""
        return self.shares_prompts and not self.prefix_cache.keeps_pages

    # ---- capacity -------------------------------------------------------------------------------
    @property
    def num_total_pages(self) -> int:
        return self.pool.num_total

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_pages(self) -> int:
        """Pages the prefix cache holds (some may be held by requests too)."""
        return self.prefix_cache.num_cached_pages

    @property
    def num_reclaimable_pages(self) -> int:
        """Pages free now or after evicting every unlocked cached page."""
        return self.pool.num_free + self.prefix_cache.num_evictable_pages

    def usage(self) -> float:
        """Share of pages held by running requests (cached-but-evictable pages count as free)."""
        return 1.0 - self.num_reclaimable_pages / self.pool.num_total

    def pages_needed(self, req: Request, num_new_tokens: int) -> int:
        total = req.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.page_size) - len(req.page_ids))

    # ---- admission ------------------------------------------------------------------------------
    def match_prefix(self, req: Request) -> int:
        """Attach the longest cached page-aligned prefix of the request's tokens, leaving at least one
        token to compute (the one whose logits we sample), and, for prompt logprobs, every position whose
        logits are asked for (Request.max_prefix_len). Returns the number of tokens attached."""
        assert not req.page_ids and req.num_computed_tokens == 0 and req.cache_node is None
        # the prompt's int64 array (add_request's check built it), read up to the limit: no copy
        match = self.prefix_cache.match_prefix(req.token_array(), limit=req.max_prefix_len)
        if match.num_tokens:
            self.pool.incref(match.pages)
            req.page_ids = list(match.pages)
            req.num_computed_tokens = match.num_tokens
            req.num_tree_pages = len(match.pages)
            self.prefix_cache.lock(match.node)
            req.cache_node = match.node
        return match.num_tokens

    def peek_prefix_len(self, req: Request) -> int:
        """Tokens `match_prefix` would attach to this (unattached) request now; changes nothing."""
        return self.prefix_cache.peek_prefix_len(req.token_array(), limit=req.max_prefix_len)

    def fork_prefix(self, req: Request, src: Request) -> int:
        """Share `src`'s full prompt pages with a sibling that has the same prompt (n > 1 without the
        prefix cache). Leaves at least one token to compute. Returns the number of tokens shared."""
        assert not req.page_ids and req.num_computed_tokens == 0
        usable = min(src.num_computed_tokens, req.max_prefix_len, len(src.prompt_token_ids))
        num_pages = min(usable // self.page_size, len(src.page_ids))
        if num_pages == 0:
            return 0
        pages = src.page_ids[:num_pages]
        self.pool.incref(pages)
        req.page_ids = list(pages)
        req.num_computed_tokens = num_pages * self.page_size
        return req.num_computed_tokens

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Give the request pages for `num_new_tokens` more tokens, evicting cached pages if needed, and (a
        hybrid model) its state slot if it has none. Returns False, changing nothing, when even eviction cannot
        make room or every slot is held."""
        need = self.pages_needed(req, num_new_tokens)
        if need == 0:
            return self.states.acquire(req)
        if self.pool.num_free < need:
            self.prefix_cache.evict(need - self.pool.num_free)
        if self.pool.num_free < need or not self.states.acquire(req):
            return False
        pages = self.pool.alloc(need)
        assert pages is not None
        req.page_ids.extend(pages)
        return True

    # ---- progress and release -------------------------------------------------------------------
    def cache_computed(self, req: Request) -> None:
        """Offer the request's newly completed full pages to the prefix cache so that other requests (and
        this one, after a preemption) can reuse them, and move its lock to the new deepest node."""
        num_full = min(req.num_computed_tokens // self.page_size, len(req.page_ids))
        if num_full <= req.num_tree_pages:
            return
        # continue below the node the request holds (its first num_tree_pages pages): a prefix hit of 32K
        # tokens inserts its few new pages without walking the 2,048 it matched
        done = req.num_tree_pages if req.cache_node is not None else 0
        tokens = req.token_array(done * self.page_size, num_full * self.page_size)
        result = self.prefix_cache.insert(tokens, req.page_ids[done:num_full], start=req.cache_node)
        # computed twice (e.g. by a concurrent request over the same document): use the cache's copies, in one
        # incref and one decref (each costs ~8 us however few pages)
        swaps = [(i, t) for i, t in enumerate(result.pages, start=done) if req.page_ids[i] != t]
        if swaps:
            self.pool.incref([t for _, t in swaps])
            self.pool.decref([req.page_ids[i] for i, _ in swaps])
            for i, tree_page in swaps:
                req.page_ids[i] = tree_page
        self.prefix_cache.lock(result.node)
        if req.cache_node is not None:
            self.prefix_cache.unlock(req.cache_node)
        req.cache_node = result.node
        req.num_tree_pages = num_full

    def release(self, req: Request, cache: bool = True) -> None:
        """Drop the request's hold on its pages (finish, abort, preemption). With `cache`, its computed
        full pages first go into the prefix cache."""
        if cache:
            self.cache_computed(req)
        if req.cache_node is not None:
            self.prefix_cache.unlock(req.cache_node)
            req.cache_node = None
        self.pool.decref(req.page_ids)
        req.page_ids = []
        req.num_tree_pages = 0
        self.states.release(req)

    def flush(self) -> int:
        """Evict every unlocked cached page; returns pages freed."""
        return self.prefix_cache.reset()

    # ---- integrity ------------------------------------------------------------------------------
    def check_integrity(self, live_requests: Iterable[Request]) -> None:
        """Assert that every reference is accounted for: free + cached-only + in use == total; every state
        slot free or held by one live request."""
        live_requests = list(live_requests)
        self.states.check(live_requests)
        self.pool.check()
        self.prefix_cache.check()
        expected: dict[int, int] = {}
        in_tree = set(self.prefix_cache.pages())
        for p in in_tree:
            expected[p] = expected.get(p, 0) + 1
        in_use: set[int] = set()
        for req in live_requests:
            for p in req.page_ids:
                expected[p] = expected.get(p, 0) + 1
                in_use.add(p)
        for p in range(1, self.pool.num_total + 1):
            assert self.pool.ref(p) == expected.get(p, 0), (
                f"page {p}: pool refcount {self.pool.ref(p)} but {expected.get(p, 0)} holders"
            )
        cached_only = len(in_tree - in_use)
        assert self.pool.num_free + cached_only + len(in_use) == self.pool.num_total
