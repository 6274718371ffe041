"""The runner's grammar mask: rows with a grammar are filled (one by one, or on xgrammar's threads for a large
batch: the same bits), rows without one are never touched, a matcher that raises is reported alone; the
sampler applies the mask after the raw logprobs (which stay the model's) and before everything else."""

from __future__ import annotations

import pytest
import torch

from longserve.request import Request
from longserve.runner import grammar_mask
from longserve.runner.grammar_mask import GrammarMasker
from longserve.runner.sampler import Sampler, SamplingInfo
from longserve.sampling_params import SamplingParams
from longserve.structured.grammar import GrammarCompiler, GrammarMatcher, TokenBitmask, apply_token_bitmask
from longserve.structured.spec import GrammarSpec
from tests.fixtures.tool_tokenizer import make_tokenizer

VOCAB_PAD = 30  # lm_head rows past the tokenizer's: never allowed under a grammar


@pytest.fixture(scope="module")
def compiler():
    tok = make_tokenizer(eos="<|im_end|>")
    return GrammarCompiler(tok, vocab_size=len(tok) + VOCAB_PAD, stop_token_ids=[tok.eos_token_id])


def batch(compiler, n: int, constrained: set[int], params: SamplingParams | None = None) -> list[Request]:
    compiled = compiler.compile(
        GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "string"}}})
    )
    starts = ["", '{"a": "x', '{"a": "x"', "{"]
    reqs = []
    for i in range(n):
        req = Request(f"r{i}", [1, 2, 3], params or SamplingParams(temperature=0.0))
        if i in constrained:
            req.grammar = GrammarMatcher(compiled)
            assert req.grammar._m.accept_string(starts[i % len(starts)])
        reqs.append(req)
    return reqs


class Broken:
    def fill_bitmask(self, bitmask, row):
        raise RuntimeError("broken")


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_with_a_grammar_are_filled_alike_either_way(compiler, monkeypatch, threads):
    monkeypatch.setattr(grammar_mask, "FILL_THREADS", threads)
    n = grammar_mask.BATCH_FILL_MIN_ROWS + 5
    constrained = {i for i in range(n) if i % 4 != 3}
    reqs = batch(compiler, n, constrained)
    masker = GrammarMasker(max_rows=4, vocab_size=compiler.vocab_size, device=torch.device("cpu"))
    mask, failed = masker.prepare(reqs)  # more rows than max_rows: the buffers grow
    assert not failed and set(mask.rows) == constrained and mask.bitmask.shape[0] == n
    for i in constrained:  # the bits are exactly what the matcher allows next
        logits = torch.zeros(1, compiler.vocab_size)
        mask.row(i).apply(logits)
        allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
        assert allowed and max(allowed) < compiler.vocab_size - VOCAB_PAD
        assert all(reqs[i].grammar.fork().accept_token(t) for t in allowed[:50])
    assert mask.row(3) is None and masker.prepare(batch(compiler, 3, set())) == (None, {})


@pytest.mark.parametrize("threads", [1, 2])
def test_a_matcher_that_raises_is_reported_alone(compiler, monkeypatch, threads):
    monkeypatch.setattr(grammar_mask, "FILL_THREADS", threads)
    n = grammar_mask.BATCH_FILL_MIN_ROWS + 2
    reqs = batch(compiler, n, set(range(n)))
    reqs[4].grammar = Broken()
    mask, failed = GrammarMasker(n, compiler.vocab_size, torch.device("cpu")).prepare(reqs)
    assert list(failed) == [4] and set(mask.rows) == set(range(n)) - {4}


def test_the_sampler_masks_after_the_raw_logprobs(compiler):
    n = 6
    constrained = {0, 2, 3, 5}
    reqs = batch(compiler, n, constrained, SamplingParams(temperature=0.0, logprobs=2))
    logits = torch.randn(n, compiler.vocab_size, generator=torch.Generator().manual_seed(0))
    infos = [SamplingInfo(r.sampling_params, r.prompt_token_ids, r.output_token_ids, None) for r in reqs]
    mask, _ = GrammarMasker(n, compiler.vocab_size, torch.device("cpu")).prepare(reqs)
    given = logits.clone()
    out = Sampler()(logits, infos, token_mask=mask)
    free = Sampler()(logits, infos)
    assert torch.equal(logits, given)  # the caller's logits are not modified
    raw = torch.log_softmax(logits, dim=-1)
    for i in range(n):
        t = int(out.token_ids[i])
        assert out.logprobs[i] == pytest.approx(float(raw[i, t]))  # the model's own logprob
        if i in constrained:
            assert reqs[i].grammar.fork().accept_token(t)
        else:
            assert t == int(free.token_ids[i])  # untouched rows sample as without a mask
    assert torch.equal(out.top_logprobs, free.top_logprobs)


def allowed_ids(matcher, vocab: int) -> list[int]:
    logits = torch.zeros(1, vocab)
    bitmask = TokenBitmask(1, vocab)
    bitmask.fill({0: matcher})
    apply_token_bitmask(logits, bitmask.host, [0])
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_a_deferred_token_is_applied_before_every_read(compiler):
    """defer_accept (the engine's, after sampling) leaves the matcher where accept_token would: the next fill,
    is_completed and fork see the token; a stop token after a complete match terminates at once, as accepting
    it does, and defer_accept says so."""
    compiled = compiler.compile(GrammarSpec.regex("[0-9]{2}"))
    now, later = GrammarMatcher(compiled), GrammarMatcher(compiled)
    digit = next(t for t in allowed_ids(now, compiler.vocab_size) if t not in now._stops)
    for _ in range(2):
        assert now.accept_token(digit)
        assert later.defer_accept(digit) is False and later._pending == digit
        assert allowed_ids(later, compiler.vocab_size) == allowed_ids(now, compiler.vocab_size)
        assert later._pending is None
    assert later.is_completed and now.is_completed and not later.is_terminated
    stop = next(iter(later._stops))
    twin = later.fork()
    assert later.defer_accept(stop) is True and later.is_terminated
    assert twin.accept_token(stop) and twin.is_terminated


@pytest.mark.parametrize("threads", [1, 2])
def test_a_refused_deferred_token_fails_its_request_alone(compiler, monkeypatch, threads):
    """A token a grammar refuses (a bug: sampled without its mask) surfaces at the next fill, for that row
    only; the batch's other deferred tokens are applied and their rows filled."""
    monkeypatch.setattr(grammar_mask, "FILL_THREADS", threads)
    n = grammar_mask.BATCH_FILL_MIN_ROWS + 2
    reqs = batch(compiler, n, set(range(n)))
    expected = []
    for i, req in enumerate(reqs):
        twin = req.grammar.fork()
        token = allowed_ids(twin, compiler.vocab_size)[0]
        if i != 4:
            req.grammar.defer_accept(token)
            twin.accept_token(token)
        expected.append(twin)
    refused = next(t for t in range(compiler.vocab_size) if not reqs[4].grammar.fork().accept_token(t))
    reqs[4].grammar.defer_accept(refused)
    mask, failed = GrammarMasker(n, compiler.vocab_size, torch.device("cpu")).prepare(reqs)
    assert list(failed) == [4] and "refused token" in str(failed[4])
    assert set(mask.rows) == set(range(n)) - {4}
    for i in mask.rows:
        logits = torch.zeros(1, compiler.vocab_size)
        mask.row(i).apply(logits)
        assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == allowed_ids(
            expected[i], compiler.vocab_size
        )
