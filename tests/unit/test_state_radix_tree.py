"""A hybrid model's prefix cache (cache/state_radix_tree.py) and the KV manager's side of it: a match stops at the
deepest node holding a state checkpoint (its pages past it are left alone); the chunks end on the request's state
marks (the prompt's last full page, the point where it leaves the cached path), saved into checkpoints attached to
the nodes ending there; checkpoints are recycled least recently used first but never while a restore is queued;
a node evicted with its pages frees its checkpoint; the integrity check catches a lost or doubly held checkpoint."""

from __future__ import annotations

import pytest

from longserve.cache import manager
from longserve.cache.manager import KVCacheManager
from longserve.cache.page_pool import PagePool
from longserve.cache.prefix_cache import NoPrefixCache
from longserve.cache.state_radix_tree import StateRadixTree
from longserve.kernels.gated_delta_reference import CHUNK
from longserve.request import Request
from longserve.sampling_params import SamplingParams

PS = 4


def tree(num_pages: int = 32, num_checkpoints: int = 2, first_id: int = 3) -> tuple[PagePool, StateRadixTree]:
    pool = PagePool(num_pages, PS)
    return pool, StateRadixTree(pool, num_checkpoints, first_id=first_id)


def insert(pool: PagePool, t: StateRadixTree, tokens: list[int], checkpoint: bool = True):
    """A finished request's pages cached, with the state after its last token saved (when `checkpoint`)."""
    pages = pool.alloc(len(tokens) // PS)
    res = t.insert(tokens, pages)
    pool.decref(pages)
    if checkpoint:
        c = t.take_checkpoint()
        assert c is not None and t.attach_checkpoint(res.node, c)
    t.check()
    return res


def test_match_stops_at_the_deepest_checkpoint():
    pool, t = tree()
    doc = list(range(100, 116))  # four pages
    a = insert(pool, t, doc[:8])  # checkpoint after 8 tokens
    insert(pool, t, doc, checkpoint=False)  # pages to 16, no state there
    m = t.match_prefix(doc + [1, 2, 3])
    assert (m.num_tokens, m.num_shared_tokens, m.checkpoint) == (8, 16, 3)
    assert m.node is a.node and m.pages == a.pages
    assert t.peek_prefix_len(doc + [1, 2, 3]) == 8
    assert t.match_prefix(doc, limit=7).num_tokens == 0  # the checkpoint lies past the limit
    assert t.peek_prefix_len(doc, limit=7) == 0
    miss = t.match_prefix([9] * 16)
    assert (miss.num_tokens, miss.checkpoint, miss.num_shared_tokens, miss.node) == (0, None, 0, t.root)
    t.check()


def test_split_keeps_the_checkpoint_at_the_nodes_end():
    pool, t = tree()
    whole = insert(pool, t, list(range(16)))
    # a second path leaving after 8 tokens splits the node; the checkpoint still ends at 16
    insert(pool, t, list(range(8)) + [50] * 8, checkpoint=False)
    assert whole.node.checkpoint == 3 and len(whole.node.key) == 8 and not whole.node.detached
    assert t.match_prefix(list(range(16)) + [7]).num_tokens == 16
    assert t.match_prefix(list(range(8)) + [50] * 9).num_tokens == 0  # no state after 8 or on the other path
    t.check()


def test_checkpoints_recycled_least_recently_used_never_pinned():
    pool, t = tree(num_checkpoints=2)
    a = insert(pool, t, [1] * 8)
    b = insert(pool, t, [2] * 8)
    assert (a.node.checkpoint, b.node.checkpoint, t.take_checkpoint()) == (
        3,
        4,
        3,
    )  # a's: least recently used
    assert a.node.checkpoint is None and t.match_prefix([1] * 9).num_tokens == 0  # its pages stay, no state
    t.drop_checkpoint(3)
    t.match_prefix([2] * 9)  # b is used now
    t.pin(4)
    c = t.take_checkpoint()
    assert c == 3 and t.take_checkpoint() is None  # 3 in flight, 4 pinned
    t.unpin(4)
    assert t.take_checkpoint() == 4 and b.node.checkpoint is None
    with pytest.raises(AssertionError, match="which no node holds"):
        t.pin(4)
    t.drop_checkpoint(4)
    assert t.attach_checkpoint(a.node, c) and a.node.checkpoint == 3
    c2 = t.take_checkpoint()
    assert not t.attach_checkpoint(a.node, c2)  # a state there already: the second is dropped
    assert t.num_attached_checkpoints == 1
    t.check()


def test_eviction_frees_the_nodes_checkpoint():
    pool, t = tree(num_pages=4, num_checkpoints=1)
    a = insert(pool, t, [1] * 16)
    assert pool.num_free == 0 and t.num_attached_checkpoints == 1
    assert t.evict(4) == 4 and a.node.detached and a.node.checkpoint is None
    assert t.take_checkpoint() == 3  # free again, nothing to recycle
    t.drop_checkpoint(3)
    t.check()


def test_check_catches_a_lost_checkpoint():
    pool, t = tree()
    a = insert(pool, t, [1] * 8)
    a.node.checkpoint = None  # lost by a bug
    with pytest.raises(AssertionError, match="differ"):
        t.check()


def req(rid: str, tokens: list[int], max_new: int = 4) -> Request:
    return Request(
        request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_new_tokens=max_new)
    )


