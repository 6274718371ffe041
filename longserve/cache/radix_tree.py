"""Radix tree from page-aligned token runs to KV page ids (SGLang's RadixAttention, page-granular).

Invariants: every non-root node holds a key whose length is a positive multiple of page_size and one page
id per page of key; children are keyed by their first page of tokens; the tree holds exactly one pool
reference on each page stored in it and no page appears twice; lock_ref = own_locks + sum of the children's
lock_ref, and a node with lock_ref > 0 is never evicted. A node object keeps its identity across splits
(the split-off prefix is a new node), so callers may hold nodes returned by match/insert across calls.
The page size is the pool's (PagePool.page_size).

Keys are int64 arrays, compared vectorized: a 32K-token prefix hit compares in ~10 us where tuples of Python
ints took ~0.25 ms on the CI CPU (~0.9 ms on an H200 host, the hit's host profile at `003f098`), and a caller
that holds the tokens as an array (Request.token_array: the one add_request's check built) converts nothing.
Children are keyed by their first page's bytes.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from longserve.cache.page_pool import PagePool
from longserve.cache.prefix_cache import InsertResult, MatchResult, PrefixCache

__all__ = ["InsertResult", "MatchResult", "RadixTree", "TreeNode"]


@dataclass(slots=True, eq=False)
class TreeNode:
    key: np.ndarray  # int64 token ids, a whole number of pages
    pages: list[int]
    # repr=False: parent/children point at each other and would print the whole tree.
    parent: TreeNode | None = field(default=None, repr=False)
    children: dict[bytes, TreeNode] = field(default_factory=dict, repr=False)  # by first page's bytes
    lock_ref: int = 0  # locks on this node or any descendant
    own_locks: int = 0  # locks taken on exactly this node
    last_access: int = 0  # logical clock stamp; a parent's stamp is >= each child's
    detached: bool = False  # set once evicted, so a stale handle cannot be locked
    # a hybrid model's recurrent-state checkpoint after exactly this node's last token (cache/state_radix_tree.py)
    checkpoint: int | None = None


class RadixTree(PrefixCache):
    """Prefix cache over a PagePool; all lengths are whole pages of the pool's page size. Its node handles
    (in MatchResult/InsertResult) are TreeNodes."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self._root = TreeNode(key=np.zeros(0, dtype=np.int64), pages=[])
        self._clock = 0
        self._num_cached_pages = 0
        self._num_evictable_pages = 0

    # ---- queries -------------------------------------------------------------------------------

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def root(self) -> TreeNode:
        return self._root

    @property
    def num_cached_pages(self) -> int:
        return self._num_cached_pages

    @property
    def num_evictable_pages(self) -> int:
        return self._num_evictable_pages

    @property
    def num_locked_pages(self) -> int:
        return self._num_cached_pages - self._num_evictable_pages

    def match_prefix(self, tokens: Sequence[int] | np.ndarray, limit: int | None = None) -> MatchResult:
        """Longest cached prefix of tokens[:limit] in whole pages; splits a node so the match ends on a node."""
        end = self._match_end(tokens, limit)
        node, pages, _ = self._walk(token_array(tokens), stop_at_split=True, end=end)
        return MatchResult(pages=pages, num_tokens=len(pages) * self.page_size, node=node)

    def peek_prefix_len(self, tokens: Sequence[int] | np.ndarray, limit: int | None = None) -> int:
        """Tokens match_prefix would match, without touching the tree (no split, no LRU stamp)."""
        return max((pos for pos, _ in self._peek_walk(tokens, limit)), default=0)  # the last: they grow

    def _match_end(self, tokens: Sequence[int] | np.ndarray, limit: int | None) -> int:
        """How far a match of tokens[:limit] may reach: a trailing partial page never matches."""
        n = len(tokens) if limit is None else max(0, min(limit, len(tokens)))
        return n - n % self.page_size

    def _peek_walk(
        self, tokens: Sequence[int] | np.ndarray, limit: int | None
    ) -> Iterator[tuple[int, TreeNode | None]]:
        """The path tokens[:limit] matches, without touching the tree: (tokens matched, the node they end at)
        for each node matched whole, then (tokens matched, None) where the match ends inside a node."""
        ps, n = self.page_size, self._match_end(tokens, limit)
        toks = token_array(tokens)
        node, pos = self._root, 0
        while pos < n:
            child = node.children.get(toks[pos : pos + ps].tobytes())
            if child is None:
                return
            m = self._match_len(child.key, toks, pos, n)
            pos += m
            if m < len(child.key):
                yield pos, None
                return
            node = child
            yield pos, node

    # ---- mutation ------------------------------------------------------------------------------

    def insert(
        self, tokens: Sequence[int] | np.ndarray, pages: Sequence[int], start: TreeNode | None = None
    ) -> InsertResult:
        """Cache a whole-page run. The tree keeps its pages for the cached part and adopts (increfs once)
        the caller's pages for the rest; the caller should switch to the returned ids and drop its own
        duplicates for the first num_existing_tokens.

        With `start` (an attached node, e.g. one the caller holds locked), the run continues the path that
        ends at `start`: tokens, pages and the result cover only what lies below it, so a request that
        extends its cached prefix does not walk that prefix again."""
        ps = self.page_size
        if len(tokens) % ps != 0:
            raise ValueError(
                f"insert needs whole pages: {len(tokens)} tokens is not a multiple of page_size={ps}"
            )
        if len(pages) != len(tokens) // ps:
            raise ValueError(
                f"insert of {len(tokens)} tokens needs {len(tokens) // ps} pages, got {len(pages)}"
            )
        toks = token_array(tokens)
        if start is not None:
            self._check_attached(start)
        node, out_pages, pos = self._walk(toks, stop_at_split=False, start=start)
        num_existing = pos
        if pos < len(toks):
            new_pages = list(pages[pos // ps :])
            # Incref before attaching: if a page is free (a caller bug) the pool raises and the tree is intact.
            self.pool.incref(new_pages)
            # a copy: the caller's array (a whole prompt) is not kept alive by a node covering part of it
            leaf = TreeNode(key=toks[pos:].copy(), pages=new_pages, parent=node, last_access=self._clock)
            node.children[leaf.key[:ps].tobytes()] = leaf
            self._num_cached_pages += len(new_pages)
            self._num_evictable_pages += len(new_pages)
            out_pages.extend(new_pages)
            node = leaf
        return InsertResult(pages=out_pages, num_existing_tokens=num_existing, node=node)

    def lock(self, node: TreeNode) -> None:
        """Pin node and its ancestors against eviction. Locking the root is a no-op."""
        self._check_attached(node)
        if node is self._root:
            return
        node.own_locks += 1
        cur: TreeNode | None = node
        while cur is not None and cur is not self._root:
            if cur.lock_ref == 0:
                self._num_evictable_pages -= len(cur.pages)
            cur.lock_ref += 1
            cur = cur.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one lock(node). Unlocking the root is a no-op."""
        self._check_attached(node)
        if node is self._root:
            return
        if node.own_locks <= 0:
            raise ValueError(
                f"unlock of a node that holds no lock of its own (key starts {node.key[:8].tolist()})"
            )
        node.own_locks -= 1
        cur: TreeNode | None = node
        while cur is not None and cur is not self._root:
            assert cur.lock_ref > 0
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                self._num_evictable_pages += len(cur.pages)
            cur = cur.parent

    def evict(self, num_pages: int) -> int:
        """Remove unlocked leaves in LRU order until num_pages pages reached refcount 0 (pages a request
        still holds leave the tree but do not count) or nothing is evictable. Returns pages freed."""
        return self._evict(num_pages)

    def reset(self) -> int:
        """Evict every unlocked node (flush_cache); returns pages freed."""
        return self._evict(None)

    # ---- internals -----------------------------------------------------------------------------

    def _walk(
        self,
        toks: np.ndarray,
        stop_at_split: bool,
        start: TreeNode | None = None,
        end: int | None = None,
    ) -> tuple[TreeNode, list[int], int]:
        """Descend along toks[:end] (whole pages) from `start` (default: the root), splitting where the match
        ends inside a node; stamps the path, and start's ancestors. Returns (deepest matched node, the pages
        matched below start, matched token count)."""
        ps = self.page_size
        end = len(toks) if end is None else end
        self._clock += 1
        node = self._root if start is None else start
        up: TreeNode | None = node
        while up is not None:  # a parent's stamp stays >= each child's
            up.last_access = self._clock
            up = up.parent
        pages: list[int] = []
        pos = 0
        while pos < end:
            child = node.children.get(toks[pos : pos + ps].tobytes())
            if child is None:
                break
            m = self._match_len(child.key, toks, pos, end)
            split = m < len(child.key)
            if split:
                child = self._split(child, m)
            child.last_access = self._clock
            pages.extend(child.pages)
            pos += m
            node = child
            if split and stop_at_split:
                break
        return node, pages, pos

    def _match_len(self, key: np.ndarray, toks: np.ndarray, start: int, end: int) -> int:
        """Tokens of key matching toks[start:end], in whole pages (>= one page: the child key matched)."""
        limit = min(len(key), end - start)
        if limit <= 0:
            return 0
        differ = key[:limit] != toks[start : start + limit]
        first = int(differ.argmax())  # the first differing token (argmax of a bool array stops at the first)
        m = first if differ[first] else limit
        return m - m % self.page_size

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut node after `at` tokens; returns the new prefix node. `node` keeps the suffix (and its
        identity, locks and children), so handles held by callers stay valid."""
        ps = self.page_size
        assert 0 < at < len(node.key) and at % ps == 0
        parent = node.parent
        assert parent is not None
        head = TreeNode(
            key=node.key[:at],
            pages=node.pages[: at // ps],
            parent=parent,
            # Every lock below head runs through node, so head inherits node's whole lock_ref.
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        parent.children[head.key[:ps].tobytes()] = head
        node.key = node.key[at:]
        node.pages = node.pages[at // ps :]
        node.parent = head
        head.children[node.key[:ps].tobytes()] = node
        return head

    def _evict(self, num_pages: int | None) -> int:
        if num_pages is not None and num_pages <= 0:
            return 0
        # Page ids are unique in the tree, so (stamp, first page) is a total order: no node comparisons.
        heap = [(n.last_access, n.pages[0], n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        ps = self.page_size
        freed = 0
        dropped: list[int] = []  # the evicted nodes' pages, let go of in one decref at the end
        while heap and (num_pages is None or freed < num_pages):
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[:ps].tobytes()]
            node.parent = None
            node.detached = True
            self._on_evict(node)
            self._num_cached_pages -= len(node.pages)
            self._num_evictable_pages -= len(node.pages)
            # what the decref will free: pages no request holds (nothing else moves a count meanwhile)
            freed += self.pool.num_sole(node.pages)
            dropped.extend(node.pages)
            if parent is not self._root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.pages[0], parent))
        # one vectorized decref: per node it cost ~8 us (16,000 one-page nodes: 57 -> 155 ms when the pool's
        # counts became an array; the CI CPU)
        self.pool.decref(dropped)
        return freed

    def _on_evict(self, node: TreeNode) -> None:
        """A node has left the tree (eviction); subclasses drop what they attached to it."""

    def pages(self) -> Iterator[int]:
        for node in self._nodes():
            yield from node.pages

    def _nodes(self) -> Iterator[TreeNode]:
        """All non-root nodes, depth first."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _check_attached(self, node: TreeNode) -> None:
        if node.detached:
            raise ValueError("node was evicted; lock it right after match_prefix/insert returns it")

    def check(self) -> None:
        """Assert structural invariants with a full walk (tests and debug only)."""
        ps = self.page_size
        root = self._root
        assert len(root.key) == 0 and root.pages == [] and root.parent is None
        assert root.lock_ref == 0 and root.own_locks == 0
        seen: set[int] = set()
        num_cached = num_evictable = 0
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for first, child in node.children.items():
                assert child.parent is node, "child's parent pointer is stale"
                assert not child.detached
                assert len(child.key) > 0 and len(child.key) % ps == 0, f"key length {len(child.key)}"
                assert len(child.pages) == len(child.key) // ps, "pages do not cover the key"
                assert child.key.dtype == np.int64 and child.key.ndim == 1, "key is not an int64 row"
                assert first == child.key[:ps].tobytes(), "child stored under the wrong first page"
                assert child.last_access <= node.last_access or node is root, "child newer than parent"
                for p in child.pages:
                    assert p not in seen, f"page {p} appears twice in the tree"
                    seen.add(p)
                    assert self.pool.ref(p) >= 1, f"tree page {p} is free in the pool"
                num_cached += len(child.pages)
                if child.lock_ref == 0:
                    num_evictable += len(child.pages)
                child_locks += child.lock_ref
                stack.append(child)
            if node is not root:
                assert node.own_locks >= 0
                assert node.lock_ref == node.own_locks + child_locks, "lock_ref out of sync with locks"
        assert num_cached == self._num_cached_pages, (
            f"num_cached_pages {self._num_cached_pages} != {num_cached}"
        )
        assert num_evictable == self._num_evictable_pages, (
            f"num_evictable_pages {self._num_evictable_pages} != {num_evictable}"
        )


def token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """tokens as a 1-D int64 array: itself when it is one (no copy), else converted."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int64 and tokens.ndim == 1:
        return tokens
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one row, got shape {arr.shape}")
    return arr
