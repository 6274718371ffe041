"""KVCacheManager: the scheduler's one door to pages and the prefix cache (pure Python, no torch).

Ownership: every page is held by reference counts in the PagePool. A request holds one reference on each
page in `req.page_ids`; the radix tree holds one on each page it stores. A request also keeps the deepest
tree node covering its pages locked, so no page it reads is evicted. Invariant (checked by
`check_integrity`): pool.ref(p) == (1 if p is in the tree) + (number of live requests holding p).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from longserve.cache.page_pool import PagePool
from longserve.cache.radix_tree import RadixTree
from longserve.request import Request


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        self.tree: RadixTree | None = RadixTree(self.pool, page_size) if enable_prefix_caching else None

    # ---- capacity -------------------------------------------------------------------------------
    @property
    def num_total_pages(self) -> int:
        return self.pool.num_total

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def num_reclaimable_pages(self) -> int:
        """Pages free now or after evicting every unlocked cached page."""
        evictable = self.tree.num_evictable_pages if self.tree is not None else 0
        return self.pool.num_free + evictable

    def usage(self) -> float:
        """Share of pages held by running requests (cached-but-evictable pages count as free)."""
        return 1.0 - self.num_reclaimable_pages / self.pool.num_total

    def pages_needed(self, req: Request, num_new_tokens: int) -> int:
        total = req.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.page_size) - len(req.page_ids))

    # ---- admission ------------------------------------------------------------------------------
    def match_prefix(self, req: Request) -> int:
        """Attach the longest cached page-aligned prefix of the request's tokens, leaving at least one
        token to compute (the one whose logits we sample). Returns the number of tokens attached."""
        assert not req.page_ids and req.num_computed_tokens == 0 and req.cache_node is None
        if self.tree is None:
            return 0
        # no copy of a fresh request's (possibly 100K-token) prompt: the tree reads up to the limit
        tokens = req.prompt_token_ids if not req.output_token_ids else req.all_token_ids()
        match = self.tree.match_prefix(tokens, limit=len(tokens) - 1)
        if match.num_tokens:
            self.pool.incref(match.pages)
            req.page_ids = list(match.pages)
            req.num_computed_tokens = match.num_tokens
            req.num_tree_pages = len(match.pages)
            self.tree.lock(match.node)
            req.cache_node = match.node
        return match.num_tokens

    def peek_prefix_len(self, req: Request) -> int:
        """Tokens `match_prefix` would attach to this (unattached) request now; changes nothing."""
        if self.tree is None:
            return 0
        tokens = req.prompt_token_ids if not req.output_token_ids else req.all_token_ids()
        return self.tree.peek_prefix_len(tokens, limit=len(tokens) - 1)

    def fork_prefix(self, req: Request, src: Request) -> int:
        """Share `src`'s full prompt pages with a sibling that has the same prompt (n > 1 without the
        prefix cache). Leaves at least one token to compute. Returns the number of tokens shared."""
        assert not req.page_ids and req.num_computed_tokens == 0
        usable = min(src.num_computed_tokens, req.num_tokens - 1, len(src.prompt_token_ids))
        num_pages = min(usable // self.page_size, len(src.page_ids))
        if num_pages == 0:
            return 0
        pages = src.page_ids[:num_pages]
        self.pool.incref(pages)
        req.page_ids = list(pages)
        req.num_computed_tokens = num_pages * self.page_size
        return req.num_computed_tokens

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Give the request pages for `num_new_tokens` more tokens, evicting cached pages if needed.
        Returns False, changing nothing, when even eviction cannot make room."""
        need = self.pages_needed(req, num_new_tokens)
        if need == 0:
            return True
        if self.pool.num_free < need and self.tree is not None:
            self.tree.evict(need - self.pool.num_free)
        pages = self.pool.alloc(need)
        if pages is None:
            return False
        req.page_ids.extend(pages)
        return True

    # ---- progress and release -------------------------------------------------------------------
    def cache_computed(self, req: Request) -> None:
        """Insert the request's newly completed full pages into the radix tree so that other requests
        (and this one, after a preemption) can reuse them, and move its lock to the new deepest node."""
        if self.tree is None:
            return
        num_full = min(req.num_computed_tokens // self.page_size, len(req.page_ids))
        if num_full <= req.num_tree_pages:
            return
        # continue below the node the request holds (its first num_tree_pages pages): a prefix hit of 32K
        # tokens inserts its few new pages without walking the 2,048 it matched
        done = req.num_tree_pages if req.cache_node is not None else 0
        tokens = req.token_slice(done * self.page_size, num_full * self.page_size)
        result = self.tree.insert(tokens, req.page_ids[done:num_full], start=req.cache_node)
        for i, tree_page in enumerate(result.pages, start=done):
            mine = req.page_ids[i]
            if mine != tree_page:  # computed twice (e.g. by a concurrent request): use the tree's copy
                self.pool.incref([tree_page])
                self.pool.decref([mine])
                req.page_ids[i] = tree_page
        self.tree.lock(result.node)
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.cache_node = result.node
        req.num_tree_pages = num_full

    def release(self, req: Request, cache: bool = True) -> None:
        """Drop the request's hold on its pages (finish, abort, preemption). With `cache`, its computed
        full pages first go into the prefix cache."""
        if cache:
            self.cache_computed(req)
        if req.cache_node is not None:
            assert self.tree is not None
            self.tree.unlock(req.cache_node)
            req.cache_node = None
        self.pool.decref(req.page_ids)
        req.page_ids = []
        req.num_tree_pages = 0

    def flush(self) -> int:
        """Evict every unlocked cached page; returns pages freed."""
        return self.tree.reset() if self.tree is not None else 0

    # ---- integrity ------------------------------------------------------------------------------
    def tree_pages(self) -> Iterator[int]:
        if self.tree is None:
            return
        stack = list(self.tree.root.children.values())
        while stack:
            node = stack.pop()
            yield from node.pages
            stack.extend(node.children.values())

    def check_integrity(self, live_requests: Iterable[Request]) -> None:
        """Assert that every reference is accounted for: free + cached-only + in use == total."""
        self.pool.check()
        if self.tree is not None:
            self.tree.check()
        expected: dict[int, int] = {}
        in_tree = set(self.tree_pages())
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
