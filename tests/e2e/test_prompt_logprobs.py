"""Offline engine: prompt logprobs against transformers' log-softmax (fp32) over cached and uncached prompts,
chunked prefill, preemption and logprob_start_len; logit_bias; best_of against the same seeded candidates;
no_stop_trim. Every scenario ends with every KV page back in the pool."""

from __future__ import annotations

import pytest
import torch

from longserve import LLM, SamplingParams
from longserve.runner import prompt_logprobs
from longserve.testing.checkpoints import make_tiny_checkpoint

TOL = 2e-4  # fp32, two implementations of the same model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def hf_logsoftmax(ckpt):
    """prompt ids -> transformers' log-softmax [L, V] over the prompt (row p predicts token p + 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager")

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return run


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 500, (n,), generator=g).tolist()


def assert_matches_hf(out, ids, ref: torch.Tensor, start: int = 0, k: int = 0) -> None:
    """out's prompt logprobs (entries for positions start..L-1) equal the reference's."""
    assert out.prompt_logprob_start == start
    assert len(out.prompt_logprobs) == len(ids) - start
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
    expected = torch.tensor([ref[p - 1, ids[p]].item() for p in range(start + 1, len(ids))])
    got = torch.tensor(out.prompt_logprobs[1:])
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    for j, p in enumerate(range(start + 1, len(ids)), start=1):
        row, mine = ref[p - 1], ref[p - 1, ids[p]]
        # 1 + the tokens more likely than the prompt's own (a near-tie may fall either way)
        assert (
            int((row > mine + TOL).sum()) + 1
            <= out.prompt_logprob_ranks[j]
            <= int((row > mine - TOL).sum()) + 1
        )
        if k:
            values, top_ids = row.topk(k)
            got_ids = [t for t, _ in out.prompt_top_logprobs[j]]
            got_values = torch.tensor([v for _, v in out.prompt_top_logprobs[j]])
            torch.testing.assert_close(got_values, values, atol=TOL, rtol=0)
            assert got_ids == top_ids.tolist() or torch.allclose(got_values, values, atol=TOL)


def assert_clean(llm: LLM) -> None:
    engine = llm.engine
    engine.check_integrity()
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0
    engine.flush_cache()
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def make_llm(path, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("page_size", 16)
    return LLM(path, **kw)


def test_prompt_logprobs_cached_and_uncached_equal_transformers(ckpt, hf_logsoftmax):
    ids = prompt(90, seed=1)
    ref = hf_logsoftmax(ids)
    llm = make_llm(ckpt)
    warm = llm.generate([ids], SamplingParams(max_new_tokens=1, temperature=0))[0]  # caches the prompt
    assert warm.prompt_logprobs is None  # not asked
    params = SamplingParams(max_new_tokens=0, prompt_logprobs=3)
    cached = llm.generate([ids], params)[0]
    assert cached.cached_tokens == 0  # position 1's logprob needs row 0: the cache could supply nothing
    assert cached.token_ids == [] and cached.finish_reason == "length"
    assert_matches_hf(cached, ids, ref, k=3)
    llm.engine.flush_cache()
    uncached = llm.generate([ids], params)[0]
    assert uncached.prompt_logprobs == cached.prompt_logprobs  # bit for bit: the same computation
    assert uncached.prompt_top_logprobs == cached.prompt_top_logprobs
    # logprob_start_len inside a cached prefix: what lies before it comes from the cache, the rest is computed
    llm.generate([ids], SamplingParams(max_new_tokens=1, temperature=0))
    for start in (40, 41, -1):
        out = llm.generate(
            [ids], SamplingParams(max_new_tokens=2, prompt_logprobs=2, logprob_start_len=start)
        )[0]
        resolved = start % len(ids)
        assert 0 < out.cached_tokens <= resolved and out.cached_tokens % 16 == 0
        assert_matches_hf(out, ids, ref, start=resolved, k=2)
    assert llm.engine.stats().num_prefix_hit_tokens > 0
    assert_clean(llm)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_prompt_logprobs_chunked_prefill(ckpt, hf_logsoftmax, chunk, monkeypatch):
    """Each chunk computes its own rows; a chunk's last row predicts the next chunk's first token; the rows
    are projected to logits a few at a time (a 128K prompt never holds [128K, vocab] logits)."""
    monkeypatch.setattr(prompt_logprobs, "ROW_BUDGET", 3 * 512)  # 3 rows of the 512-token vocab per slice
    prompts = [prompt(70, seed=2), prompt(33, seed=3)]
    llm = make_llm(ckpt, max_prefill_chunk=chunk, chunked_prefill_size=max(chunk, 16))
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=3, prompt_logprobs=1, temperature=0))
    for ids, out in zip(prompts, outs):
        assert_matches_hf(out, ids, hf_logsoftmax(ids), k=1)
        assert len(out.token_ids) == 3
    assert_clean(llm)


def test_prompt_logprobs_survive_preemption(ckpt, hf_logsoftmax):
    """A pool too small for every request: preempted requests are recomputed, their logprobs not repeated."""
    prompts = [prompt(40, seed=10 + i) for i in range(3)]
    llm = make_llm(ckpt, max_total_tokens=112, chunked_prefill_size=32)
    params = SamplingParams(max_new_tokens=20, prompt_logprobs=0, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.engine.stats().num_preemptions > 0, "the scenario did not preempt: it would prove little"
    for ids, out in zip(prompts, outs):
        assert_matches_hf(out, ids, hf_logsoftmax(ids))
    assert_clean(llm)


def test_prompt_logprobs_of_n_siblings_and_bad_start(ckpt, hf_logsoftmax):
    ids = prompt(40, seed=4)
    llm = make_llm(ckpt)
    out = llm.generate([ids], SamplingParams(n=3, max_new_tokens=4, prompt_logprobs=0, seed=7))[0]
    assert len(out.outputs) == 3
    assert_matches_hf(out, ids, hf_logsoftmax(ids))
    with pytest.raises(ValueError, match="logprob_start_len=40 is outside the prompt of 40 tokens"):
        llm.generate([ids], SamplingParams(prompt_logprobs=0, logprob_start_len=40))
    assert_clean(llm)


def test_max_logprobs_caps_requests_and_minus_one_is_the_vocabulary(ckpt, hf_logsoftmax):
    """max_logprobs (--max-logprobs, vLLM's): 20 by default, a request asking more is refused before anything
    is queued; -1 lets a request ask for the whole vocabulary, whose logprobs then equal transformers' full
    log-softmax (what `bench accuracy` needs for an exact KL)."""
    ids = prompt(30, seed=8)
    llm = make_llm(ckpt)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"^{field} must be at most 20 \(max_logprobs"):
            llm.generate([ids], SamplingParams(max_new_tokens=1, **{field: 21}))
        assert not llm.engine.has_unfinished()
    assert_clean(llm)
    full = make_llm(ckpt, max_logprobs=-1)
    vocab = full.engine.runner.model.vocab_size
    assert full.engine.max_logprobs == vocab
    greedy = SamplingParams(max_new_tokens=1, temperature=0, logprobs=vocab, prompt_logprobs=vocab)
    out = full.generate([ids], greedy)[0]
    ref = hf_logsoftmax(ids)
    assert_matches_hf(out, ids, ref, k=vocab)
    top = out.outputs[0].top_logprobs[0]  # the generated token's: every token of the vocabulary
    assert len(top) == vocab and {t for t, _ in top} == set(range(vocab))
    torch.testing.assert_close(torch.tensor([lp for _, lp in sorted(top)]), ref[-1], atol=TOL, rtol=0)
    with pytest.raises(ValueError, match=rf"logprobs must be at most {vocab}"):
        full.generate([ids], SamplingParams(max_new_tokens=1, logprobs=vocab + 1))
    every = full.generate([ids], SamplingParams(max_new_tokens=1, temperature=0, logprobs=-1))[0]  # vLLM's -1
    again = every.outputs[0].top_logprobs[0]  # the prompt cached this time: equal within fp32 rounding
    assert len(again) == vocab
    torch.testing.assert_close(torch.tensor([lp for _, lp in sorted(again)]), ref[-1], atol=TOL, rtol=0)
    with pytest.raises(ValueError, match=rf"^logprobs must be at most 20 .* got {vocab}$"):
        llm.generate([ids], SamplingParams(max_new_tokens=1, logprobs=-1))
    assert_clean(full)


def test_logit_bias_forces_and_bans(ckpt):
    ids = prompt(20, seed=5)
    llm = make_llm(ckpt)
    greedy = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    base = llm.generate([ids], greedy)[0].token_ids
    forced = llm.generate([ids], greedy.clone(logit_bias={77: 100.0}))[0].token_ids
    assert forced == [77] * 6 and base != forced
    banned = llm.generate([ids], greedy.clone(logit_bias={base[0]: -100.0}))[0].token_ids
    assert banned[0] != base[0]
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 512\)"):
        llm.generate([ids], greedy.clone(logit_bias={512: 1.0}))
    with pytest.raises(ValueError, match=r"logit_bias values must be numbers in \[-100, 100\]"):
        SamplingParams(logit_bias={3: 150.0})
    assert_clean(llm)


def test_best_of_returns_the_best_seeded_candidates(ckpt):
    """best_of candidates are the seeded siblings of an n = best_of request: the returned ones are the n
    of highest cumulative logprob, best first."""
    ids = prompt(24, seed=6)
    llm = make_llm(ckpt)
    common = dict(max_new_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    all4 = llm.generate([ids], SamplingParams(n=4, logprobs=0, **common))[0].outputs
    sums = [sum(c.logprobs) for c in all4]
    ranked = sorted(range(4), key=lambda i: -sums[i])
    assert len({tuple(c.token_ids) for c in all4}) > 1, "identical candidates: the test would prove little"
    best = llm.generate([ids], SamplingParams(n=2, best_of=4, **common))[0]
    assert [c.token_ids for c in best.outputs] == [all4[i].token_ids for i in ranked[:2]]
    assert [c.index for c in best.outputs] == [0, 1]
    assert best.outputs[0].logprobs is None  # ranked by logprobs, not asked for them
    assert best.outputs[0].cumulative_logprob == pytest.approx(sums[ranked[0]], abs=1e-4)
    with pytest.raises(ValueError, match="best_of must be an integer >= n"):
        SamplingParams(n=3, best_of=2)
    assert_clean(llm)


def test_no_stop_trim_keeps_the_stop_string(ckpt):
    llm = make_llm(ckpt)
    ids = prompt(16, seed=8)
    full = llm.generate([ids], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0].text
    at = next(i for i in range(1, len(full) - 3) if full.index(full[i : i + 3]) == i)  # its first occurrence
    stop = full[at : at + 3]
    trimmed = llm.generate([ids], SamplingParams(max_new_tokens=12, temperature=0, stop=[stop]))[0]
    kept = llm.generate(
        [ids], SamplingParams(max_new_tokens=12, temperature=0, stop=[stop], no_stop_trim=True)
    )[0]
    assert trimmed.text == full[:at] and kept.text == full[: at + 3]
    assert kept.finish_reason == trimmed.finish_reason == "stop" and kept.outputs[0].stop_reason == stop
    assert_clean(llm)
