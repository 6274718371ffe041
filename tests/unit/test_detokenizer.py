"""TextAssembler: incremental text equals a full decode, stop strings cut the text, streaming holds back a
possible stop-string prefix and never hands out text it later takes back."""

from __future__ import annotations

import pytest

from longserve.testing.checkpoints import make_tiny_checkpoint
from longserve.tokenization.detokenizer import IncrementalDetokenizer, TextAssembler


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tiny_checkpoint(tmp_path_factory.mktemp("tok"), "llama"))


def feed(tok, text_in: str, stops: list[str]):
    prompt = tok.encode("A prompt:")
    ids = tok.encode(text_in, add_special_tokens=False)
    asm = TextAssembler(IncrementalDetokenizer(tok), prompt, stops, skip_special=True)
    deltas = []
    for n in range(1, len(ids) + 1):
        asm.add(ids[:n], final=n == len(ids))
        deltas.append(asm.delta(finished=asm.stop_hit is not None or n == len(ids)))
        if asm.stop_hit is not None:
            break
    return asm, deltas, ids


def test_incremental_text_equals_full_decode(tok):
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé wörks tóo ✓"
    asm, deltas, ids = feed(tok, text, [])
    assert asm.text == tok.decode(ids, skip_special_tokens=True) and "".join(deltas) == asm.text
    assert asm.stop_hit is None


def test_stop_string_cuts_text_and_is_never_streamed(tok):
    asm, deltas, ids = feed(tok, "alpha beta gamma STOP delta epsilon", ["STOP", "never"])
    assert asm.stop_hit == "STOP" and asm.text == "alpha beta gamma "
    assert "".join(deltas) == asm.text and not any("S" in d for d in deltas)
    assert asm.num_tokens_at_stop < len(ids)


def test_holdback_keeps_a_possible_prefix(tok):
    ids = tok.encode("one two thr", add_special_tokens=False)
    asm = TextAssembler(IncrementalDetokenizer(tok), [], ["three"], skip_special=True)
    asm.add(ids)
    assert asm.delta(finished=False) == asm.text[: len(asm.text) - 4]
    assert asm.delta(finished=True) == asm.text[len(asm.text) - 4 :]  # released once finished


def test_fast_decoder_equals_the_tokenizers_decode(tok):
    # the Rust backend called directly gives the text transformers' decode gives, special tokens kept or
    # skipped, on random ids (byte pieces, spaces, specials) as well as on encoded text
    import random

    from longserve.tokenization.detokenizer import make_decoder

    fast = make_decoder(tok)
    assert tok.backend_tokenizer is not None
    rng = random.Random(0)
    cases = [tok.encode("Hello  world, \u00e9t\u00e9 \u4f60\u597d!")] + [
        [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 12))] for _ in range(200)
    ]
    for ids in cases:
        for skip in (True, False):
            want = tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert fast(ids, skip) == want, (ids, skip)


def test_deferred_text_equals_the_eager_assembler(tok):
    # DeferredText replays the recorded adds on first read: its text and its deltas, read at any time (late,
    # out of order), are an eager TextAssembler's at the same point, byte-split characters included
    from longserve.tokenization.detokenizer import DeferredText

    prompt = tok.encode("A prompt:")
    ids = tok.encode("Ünïcödé wörks tóo ✓ and so does ascii text", add_special_tokens=False)
    eager = TextAssembler(IncrementalDetokenizer(tok), prompt, [], skip_special=True)
    deferred = DeferredText(TextAssembler(IncrementalDetokenizer(tok), prompt, [], skip_special=True), [])
    texts, deltas, spans = [], [], []
    for n in range(1, len(ids) + 1):
        deferred.output_ids.append(ids[n - 1])  # the request's list grows as the engine appends
        final = n == len(ids)
        eager.add(ids, final, end=n)
        deferred.add(n, final)
        texts.append(eager.text)
        deltas.append(eager.delta(finished=final))
        spans.append(deferred.mark())
    assert eager.text == tok.decode(ids, skip_special_tokens=True)
    for i in reversed(range(len(ids))):  # last first: earlier texts come from the recorded lengths
        assert deferred.text_at(spans[i][1]) == texts[i] and deferred.delta_of(spans[i]) == deltas[i]
    assert deferred.text == eager.text