def depths(t: StateRadixTree) -> dict[int, int]:
    """Each attached checkpoint's node: the tokens from the root to its end."""
    out = {}
    for c, node in t._attached.items():
        n, cur = 0, node
        while cur is not t.root:
            n += len(cur.key)
            cur = cur.parent
        out[c] = n
    return out


def run_prompt(kv: KVCacheManager, r: Request, chunk: int) -> list[int]:
    """What the scheduler does with a prompt: match, then chunk by chunk; returns the chunks' sizes."""
    kv.match_prefix(r)
    return run_chunks(kv, r, chunk)


def run_chunks(kv: KVCacheManager, r: Request, chunk: int) -> list[int]:
    """The rest of an admitted prompt in chunks of up to `chunk`, cut on its marks, saved where they say."""
    sizes = []
    while r.num_computed_tokens < r.num_prompt_tokens:
        n = kv.chunk_end(r, min(chunk, r.num_prompt_tokens - r.num_computed_tokens))
        assert kv.allocate(r, n)
        save = kv.checkpoint_target(r, n)
        r.num_computed_tokens += n
        kv.state_restored(r)
        kv.cache_computed(r)
        if save is not None:  # (checkpoint, tokens into the chunk or None: its end), as Scheduler.advance
            checkpoint, at = save
            kv.state_saved(r, checkpoint, None if at is None else r.num_computed_tokens - n + at)
        sizes.append(n)
    return sizes


def decode_step(kv: KVCacheManager, r: Request, token: int = 1) -> int | None:
    """One decode step of r, as the scheduler and runner do it: its token appended, a page if needed, the tracked
    state's checkpoint taken (`track_target`) and, once the step is advanced, saved. Returns the checkpoint."""
    r.output_token_ids.append(token)
    assert kv.allocate(r, 1)
    save = kv.track_target(r)
    r.num_computed_tokens += 1
    if save is not None:
        kv.state_saved(r, save)
    return save


