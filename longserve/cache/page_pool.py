"""Reference-counted page ids for the paged KV cache, and the page size (tokens per page) on the cache side.

Invariants: ids handed out are 1..num_pages (page 0 is a padding target for kernels and is never
allocated); a page is on the free heap exactly when its refcount is 0; alloc returns the lowest free ids.
`page_size` is stored here only: the radix tree and the KVCacheManager read it from their pool.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable


class PagePool:
    """Owns page ids and their refcounts; holders (requests, the radix tree) each keep one reference."""

    __slots__ = ("_num_total", "_page_size", "_ref", "_free")

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self._num_total = num_pages
        self._page_size = page_size
        # Index 0 is the reserved padding page; it stays at refcount 0 and is never on the heap.
        self._ref: list[int] = [0] * (num_pages + 1)
        # A sorted list is already a valid min-heap.
        self._free: list[int] = list(range(1, num_pages + 1))

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_total - len(self._free)

    def ref(self, page: int) -> int:
        self._check_id(page)
        return self._ref[page]

    def alloc(self, n: int) -> list[int] | None:
        """The n lowest free pages (ascending), each at refcount 1; None and no change if too few are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            return None
        # Lowest ids first keeps page tables compact and makes tests deterministic.
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._ref[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        if not pages:
            return
        # Validate everything before mutating so a bad call leaves the pool untouched (C-level passes:
        # a 32K-token prefix hit increfs 2,048 pages).
        self._check_ids(pages)
        ref = self._ref
        if 0 in map(ref.__getitem__, pages):
            raise ValueError(f"incref of free page {next(p for p in pages if ref[p] == 0)}")
        for p in pages:
            ref[p] += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference per listed page; returns the pages whose count reached 0 (now free)."""
        pages = list(pages)
        if not pages:
            return []
        self._check_ids(pages)
        ref = self._ref
        if len(set(pages)) == len(pages):  # the usual case: each page once
            if 0 in map(ref.__getitem__, pages):
                p = next(p for p in pages if ref[p] == 0)
                raise ValueError(f"decref of page {p} below zero (refcount 0, dropping 1)")
        else:
            for p, count in Counter(pages).items():
                if ref[p] < count:
                    raise ValueError(f"decref of page {p} below zero (refcount {ref[p]}, dropping {count})")
        freed: list[int] = []
        for p in pages:
            ref[p] -= 1
            if ref[p] == 0:
                heapq.heappush(self._free, p)
                freed.append(p)
        return freed

    def check(self) -> None:
        """Assert internal consistency; cheap enough for tests, O(num_pages)."""
        assert self._ref[0] == 0, "reserved page 0 was referenced"
        assert len(self._ref) == self._num_total + 1
        assert all(r >= 0 for r in self._ref), "negative refcount"
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "duplicate page on the free heap"
        zero = {p for p in range(1, self._num_total + 1) if self._ref[p] == 0}
        assert free_set == zero, f"free heap {sorted(free_set)} != zero-ref pages {sorted(zero)}"
        h = self._free
        for i in range(1, len(h)):
            assert h[(i - 1) // 2] <= h[i], "free list lost its heap order"

    def _check_ids(self, pages: list[int]) -> None:
        if min(pages) < 1 or max(pages) > self._num_total:
            for p in pages:
                self._check_id(p)

    def _check_id(self, page: int) -> None:
        if not 1 <= page <= self._num_total:
            raise ValueError(f"page id {page} out of range 1..{self._num_total}")

    def __repr__(self) -> str:
        return f"PagePool(total={self._num_total}, free={self.num_free}, page_size={self._page_size})"
