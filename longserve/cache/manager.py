"""KVCacheManager: the scheduler's one door to pages and the prefix cache (pure Python, no torch).

Ownership: every page is held by reference counts in the PagePool. A request holds one reference on each
page in `req.page_ids`; the prefix cache (the radix tree, or NoPrefixCache holding nothing) holds one on each
page it stores. A request also keeps the deepest cache node covering its pages locked, so no page it reads is
evicted. Invariant (checked by `check_integrity`): pool.ref(p) == (1 if p is in the prefix cache) + (number of
live requests holding p). The page size is the pool's.

A hybrid model's running request also holds a recurrent-state slot (cache/state_slots.py), taken with its first
pages and given back with them. A slot holds the whole history and cannot be cut at a page boundary, so such a
model's prefix cache (cache/state_radix_tree.py) also keeps state checkpoints, saved where the scheduler ends a
chunk on one of the request's `state_marks` or inside a chunk just before one (`in_step_save`), and a hit reaches
only as far as the deepest checkpoint (copied into the request's slot before its first step: `req.state_restore`);
without prefix caching nothing is shared (no forked siblings either).
"""

from __future__ import annotations

from collections.abc import Iterable

from longserve.cache.page_pool import PagePool
from longserve.cache.prefix_cache import NoPrefixCache, PrefixCache
from longserve.cache.radix_tree import RadixTree
from longserve.cache.state_radix_tree import StateRadixTree
from longserve.cache.state_slots import NoStateSlots, StateSlots
from longserve.request import Request

# A state mark ends a chunk early where the chunk cannot save the state inside itself (IN_STEP_SAVES, below), so
# such a prompt takes one more step (a few tokens, a whole model pass) to save a state that a later hit resumes
# from. Below this many tokens the recompute a hit saves is about that step's cost (vLLM's align mode caches no
# hybrid prefix below its block of 528 tokens on Qwen3.5): no mark. An estimate, not yet measured on the GPU.
MIN_CHECKPOINT_TOKENS = 512
# A mark inside a chunk need not end it: the chunked delta rule holds a request's state between its chunks of 64
# tokens (counted from the request's first token of the step), and can save one of those states into a checkpoint as
# it runs (kernels/gated_delta_chunk.py `saves`; the conv's inputs before it are copied beside it). So the chunk
# runs through, and the checkpoint lands on the last such boundary before the mark that is also a page boundary:
# a later hit recomputes up to 63 tokens more, where the cut cost a whole step (a cold 8K prompt to the seed's model,
# GPTQ-int4 35B-A3B, 0.2016 s with its marks against 0.1892 s without any, on an H100: RESULTS.md forty-eighth
# session). With several marks inside a chunk (a prefix hit's few new tokens pass where the prompt leaves the cached
# path and its last full page), the state is saved for the deepest one the chunk can reach, not cut at the first:
# cut, a 64-token hit over the seed's 32K document took three steps (44.7-49.0 ms on an H100, fiftieth session's
# `hybrid-marks`; the hit restores the state at 32,704, its marks at 32,768 and 32,816), now one (not yet
# measured). False: every mark ends its chunk (the step after saves at the page). Read at each call.
IN_STEP_SAVES = True
STATE_SAVE_GRANULE = 64  # the chunked kernels' chunk (kernels/gated_delta_reference.py CHUNK)


class KVCacheManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool = True,
        num_state_slots: int = 0,
        num_state_checkpoints: int = 0,
        min_checkpoint_tokens: int = MIN_CHECKPOINT_TOKENS,
        track_interval: int = 256,
    ) -> None:
        """num_state_slots: a hybrid model's running requests' state slots (0: an attention-only model);
        num_state_checkpoints: its prefix cache's checkpoints, ids after the slots' (0: no prefix cache for it);
        min_checkpoint_tokens: the shortest prefix a checkpoint is saved for; track_interval: decode tokens
        between a decoding request's checkpoints (`track_target`; EngineConfig.mamba_track_interval)."""
        self.pool = PagePool(num_pages, page_size)
        self.min_checkpoint_tokens = min_checkpoint_tokens
        self.track_interval = track_interval
        self.states: StateSlots | NoStateSlots = (
            StateSlots(num_state_slots) if num_state_slots else NoStateSlots()
        )
        self.prefix_cache: PrefixCache = NoPrefixCache()
        if enable_prefix_caching and not self.states.holds_states:
            self.prefix_cache = RadixTree(self.pool)
        elif enable_prefix_caching and num_state_checkpoints:
            self.prefix_cache = StateRadixTree(self.pool, num_state_checkpoints, first_id=num_state_slots)

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def shares_prompts(self) -> bool:
        """Whether a request may start from pages another computed (a prefix hit, a forked sibling): with
        recurrent states only through a prefix cache that keeps their checkpoints."""
        return not self.states.holds_states or self.prefix_cache.keeps_states

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
        if self.prefix_cache.keeps_states:
            if match.checkpoint is not None:  # copied into the request's slot by its first step
                self.prefix_cache.pin(match.checkpoint)
                req.state_restore = match.checkpoint
            req.state_marks = self._state_marks(req, match.num_tokens, match.num_shared_tokens)
        return match.num_tokens

    def _state_marks(self, req: Request, hit: int, shared: int) -> tuple[int, ...]:
        """Where the request's chunks end and its state is checkpointed: where it leaves the cached path (so the
        next request down that path hits there: a document shared by several questions) and at the last full
        page a repeat of its prompt could match (a conversation's next turn, a retried or preempted request)."""
        ps = self.page_size
        last = min(req.max_prefix_len, req.num_prompt_tokens) // ps * ps
        low = max(hit, self.min_checkpoint_tokens - 1)
        return tuple(sorted({m for m in (shared, last) if low < m <= last}))

    def chunk_end(self, req: Request, n: int) -> int:
        """A prompt chunk of up to n tokens, cut to end on the request's next state mark if it would pass it,
        unless it saves the state inside itself for one of them (`in_step_save`) or (IN_STEP_SAVES) starts at a
        restored state."""
        if self.in_step_save(req, n) is not None:
            return n
        if IN_STEP_SAVES and req.state_restore is not None:
            # the chunk starts at the state a hit restores, within 64 tokens of every mark inside (none has an
            # in-step position): a later hit resumes from that state, 63 tokens back at most, in its one step;
            # a cut would cost this request a whole step now
            return n
        done = req.num_computed_tokens
        for mark in req.state_marks:
            if done < mark < done + n:
                return mark - done
        return n

    def in_step_save(self, req: Request, n: int) -> int | None:
        """Tokens into a chunk of n where it saves the request's state (IN_STEP_SAVES): for the deepest state mark
        inside it that has one, the last chunk boundary of the kernels before the mark, if a page boundary past
        min_checkpoint_tokens; None: no mark inside, or none with such a boundary (the chunk ends on the first)."""
        done, ps = req.num_computed_tokens, self.page_size
        if not IN_STEP_SAVES:
            return None
        for mark in reversed([m for m in req.state_marks if done < m < done + n]):
            at = (mark - done) // STATE_SAVE_GRANULE * STATE_SAVE_GRANULE
            if at and (done + at) % ps == 0 and done + at >= self.min_checkpoint_tokens:
                return at
        return None

    def checkpoint_target(self, req: Request, n: int) -> tuple[int, int | None] | None:
        """(checkpoint, tokens into the chunk: None at its end) for a state saved by the request's next n tokens:
        inside them for a mark they pass (`in_step_save`), else at their end if it is a state mark, or a page
        boundary before the last (a usual chunk's end: a copy, no extra step; a question over a document the
        first one computed then resumes at its last chunk inside the document); None: no save, or every
        checkpoint is pinned."""
        end, marks = req.num_computed_tokens + n, req.state_marks
        at = None if end in marks else self.in_step_save(req, n)  # a mark at the chunk's end: saved there
        if at is None and end not in marks and not (marks and end < marks[-1] and end % self.page_size == 0):
            return None
        if at is None and end < self.min_checkpoint_tokens:
            return None
        checkpoint = self.prefix_cache.take_checkpoint()
        return None if checkpoint is None else (checkpoint, at)

    def track_target(self, req: Request) -> int | None:
        """A checkpoint for a decoding request's state after its next token, every `track_interval` tokens on a
        page past min_checkpoint_tokens (SGLang's --mamba-track-interval): held until the request ends, when its
        generated pages join the cache (`release`), so a conversation's next turn resumes inside this answer; a
        newer one replaces it. None: not such a token, no prefix cache of states, every checkpoint pinned, or as
        many held by tracked states as they may hold (state_radix_tree.TRACK_SHARE)."""
        end = req.num_computed_tokens + 1
        if end % self.track_interval or end % self.page_size or end < self.min_checkpoint_tokens:
            return None
        if not self.prefix_cache.keeps_states or req.cache_node is None:
            return None
        return self.prefix_cache.take_checkpoint(track=True, replacing=req.state_tracked is not None)

    def state_saved(self, req: Request, checkpoint: int, tokens: int | None = None) -> None:
        """After the step that saves the request's state into `checkpoint` was advanced (its pages cached): the
        checkpoint joins the node ending at the `tokens` the state covers (None: the request's computed tokens)
        on the request's cached path, split there if need be; a decode step's waits for the request's end
        (`track_target`); dropped if the request ended meanwhile."""
        node, ps = req.cache_node, self.page_size
        covers = req.num_computed_tokens if tokens is None else tokens
        if node is not None and covers == req.num_tree_pages * ps == req.num_computed_tokens:
            self.prefix_cache.attach_checkpoint(node, checkpoint)
        elif node is not None and 0 < covers <= req.num_tree_pages * ps and covers % ps == 0:
            # the request's pages up to there are the tree's (cache_computed) and locked: the walk adopts none
            inner = self.prefix_cache.insert(req.token_array(0, covers), req.page_ids[: covers // ps]).node
            self.prefix_cache.attach_checkpoint(inner, checkpoint)
        elif node is not None and covers > req.num_prompt_tokens and covers % ps == 0:  # a decode step's
            if req.state_tracked is not None:
                self.prefix_cache.drop_checkpoint(req.state_tracked[0])
            req.state_tracked = (checkpoint, covers)
        else:
            self.prefix_cache.drop_checkpoint(checkpoint)

    def state_restored(self, req: Request) -> None:
        """The step copying the request's matched checkpoint into its slot was launched: the checkpoint may go."""
        if req.state_restore is not None:
            self.prefix_cache.unpin(req.state_restore)
            req.state_restore = None

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
        if req.state_tracked is not None:  # a decode step's checkpoint: its pages are the tree's now (cached)
            checkpoint, covers = req.state_tracked
            req.state_tracked = None
            if cache and req.cache_node is not None and covers <= req.num_tree_pages * self.page_size:
                self.state_saved(req, checkpoint, covers)
            else:
                self.prefix_cache.drop_checkpoint(checkpoint)
        if req.cache_node is not None:
            self.prefix_cache.unlock(req.cache_node)
            req.cache_node = None
        self.pool.decref(req.page_ids)
        req.page_ids = []
        req.num_tree_pages = 0
        self.state_restored(req)  # a restore not launched (its allocation failed): the pin goes
        req.state_marks = ()
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