def test_manager_marks_cut_the_chunks_and_hits_resume_there(monkeypatch):
    """Every mark cuts its chunk (IN_STEP_SAVES off: at this scale, pages of 4 tokens, every mark lies within the
    kernels' first 64 tokens of its chunk; with it on, see test_a_mark_inside_a_chunk_saves_there_without_a_cut)."""
    monkeypatch.setattr(manager, "IN_STEP_SAVES", False)
    kv = KVCacheManager(64, PS, num_state_slots=2, num_state_checkpoints=3, min_checkpoint_tokens=8)
    assert isinstance(kv.prefix_cache, StateRadixTree) and kv.shares_prompts and not kv.siblings_fork
    tree = kv.prefix_cache
    doc = list(range(1000, 1030))  # 30 tokens: seven pages and two tokens
    a = req("a", doc + [1, 2, 3])  # 33 tokens: its last full page ends at 32
    assert run_prompt(kv, a, chunk=12) == [12, 12, 8, 1] and a.state_marks == (32,)
    # saved after 12 and 24 (usual chunks ending on a page: no cut) and 32 (the mark), checkpoints 2, 3, 4
    kv.release(a)
    assert depths(tree) == {2: 12, 3: 24, 4: 32}
    b = req("b", doc + [7, 8, 9, 10, 11])  # leaves a's path after 28 tokens (a page boundary below 30)
    assert kv.peek_prefix_len(b) == 24
    assert kv.match_prefix(b) == 24 and b.state_restore == 3 and b.state_marks == (28, 32)
    # cut at the junction (28) and its last page (32)
    assert run_chunks(kv, b, chunk=12) == [4, 4, 3] and b.state_restore is None and not tree._pins
    kv.check_integrity([b])
    kv.release(b)
    # three checkpoints for five states: b's saves took the least recently used, a's end (32 on a's path: b's
    # match stamped the path it shares), then the lowest id of the three its match stamped (after 12 tokens)
    assert depths(tree) == {2: 32, 3: 24, 4: 28}
    c = req("c", doc + [20, 21, 22])
    assert kv.peek_prefix_len(c) == 28
    assert kv.match_prefix(c) == 28 and c.state_restore is not None and c.state_marks == (32,)
    assert tree._pins == {c.state_restore: 1}
    assert kv.allocate(c, 5) and c.state_slot is not None
    kv.check_integrity([c])
    kv.release(c, cache=False)  # its step never launched: the pin goes with it
    assert c.state_restore is None and not tree._pins and c.state_marks == ()
    kv.check_integrity([])


def test_manager_marks_respect_the_floor_and_the_limit():
    kv = KVCacheManager(64, PS, num_state_slots=1, num_state_checkpoints=1, min_checkpoint_tokens=20)
    short = req("s", list(range(18)))
    kv.match_prefix(short)
    assert short.state_marks == ()  # below the floor: no mark, no extra step
    kv.release(short)
    exact = req("e", list(range(24)))  # a whole number of pages: the last one a repeat could match ends at 20
    kv.match_prefix(exact)
    assert exact.state_marks == (20,)
    kv.release(exact)
    kv.check_integrity([])


def test_without_checkpoints_nothing_is_shared():
    kv = KVCacheManager(64, PS, enable_prefix_caching=True, num_state_slots=2, num_state_checkpoints=0)
    assert isinstance(kv.prefix_cache, NoPrefixCache) and not kv.shares_prompts
    off = KVCacheManager(64, PS, enable_prefix_caching=False, num_state_slots=2, num_state_checkpoints=2)
    assert isinstance(off.prefix_cache, NoPrefixCache)
    r = req("r", list(range(40)))
    off.match_prefix(r)
    assert r.state_marks == () and off.checkpoint_target(r, 40) is None


