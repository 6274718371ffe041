"""Prefix caching for a hybrid model (Qwen3.5-MoE, tiny and random) through the LLM API on the CPU: a hit resumes
from a recurrent-state checkpoint (cache/state_radix_tree.py) and gives the tokens of the same prompt computed
from scratch (an engine with prefix caching off, itself equal to transformers); a repeated prompt, a document
shared by several questions (the third hits where the second left the first's path), a conversation's next turn,
n > 1 siblings, several at once over two slots, preemption and a checkpoint pool smaller than the prompts each
compute only what the hit leaves, and every page, slot and checkpoint comes back."""

from __future__ import annotations

import pytest
import torch

from longserve import LLM, SamplingParams
from longserve.cache import manager
from longserve.cache.manager import MIN_CHECKPOINT_TOKENS
from longserve.cache.prefix_cache import NoPrefixCache
from longserve.cache.state_radix_tree import StateRadixTree
from longserve.testing.checkpoints import make_tiny_checkpoint
from tests.e2e.test_engine import DEVICE, assert_clean, hf_greedy

PAGE = 16
DOC = MIN_CHECKPOINT_TOKENS + 48  # a page-aligned document past the checkpoint floor
# the sampled tokens' logprobs too: a few tokens after a hit from a wrong state can still pick the same tokens
# (the delta rule forgets fast in a random model), not with the same logprobs
GREEDY32 = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True, logprobs=0)


def same(got: list[tuple[list[int], list[float]]], expected: list[tuple[list[int], list[float]]]) -> bool:
    """Equal tokens, and logprobs equal up to float32 rounding: chunks of 48 against 256 differ by up to 1.2e-4
    here, a hit restoring no state (the slot's stale one) by 0.06 to 1.4."""
    return len(got) == len(expected) and all(
        g[0] == e[0] and torch.allclose(torch.tensor(g[1]), torch.tensor(e[1]), atol=1e-3, rtol=0)
        for g, e in zip(got, expected)
    )


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(10, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    # prompts past the checkpoint floor: a longer context than the default 512
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen3_5_moe"), "qwen3_5_moe", seed=7, max_position_embeddings=4096
    )


