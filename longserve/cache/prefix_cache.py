"""The prefix cache's contract (SGLang's BasePrefixCache): the radix tree, or NoPrefixCache when prefix
caching is off. The KVCacheManager calls the same methods either way; "no cache" matches nothing, keeps
nothing and frees nothing, so no caller tests which one it has.

Invariant of every implementation: the cache holds exactly one pool reference on each page it stores (none for
NoPrefixCache), and never frees a page a locked node covers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class MatchResult:
    pages: list[int]
    num_tokens: int  # == len(pages) * page_size
    node: Any  # handle on the deepest matched node (for lock/unlock); the root when nothing matched
    # a hybrid model's (StateRadixTree): the recurrent-state checkpoint after exactly these tokens (None: none,
    # or nothing matched), and how far the cached pages reach (-1: as far as num_tokens), past the last checkpoint
    checkpoint: int | None = None
    num_shared_tokens: int = -1


@dataclass(slots=True)
class InsertResult:
    pages: list[int]  # the cache's page ids for the whole inserted run (the caller's own where it kept none)
    num_existing_tokens: int  # leading tokens that were already cached (the cache kept its own pages)
    node: Any  # handle on the deepest node of the run; the root for an empty run


class PrefixCache(ABC):
    """Page-aligned token runs -> KV page ids. Node handles come from match_prefix/insert and go back to
    lock/unlock (and as insert's `start`); a locked node's pages are never evicted. Tokens come as an int64
    array (Request.token_array) or any sequence of ints."""

    #: whether inserted pages are kept for later matches (False: siblings of an n > 1 request share their
    #: leader's prompt pages by the manager's fork_prefix instead)
    keeps_pages: bool = True
    #: whether it keeps a hybrid model's recurrent-state checkpoints (cache/state_radix_tree.py)
    keeps_states: bool = False

    @property
    @abstractmethod
    def num_cached_pages(self) -> int: ...

    @property
    @abstractmethod
    def num_evictable_pages(self) -> int:
        """Cached pages no lock covers: freed by eviction unless a request still holds them."""

    @abstractmethod
    def match_prefix(self, tokens: Sequence[int], limit: int | None = None) -> MatchResult:
        """Longest cached prefix of tokens[:limit], in whole pages."""

    @abstractmethod
    def peek_prefix_len(self, tokens: Sequence[int], limit: int | None = None) -> int:
        """Tokens match_prefix would match now; changes nothing."""

    @abstractmethod
    def insert(self, tokens: Sequence[int], pages: Sequence[int], start: Any = None) -> InsertResult:
        """Offer a whole-page run (below node `start`, when given) to the cache."""

    @abstractmethod
    def lock(self, node: Any) -> None: ...

    @abstractmethod
    def unlock(self, node: Any) -> None: ...

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free up to num_pages unlocked cached pages (least recently used first); returns pages freed."""

    @abstractmethod
    def reset(self) -> int:
        """Evict every unlocked page (flush_cache); returns pages freed."""

    @abstractmethod
    def pages(self) -> Iterator[int]:
        """Every page id the cache holds a reference on."""

    @abstractmethod
    def check(self) -> None:
        """Assert the structure's invariants (tests and debug only)."""

    # a hybrid model's state checkpoints (StateRadixTree); a cache that keeps none is never asked for one
    def take_checkpoint(self, track: bool = False, replacing: bool = False) -> int | None:
        return None

    def attach_checkpoint(self, node: Any, checkpoint: int) -> bool:
        raise AssertionError(f"{type(self).__name__} keeps no state checkpoints")

    def drop_checkpoint(self, checkpoint: int) -> None:
        raise AssertionError(f"{type(self).__name__} keeps no state checkpoints")

    def pin(self, checkpoint: int) -> None:
        raise AssertionError(f"{type(self).__name__} keeps no state checkpoints")

    def unpin(self, checkpoint: int) -> None:
        raise AssertionError(f"{type(self).__name__} keeps no state checkpoints")


class NoPrefixCache(PrefixCache):
    """Prefix caching off: a match finds nothing, an insert keeps nothing (the caller keeps its own pages),
    eviction frees nothing and every count is 0."""

    keeps_pages = False
    _ROOT = object()  # the one node handle; locking it is a no-op

    @property
    def num_cached_pages(self) -> int:
        return 0

    @property
    def num_evictable_pages(self) -> int:
        return 0

    def match_prefix(self, tokens: Sequence[int], limit: int | None = None) -> MatchResult:
        return MatchResult(pages=[], num_tokens=0, node=self._ROOT)

    def peek_prefix_len(self, tokens: Sequence[int], limit: int | None = None) -> int:
        return 0

    def insert(self, tokens: Sequence[int], pages: Sequence[int], start: Any = None) -> InsertResult:
        return InsertResult(pages=list(pages), num_existing_tokens=0, node=self._ROOT)

    def lock(self, node: Any) -> None:
        pass

    def unlock(self, node: Any) -> None:
        pass

    def evict(self, num_pages: int) -> int:
        return 0

    def reset(self) -> int:
        return 0

    def pages(self) -> Iterator[int]:
        return iter(())

    def check(self) -> None:
        pass