def test_a_mark_inside_a_chunk_saves_there_without_a_cut(monkeypatch):
    """A mark inside a chunk: the chunk runs through and saves the state on the kernels' last 64-token boundary
    before the mark (counted from the chunk's start) when that is a page; two marks inside: for the deepest that
    has one; no such page: the chunk ends on the first mark as before. IN_STEP_SAVES off: every mark cuts."""
    assert manager.STATE_SAVE_GRANULE == CHUNK  # the chunked kernels' chunk
    kv = KVCacheManager(256, PS, num_state_slots=2, num_state_checkpoints=4, min_checkpoint_tokens=8)
    tree = kv.prefix_cache
    doc = list(range(1000, 1150))
    a = req("a", doc)  # 150 tokens: its last full page ends at 148
    assert run_prompt(kv, a, chunk=256) == [150] and a.state_marks == (148,)
    kv.release(a)
    assert list(depths(tree).values()) == [128]  # two chunks of 64 into the step
    b = req("b", doc[:140] + [7, 8, 9])
    assert kv.match_prefix(b) == 128 and b.state_restore is not None
    kv.release(b, cache=False)
    c = req("c", doc[:100] + list(range(60)))  # leaves a's path at 100, below its checkpoint: no hit
    assert kv.match_prefix(c) == 0 and c.state_marks == (100, 156)
    # both marks inside one chunk: saved for the deeper (156: at 128), no cut
    assert run_chunks(kv, c, chunk=256) == [160]
    kv.release(c)
    assert sorted(depths(tree).values()) == [128, 128]  # a's, and c's on its own branch
    # a hit whose marks all lie within 64 tokens of the state it restores: no position inside, and no cut either
    e = req("e", doc[:140] + list(range(70, 90)))  # a's checkpoint at 128; marks at 140 (junction) and 156
    assert kv.match_prefix(e) == 128 and e.state_marks == (140, 156)
    assert run_chunks(kv, e, chunk=256) == [32]
    kv.release(e)
    d = req("d", list(range(2000, 2300)))  # 300 tokens in chunks from 0 and 230: 230 + 64 = 294 is no page
    assert run_prompt(kv, d, chunk=230) == [230, 66, 4] and d.state_marks == (296,)
    kv.release(d)
    monkeypatch.setattr(manager, "IN_STEP_SAVES", False)
    e = req("e", list(range(3000, 3150)))
    assert run_prompt(kv, e, chunk=256) == [148, 2]
    kv.release(e)
    kv.check_integrity([])


def test_a_hit_passing_two_marks_takes_one_step(monkeypatch):
    """The seed's prefix hit at real scale (pages of 16, marks from 512 tokens, chunks of 8K): a cold 32K prompt's
    state is saved inside its last chunk at 32,704 (the kernels' last 64-token boundary before its mark at 32,752);
    the same 32K plus 64 new tokens resumes there and passes two marks (32,768, where it leaves the cached path,
    and 32,816, its last full page) in one step of 128 tokens, saving at 32,768 (three steps when each mark cut:
    44.7-49.0 ms on an H100); with IN_STEP_SAVES off it still cuts on each mark."""
    for in_step, cold_chunks, hit_chunks in (
        (True, [8192] * 4, [128]),
        (False, [8192] * 3 + [8176, 16], [16, 48, 16]),
    ):
        monkeypatch.setattr(manager, "IN_STEP_SAVES", in_step)
        kv = KVCacheManager(4096, 16, num_state_slots=2, num_state_checkpoints=8)
        cold = req("cold", list(range(1, 32769)))
        assert run_prompt(kv, cold, chunk=8192) == cold_chunks and cold.state_marks == (32752,)
        kv.release(cold)
        hit = req("hit", list(range(1, 32769)) + list(range(90000, 90064)))
        assert run_prompt(kv, hit, chunk=8192) == hit_chunks and hit.state_marks == (32768, 32816)
        kv.release(hit)
        if in_step:
            assert 32768 in depths(kv.prefix_cache).values()
        kv.check_integrity([])