def llm(path, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", DEVICE)
    kw.setdefault("max_total_tokens", 8192)
    kw.setdefault("page_size", PAGE)
    kw.setdefault("chunked_prefill_size", 256)
    return LLM(path, **kw)


@pytest.fixture(scope="module")
def plain(path):
    """Prefix caching off: every prompt computed from scratch."""
    m = llm(path, enable_prefix_caching=False)
    assert isinstance(m.engine.kv.prefix_cache, NoPrefixCache) and m.engine.runner.num_state_checkpoints == 0

    def run(ps, params=GREEDY32):
        out = [(c.token_ids, c.logprobs) for o in m.generate(ps, params) for c in o.outputs]
        assert_clean(m.engine)
        return out

    return run


def generate(m: LLM, ps: list[list[int]], params=GREEDY32):
    """(tokens, logprobs) of each completion, cached prompt tokens of each prompt, and tokens computed."""
    before = m.engine.runner.num_tokens_computed
    outs = m.generate(ps, params)
    m.engine.check_integrity()
    computed = m.engine.runner.num_tokens_computed - before
    return (
        [(c.token_ids, c.logprobs) for o in outs for c in o.outputs],
        [o.cached_tokens for o in outs],
        computed,
    )


def clean(m: LLM) -> None:
    assert_clean(m.engine)
    kv = m.engine.kv
    assert kv.states.num_free == kv.states.num_total
    assert getattr(kv.prefix_cache, "num_attached_checkpoints", 0) == 0  # flushed with their nodes


@pytest.mark.parametrize("in_step", [True, False])
def test_repeated_prompt_resumes_from_its_checkpoint(path, plain, monkeypatch, in_step):
    monkeypatch.setattr(manager, "IN_STEP_SAVES", in_step)
    p = ids(DOC + 37, seed=1)  # 597 tokens: chunks of 256 from 0, 256, 512
    expected = plain([p])
    assert expected[0][0] == hf_greedy(path, p, 32)
    m = llm(path)
    assert isinstance(m.engine.kv.prefix_cache, StateRadixTree)
    assert m.engine.runner.num_state_checkpoints == m.engine.kv.states.num_total > 0
    passes = m.engine.runner.num_forward_passes
    first, cached, computed = generate(m, [p])
    assert same(first, expected) and cached == [0] and computed == len(p) + 31
    mark = (len(p) - 1) // PAGE * PAGE  # the prompt's last full page (one token must be computed): 592
    # in the step: the last chunk (from 512) runs through and the kernels save the state before its second chunk
    # of 64, at 576; else the chunk ends at the mark and a step of 5 tokens follows
    hit = 512 + (mark - 512) // 64 * 64 if in_step else mark
    assert m.engine.runner.num_forward_passes - passes == 3 + (not in_step) + 31
    again, cached, computed = generate(m, [p])
    assert same(again, expected) and cached == [hit] and computed == len(p) - hit + 31
    clean(m)


def test_a_checkpoint_saved_inside_a_step_holds_the_prefix_state(path):
    """The checkpoint the last chunk of a 597-token prompt saves inside itself (at 576: two chunks of 64 into the
    chunk from 512) holds, in every linear-attention layer, the conv inputs and delta-rule state that a prompt of
    exactly those 576 tokens leaves in its slot (computed alone, no prefix cache, one token sampled: no decode step
    after it)."""
    p = ids(DOC + 37, seed=1)
    m = llm(path)
    generate(m, [p], SamplingParams(max_new_tokens=1, temperature=0.0))
    depth = checkpoint_depths(m)
    # the usual chunk ending on a page past the floor, and the one inside the step
    assert sorted(depth) == [512, 576]
    assert_state_of_prefix(path, m, depth[576], p[:576], conv_atol=0)
    clean(m)


def checkpoint_depths(m: LLM) -> dict[int, int]:
    """{tokens before it: checkpoint row} of every checkpoint the engine's prefix cache holds."""
    tree, depth = m.engine.kv.prefix_cache, {}
    for c, node in tree._attached.items():
        n, cur = 0, node
        while cur is not tree.root:
            n, cur = n + len(cur.key), cur.parent
        depth[n] = c
    return depth


def assert_state_of_prefix(path, m: LLM, row: int, prefix: list[int], conv_atol: float) -> None:
    """State row `row` of m holds, in every linear-attention layer, the conv inputs and delta-rule state a prompt
    of exactly `prefix` leaves in its slot (computed alone, no prefix cache, one token sampled: no decode step
    after it)."""
    alone = llm(path, enable_prefix_caching=False, max_num_seqs=1)
    alone.generate([prefix], SamplingParams(max_new_tokens=1, temperature=0.0))
    got, want = m.engine.runner.states, alone.engine.runner.states
    assert want.num_slots == 1 and len(got.conv) == len(want.conv) > 0
    for layer in range(len(got.conv)):
        torch.testing.assert_close(got.conv[layer][row], want.conv[layer][0], atol=conv_atol, rtol=0)
        torch.testing.assert_close(got.ssm[layer][row], want.ssm[layer][0], atol=1e-5, rtol=1e-5)


def test_document_shared_by_questions(path, plain):
    doc = ids(DOC, seed=2)
    qs = [doc + ids(21 + 5 * i, seed=10 + i) for i in range(4)]
    expected = plain(qs)
    m = llm(path, chunked_prefill_size=48)  # the junction falls inside a chunk
    got, cached = [], []
    for q in qs:
        t, c, _ = generate(m, [q])
        got += t
        cached += c
    # each resumes where the first's last chunk inside the document ended (chunks of 48 end on pages: each saved
    # its state); the junction 32 tokens on is within the kernels' first 64 of the chunk that starts at that
    # state: not cut for (a step saved; a later question recomputes those 32 tokens in its one step)
    assert same(got, expected) and cached == [0] + [DOC // 48 * 48] * 3
    clean(m)


def test_next_turn_resumes_after_the_last_turns_prompt(path, plain):
    turn1 = ids(DOC + 9, seed=3)
    m = llm(path)
    (answer,), _, _ = generate(m, [turn1])
    generate(m, [ids(DOC, seed=8)])  # someone else's request between the turns: slot 0 holds its state now
    turn2 = turn1 + answer[0] + ids(12, seed=4)
    got, (cached,), computed = generate(m, [turn2])
    hit = (len(turn1) - 1) // PAGE * PAGE
    assert same(got, plain([turn2])) and cached == hit and computed == len(turn2) - hit + 31
    clean(m)


@pytest.mark.parametrize("interval", [64, 256])
def test_next_turn_resumes_inside_the_last_answer(path, plain, interval):
    """--mamba-track-interval: a decoding request's state is checkpointed every `interval` tokens (on a page),
    held until it ends, then attached where its generated pages join the cache: the next turn resumes at the last
    one inside the answer (interval 64: 640 of 569 + 99 computed tokens), not at the last turn's prompt (256:
    none past 512 inside this answer), with the tokens and logprobs of the turn computed from scratch; a
    checkpoint replaced by a newer one is freed (the integrity check)."""
    turn1 = ids(DOC + 9, seed=3)
    m = llm(path, mamba_track_interval=interval)
    (answer,), _, _ = generate(
        m, [turn1], SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
    )
    computed = len(turn1) + 99  # the last sampled token is not computed
    # the last tracked state inside the answer, else the last turn's prompt's last full page
    tracked = computed // interval * interval
    hit = tracked if tracked > len(turn1) else (len(turn1) - 1) // PAGE * PAGE
    assert hit == (640 if interval == 64 else 560)
    if interval == 64:
        # the decode steps' checkpoint holds the state of its 640 tokens, as a prompt of them leaves it
        history = turn1 + answer[0]
        assert_state_of_prefix(path, m, checkpoint_depths(m)[640], history[:640], conv_atol=1e-4)
    turn2 = turn1 + answer[0] + ids(12, seed=4)
    got, (cached,), _ = generate(m, [turn2])
    assert same(got, plain([turn2])) and cached == hit
    clean(m)


def test_siblings_share_their_leaders_prompt(path, plain):
    p = ids(DOC + 20, seed=5)
    params = SamplingParams(n=3, max_new_tokens=32, temperature=0.0, ignore_eos=True, logprobs=0)
    expected = plain([p], params)
    m = llm(path)
    got, cached, computed = generate(m, [p], params)
    assert same(got, expected) and len(got) == 3
    hit = (len(p) - 1) // PAGE * PAGE  # the leader computes its prompt, its siblings resume from its state
    assert computed == len(p) + 2 * (len(p) - hit) + 3 * 31
    clean(m)


@pytest.mark.parametrize("chunk", [7, 256])
def test_many_at_once_over_two_slots(path, plain, chunk):
    doc = ids(DOC, seed=6)
    qs = [doc + ids(3 + 11 * i, seed=20 + i) for i in range(5)] + [doc + ids(3, seed=20)]  # the last repeats
    expected = plain(qs)
    m = llm(path, chunked_prefill_size=chunk, max_running_requests=2)
    got, cached, _ = generate(m, qs)
    assert same(got, expected) and m.engine.kv.states.num_total == 2
    assert max(cached) >= DOC  # the later ones hit what the first ones saved
    again, cached, _ = generate(m, qs)
    assert same(again, expected) and min(cached) >= DOC
    clean(m)


def test_preemption_and_a_small_checkpoint_pool(path, plain):
    ps = [ids(DOC + 7 * i, seed=30 + i) for i in range(3)]
    expected = plain(ps)
    # one slot and one checkpoint: each prompt's save recycles the one before it
    m = llm(path, max_running_requests=1)
    assert m.engine.runner.num_state_checkpoints == 1
    got, cached, _ = generate(m, ps)
    assert same(got, expected) and cached == [0, 0, 0]
    got, cached, _ = generate(m, [ps[2], ps[0]])  # the last one's state is kept, the first's was recycled
    assert same(got, [expected[2], expected[0]]) and cached[0] > 0 and cached[1] == 0
    clean(m)
    # a pool too small for three at once: preempted requests resume from the checkpoints their prompts left
    m = llm(path, max_total_tokens=2 * (DOC + 64), chunked_prefill_size=64)
    got, _, _ = generate(m, ps)
    assert same(got, expected) and m.engine.scheduler.num_preemptions > 0
    clean(m)


def test_mamba_cache_mode_none_keeps_no_state(path, plain):
    """vLLM's --mamba-cache-mode: none keeps no checkpoint (a repeat computes its whole prompt, the slots take all
    the states' memory); all (a state at every block) is refused by name."""
    p = ids(DOC + 5, seed=40)
    m = llm(path, mamba_cache_mode="none")
    assert isinstance(m.engine.kv.prefix_cache, NoPrefixCache) and m.engine.runner.num_state_checkpoints == 0
    generate(m, [p])
    again, cached, computed = generate(m, [p])
    assert same(again, plain([p])) and cached == [0] and computed == len(p) + 31
    clean(m)
    with pytest.raises(ValueError, match="mamba_cache_mode must be align or none"):
        llm(path, mamba_cache_mode="all")


def test_random_arrivals_aborts_and_preemption_keep_every_answer_and_state(path, plain):
    """Requests over three documents (some repeating a prompt) arrive between steps in a seeded random order, with
    random lengths to generate, three slots, a KV pool too small for them all (preemption) and chunks of 64; two
    are aborted mid-way. Every request that finishes gives the tokens and logprobs of its prompt computed alone
    without the cache, the integrity check (pages, slots, checkpoints) holds after every step, and everything
    comes back at the end."""
    import random

    rng = random.Random(5)
    docs = [ids(DOC + 16 * i, seed=50 + i) for i in range(3)]
    prompts_ = [rng.choice(docs) + ids(rng.randint(1, 40), seed=60 + i) for i in range(10)]
    prompts_ += [prompts_[1], prompts_[4]]  # repeats: they hit their own prompts' last pages
    lengths = [rng.randint(1, 24) for _ in prompts_]
    m = llm(path, max_running_requests=3, chunked_prefill_size=64, max_total_tokens=2 * DOC + 64)
    engine = m.engine
    order, done, aborted = list(range(len(prompts_))), {}, set()
    rng.shuffle(order)
    steps = 0
    while order or engine.has_unfinished():
        for _ in range(rng.randint(0, 2)):
            if order:
                i = order.pop()
                params = SamplingParams(
                    max_new_tokens=lengths[i], temperature=0.0, ignore_eos=True, logprobs=0
                )
                engine.add_request(prompts_[i], params, request_id=f"r{i}")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if steps in (6, 11) and engine.groups:  # the first in flight, whatever its state
            rid = sorted(engine.groups)[0]
            done[rid] = engine.abort(rid)
            aborted.add(rid)
        engine.check_integrity()
    assert engine.scheduler.num_preemptions > 0 and sum(o.cached_tokens for o in done.values()) > 0
    assert len(aborted) == 2 and {done[r].outputs[0].finish_reason for r in aborted} == {"abort"}
    for rid, out in done.items():
        i = int(rid[1:])
        if rid in aborted:
            continue
        params = SamplingParams(max_new_tokens=lengths[i], temperature=0.0, ignore_eos=True, logprobs=0)
        got = [(out.outputs[0].token_ids, out.outputs[0].logprobs)]
        assert same(got, plain([prompts_[i]], params)), rid
    assert set(done) == {f"r{i}" for i in range(len(prompts_))}  # every request ended (aborts with an output)
    clean(m)


def test_max_mamba_cache_size_caps_slots_and_checkpoints_together(path, plain, caplog):
    """SGLang's --max-mamba-cache-size: at most that many state rows, running slots and checkpoints together; a cap
    below twice --max-num-seqs halves the slots (the warning names the flag), and a prompt still hits."""
    import logging

    p = ids(DOC + 3, seed=70)
    with caplog.at_level(logging.WARNING, logger="longserve.runner"):
        m = llm(path, max_running_requests=4, max_mamba_cache_size=5)
    runner = m.engine.runner
    assert (runner.num_state_slots, runner.num_state_checkpoints, runner.states.conv[0].shape[0]) == (2, 3, 5)
    assert "2 recurrent-state slots" in caplog.text and "--max-mamba-cache-size" in caplog.text
    generate(m, [p])
    again, cached, _ = generate(m, [p])
    assert same(again, plain([p])) and cached == [(len(p) - 1) // PAGE * PAGE]
    clean(m)
    with pytest.raises(ValueError, match="max_mamba_cache_size must be an integer >= 1"):
        llm(path, max_mamba_cache_size=0)


def test_steps_through_the_static_pieces(path, plain):
    """The piecewise CUDA graphs' code path (runner/piecewise_graph.py, its static-buffer pieces run eagerly as on
    the CPU): a document's question, then two more at once (hits restoring its checkpoint, chunks of 48 beside
    decodes, decode batches), every step of 2 to 64 tokens padded up to a bucket of 16 or 64 rows: the tokens and
    logprobs of each prompt from scratch, as the linear attention ran over the real rows only."""
    from longserve.runner.piecewise_graph import PiecewiseGraphRunner

    doc = ids(DOC, seed=2)
    qs = [doc + ids(21 + 5 * i, seed=20 + i) for i in range(3)]
    expected = plain(qs)
    m = llm(path, chunked_prefill_size=48)
    runner = m.engine.runner
    pieces = PiecewiseGraphRunner(runner.model, runner.kv_cache, runner._graph_shape(), 64, sizes=(16, 64))
    pieces.eager = True
    runner.piecewise_graphs = pieces
    got, cached, _ = generate(m, qs[:1])
    more, more_cached, _ = generate(m, qs[1:])
    assert same(got + more, expected) and cached == [0]
    assert all(c >= MIN_CHECKPOINT_TOKENS for c in more_cached)  # both resumed from a state checkpoint
    assert pieces.num_runs > 40 and pieces.mixer_out is not None
    clean(m)


def test_long_answers_leave_a_cached_documents_checkpoint(path, plain):
    """Tracked decode states take at most half the checkpoints (state_radix_tree.TRACK_SHARE) and a newer one evicts
    none: four answers decoding at once past the checkpoint floor (track points at 512 and 576) beside a document
    cached before them, over 4 checkpoints, leave the document's; its next question resumes there with the tokens
    of the same prompt computed from scratch, and two of the answers' tracked states joined the cache."""
    doc = ids(DOC, seed=40)
    m = llm(path, mamba_track_interval=64, max_running_requests=4, max_mamba_cache_size=8)
    tree = m.engine.kv.prefix_cache
    assert tree.num_checkpoints == 4 and tree.max_tracks == 2
    # the document, its states saved after its chunk to 512 and at its last full page (DOC)
    generate(m, [doc + ids(5, seed=41)], SamplingParams(max_new_tokens=1))
    assert sorted(checkpoint_depths(m)) == [512, DOC]
    long_answers = SamplingParams(max_new_tokens=560, temperature=0.0, ignore_eos=True)
    generate(m, [ids(40, seed=50 + i) for i in range(4)], long_answers)  # prompts below the floor: no marks
    # two answers' tracked states beside the document's two, the other answers none: taken at 512 (the two free
    # checkpoints), not replaced at 576 (a newer tracked state takes a free checkpoint only, evicting none)
    assert sorted(checkpoint_depths(m)) == [512, DOC] and len(tree._attached) == 4
    question = doc + ids(7, seed=42)
    got, (cached,), _ = generate(m, [question])
    assert cached == DOC and same(got, plain([question]))
    clean(m)
