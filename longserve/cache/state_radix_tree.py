"""The prefix cache of a hybrid model (Qwen3.5, Qwen3-Next): the radix tree, plus recurrent-state checkpoints.

A Gated DeltaNet layer folds a request's whole history into one fixed-size state, so a prefix hit needs, besides
the full-attention layers' K/V pages, the state after exactly the matched tokens. This tree keeps such states as
checkpoints: copies of a request's state slot taken when one of its prompt chunks ends on a page boundary (those
the scheduler cuts chunks at, `Request.state_marks`: the prompt's last full page, and where it leaves a path the
cache already holds; and any usual chunk's end on a page before them) or taken inside a chunk on a page up to 63
tokens before a mark (KVCacheManager.in_step_save), each attached to the node that ends there. A match stops at the deepest node holding a checkpoint on the
matched path (SGLang's MambaRadixCache, vLLM's `--mamba-cache-mode align`); the request's first step copies that
checkpoint into its own slot (attention/recurrent_state.py, `StepInputs.state_copies`).

Checkpoints are ids first_id..first_id+num-1 of the runner's state rows, after the running requests' slots. Each
is free, in flight (taken for a step's save, attached when the step is advanced), or attached to one node. When
none is free, the least recently used attached one that no pending restore reads is dropped (its node keeps its
pages); a node evicted with its pages frees its checkpoint. Between a match and the step that copies it (the same
scheduling pass, the copy queued before any later save on the one stream), a checkpoint is pinned.

A decoding request's tracked state (KVCacheManager.track_target, --mamba-track-interval) holds its checkpoint in
flight until the request ends: at most TRACK_SHARE of the checkpoints at once, and a newer one replacing it only
where a checkpoint is free, so that many long answers cannot evict every document's checkpoint (a hybrid model's prefix hit needs one: without it a question over a cached
16K-token document recomputes all of it). SGLang keeps such tracked states in buffers of the request's own, apart
from its cache's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from longserve.cache.page_pool import PagePool
from longserve.cache.prefix_cache import MatchResult
from longserve.cache.radix_tree import RadixTree, TreeNode, token_array

# The share of the checkpoints decoding requests may hold in flight for their tracked states (the rest serve the
# prompts' marks and the cache's attached states).
TRACK_SHARE = 0.5


class StateRadixTree(RadixTree):
    keeps_states = True

    def __init__(self, pool: PagePool, num_checkpoints: int, first_id: int) -> None:
        if num_checkpoints < 1:
            raise ValueError(
                f"a hybrid model's prefix cache needs at least one checkpoint, got {num_checkpoints}"
            )
        super().__init__(pool)
        self._ids = range(first_id, first_id + num_checkpoints)
        self._free = list(reversed(self._ids))  # popped from the end: the lowest id first
        self._attached: dict[int, TreeNode] = {}
        self._in_flight: set[int] = set()
        self._tracks: set[int] = set()  # in flight for a decoding request's tracked state (TRACK_SHARE)
        self._pins: dict[int, int] = {}  # checkpoint -> restores queued but not yet launched

    @property
    def num_checkpoints(self) -> int:
        return len(self._ids)

    @property
    def num_attached_checkpoints(self) -> int:
        return len(self._attached)

    # ---- matching ------------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int] | np.ndarray, limit: int | None = None) -> MatchResult:
        """The longest cached prefix of tokens[:limit] that ends on a checkpoint; `num_shared_tokens` is how far
        the cached pages reach (where the request's tokens leave the tree, a place worth a checkpoint)."""
        end = self._match_end(tokens, limit)
        node, pages, shared = self._walk(token_array(tokens), stop_at_split=True, end=end)
        keep = len(pages)
        while node is not self._root and node.checkpoint is None:
            keep -= len(node.pages)
            node = node.parent
            assert node is not None
        return MatchResult(
            pages=pages[:keep],
            num_tokens=keep * self.page_size,
            node=node,
            checkpoint=node.checkpoint,
            num_shared_tokens=shared,
        )

    def peek_prefix_len(self, tokens: Sequence[int] | np.ndarray, limit: int | None = None) -> int:
        """Tokens match_prefix would attach now (to the deepest checkpoint); changes nothing."""
        walk = self._peek_walk(tokens, limit)
        return max((pos for pos, node in walk if node is not None and node.checkpoint is not None), default=0)

    # ---- checkpoints ---------------------------------------------------------------------------

    @property
    def max_tracks(self) -> int:
        """How many checkpoints decoding requests' tracked states may hold at once (TRACK_SHARE, one at least)."""
        return max(1, int(self.num_checkpoints * TRACK_SHARE))

    def take_checkpoint(self, track: bool = False, replacing: bool = False) -> int | None:
        """A checkpoint id for a step to save a state into (in flight until attached or dropped); None when
        every one is attached and pinned, or (`track`: for a decoding request's tracked state) when max_tracks
        are held so already. A newer tracked state that will replace its request's older one (`replacing`) adds
        no tracking request and takes a free checkpoint only, never evicting one (the older stays then): several
        replacing at once would each need one more for a step."""
        if track and not replacing and len(self._tracks) >= self.max_tracks:
            return None
        if not self._free:
            if replacing:
                return None
            unpinned = [(node.last_access, c) for c, node in self._attached.items() if c not in self._pins]
            if not unpinned:
                return None
            _, c = min(unpinned)
            self._attached.pop(c).checkpoint = None
            self._free.append(c)
        c = self._free.pop()
        self._in_flight.add(c)
        if track:
            self._tracks.add(c)
        return c

    def attach_checkpoint(self, node: TreeNode, checkpoint: int) -> bool:
        """The saved state after exactly `node`'s last token; dropped (False) if the node already has one (the
        same prompt computed twice) or has left the tree."""
        self._in_flight.remove(checkpoint)
        self._tracks.discard(checkpoint)
        if node is self._root or node.detached or node.checkpoint is not None:
            self._free.append(checkpoint)
            return False
        node.checkpoint = checkpoint
        self._attached[checkpoint] = node
        return True

    def drop_checkpoint(self, checkpoint: int) -> None:
        """An in-flight checkpoint whose request ended before its step was advanced (or a tracked state a newer
        one replaces)."""
        self._in_flight.remove(checkpoint)
        self._tracks.discard(checkpoint)
        self._free.append(checkpoint)

    def pin(self, checkpoint: int) -> None:
        assert checkpoint in self._attached, f"pin of checkpoint {checkpoint}, which no node holds"
        self._pins[checkpoint] = self._pins.get(checkpoint, 0) + 1

    def unpin(self, checkpoint: int) -> None:
        left = self._pins[checkpoint] - 1
        if left:
            self._pins[checkpoint] = left
        else:
            del self._pins[checkpoint]

    def _on_evict(self, node: TreeNode) -> None:
        c = node.checkpoint
        if c is None:
            return
        # a pinned checkpoint's node is locked by the request that will read it: never evicted
        assert c not in self._pins, f"evicted a node whose checkpoint {c} a restore still reads"
        del self._attached[c]
        node.checkpoint = None
        self._free.append(c)

    def check(self) -> None:
        super().check()
        free, attached = set(self._free), set(self._attached)
        assert len(free) == len(self._free), "a checkpoint is free twice"
        assert not (free & attached) and not (free & self._in_flight) and not (attached & self._in_flight)
        assert free | attached | self._in_flight == set(self._ids), "a checkpoint is lost"
        assert self._tracks <= self._in_flight, "a tracked state's checkpoint neither in flight nor let go"
        assert set(self._pins) <= attached and all(v > 0 for v in self._pins.values()), (
            "a pin on a free checkpoint"
        )
        held = {node.checkpoint: node for node in self._nodes() if node.checkpoint is not None}
        assert held.keys() == attached and all(held[c] is self._attached[c] for c in held), (
            "the tree's checkpoints and the attached ones differ"
        )