def test_decode_checkpoints_wait_for_the_end_and_a_newer_one_replaces_the_older():
    """track_target: a decoding request's state every track_interval tokens on a page; the checkpoint waits in
    flight until the request ends (its generated pages are cached then) and joins the node at its depth; a newer
    one frees the older; an abort (no caching) frees it."""
    kv = KVCacheManager(
        64, PS, num_state_slots=2, num_state_checkpoints=3, min_checkpoint_tokens=8, track_interval=8
    )
    tree = kv.prefix_cache
    r = req("r", list(range(100, 110)))  # 10 tokens: its mark at 8 (the last full page below 10)
    assert run_prompt(kv, r, chunk=16) == [8, 2]

    saves = [decode_step(kv, r, t) for t in range(7)]  # computes tokens 10..16: a save after 16 only
    assert [s is not None for s in saves] == [False] * 5 + [True, False] and r.state_tracked == (saves[5], 16)
    more = [decode_step(kv, r, t) for t in range(7, 15)]  # 17..24: a save after 24, which replaces the first
    assert [s is not None for s in more] == [False] * 6 + [True, False]
    assert r.state_tracked == (more[6], 24) and saves[5] in tree._free
    kv.check_integrity([r])
    kv.release(r)  # its pages cached: the checkpoint joins the node ending after 24 tokens
    assert sorted(depths(tree).values()) == [8, 24]
    kv.check_integrity([])
    a = req("a", list(range(200, 210)))
    run_prompt(kv, a, chunk=16)
    a.output_token_ids.extend(range(7))
    assert kv.allocate(a, 7)
    a.num_computed_tokens = 15
    save = kv.track_target(a)
    a.num_computed_tokens += 1
    kv.state_saved(a, save)
    assert a.state_tracked == (save, 16)
    kv.release(a, cache=False)  # aborted: nothing cached, the checkpoint is free again
    assert save in tree._free and a.state_tracked is None
    kv.check_integrity([])


def test_decoding_requests_cannot_take_every_documents_checkpoint():
    """Tracked decode states hold at most TRACK_SHARE of the checkpoints (here 2 of 4): four long answers beside
    two cached documents leave both documents' checkpoints (their prefix hits) in place, the two answers past the
    share get no tracked state; a newer tracked state takes a free checkpoint only (none here: the older one
    stays); once a tracked answer ends (its state joins the cache) another may track again, within the share."""
    kv = KVCacheManager(
        256, PS, num_state_slots=6, num_state_checkpoints=4, min_checkpoint_tokens=8, track_interval=8
    )
    tree = kv.prefix_cache
    assert tree.max_tracks == 2
    docs = [req(f"d{i}", list(range(100 * (i + 1), 100 * (i + 1) + 10))) for i in range(2)]
    for d in docs:  # 10 tokens: a checkpoint at 8 each
        run_prompt(kv, d, chunk=16)
        kv.release(d)
    assert sorted(depths(tree).values()) == [8, 8]
    answers = [req(f"r{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 7)), max_new=32) for i in range(4)]
    for r in answers:  # 7 tokens: no mark of their own
        run_prompt(kv, r, chunk=16)

    saves = [decode_step(kv, r) for r in answers]  # each computes its 8th token: a track target
    assert [s is not None for s in saves] == [True, True, False, False]
    for d in docs:  # the documents' states are still there to hit
        assert kv.prefix_cache.match_prefix(d.prompt_token_ids + [5]).num_tokens == 8
    for _ in range(8):  # to 16: no free checkpoint for the newer states, none past the share
        saves = [decode_step(kv, r) for r in answers]
    assert saves == [None] * 4
    assert [None if r.state_tracked is None else r.state_tracked[1] for r in answers] == [8, 8, None, None]
    kv.check_integrity(answers)
    kv.release(answers[0])  # its tracked state joins the cache: a track is free again
    assert sorted(depths(tree).values()) == [8, 8, 8]
    for _ in range(
        8
    ):  # to 24: r2 tracks (evicting the least recently used attached state), r3 is past the share
        saves = [decode_step(kv, r) for r in answers[1:]]
    assert [s is not None for s in saves] == [False, True, False]
    kv.check_integrity(answers[1:])
    for r in answers[1:]:
        kv.release(r)
    kv.check_integrity([])
