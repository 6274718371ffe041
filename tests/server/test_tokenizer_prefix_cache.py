"""The server's tokenizer pool with its prefix token cache: a growing conversation's turns tokenize to exactly
transformers' ids (chat template and plain prompts, with and without specials) while re-using the previous
turn's tokens; --tokenizer-prefix-cache-size sets it, 0 turns it off; /tokenize over HTTP gives the same ids."""

from __future__ import annotations

import asyncio
import random

import pytest

from longserve.server.args import parse
from longserve.tokenization.pool import TokenizerPool
from longserve.tokenization.tokenizer import apply_chat_template, load_tokenizer

_SAMPLE = "the cat sat on a mat it's 1234567 tokens , . ! ? \n\n   é 漢字 🙂 <|im_start|> hello world"
WORDS = _SAMPLE.split(" ")  # with empty strings and a whitespace run


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice([" ", "", "  ", "\n"]) for _ in range(n))


def _conversation(rng: random.Random, turns: int) -> list[list[dict]]:
    """Each turn's message list: the history so far, an assistant reply, a new long user message."""
    messages = [{"role": "system", "content": _text(rng, 600)}, {"role": "user", "content": _text(rng, 800)}]
    out = [list(messages)]
    for _ in range(turns - 1):
        messages += [
            {"role": "assistant", "content": _text(rng, rng.randint(5, 200))},
            {"role": "user", "content": _text(rng, rng.randint(5, 600))},
        ]
        out.append(list(messages))
    return out


def test_growing_chat_and_prompts_tokenize_exactly_and_reuse_the_previous_turn(tiny_model) -> None:
    tok = load_tokenizer(tiny_model)
    pool = TokenizerPool(tiny_model, 2)
    assert pool.prefix_cache is not None and pool.prompts.chat_cached
    rng = random.Random(0)

    async def run() -> None:
        for turn, messages in enumerate(_conversation(rng, 6)):
            assert await pool.chat(messages) == apply_chat_template(tok, messages), turn
            prompt = "".join(m["content"] for m in messages)
            for specials in (True, False):
                expected = list(tok.encode(prompt, add_special_tokens=specials))
                assert await pool.encode(prompt, specials) == expected, (turn, specials)

    try:
        asyncio.run(run())
    finally:
        pool.shutdown()
    cache = pool.prefix_cache
    assert cache.hits >= 3 * 5  # every turn after the first: the chat and both prompt flavours
    assert cache.reused_tokens > 0 and cache.misses == 3


def test_size_zero_turns_the_cache_off(tiny_model) -> None:
    pool = TokenizerPool(tiny_model, 1, prefix_cache_size=0)
    try:
        assert pool.prefix_cache is None
        text = _text(random.Random(1), 1500)
        assert asyncio.run(pool.encode(text)) == list(load_tokenizer(tiny_model).encode(text))
    finally:
        pool.shutdown()


def test_flag(tiny_model) -> None:
    _, srv = parse(["--model-path", tiny_model, "--tokenizer-prefix-cache-size", "0"], environ={})
    assert srv.tokenizer_prefix_cache_size == 0
    _, srv = parse(["--model-path", tiny_model], environ={})
    assert srv.tokenizer_prefix_cache_size == 64
    with pytest.raises(ValueError, match="tokenizer_prefix_cache_size must be >= 0"):
        parse(["--model-path", tiny_model, "--tokenizer-prefix-cache-size", "-1"], environ={})


def test_tokenize_endpoint_over_a_growing_prompt(server, tiny_model) -> None:
    import httpx

    tok = load_tokenizer(tiny_model)
    rng = random.Random(2)
    prompt = _text(rng, 1200)
    for _ in range(4):
        r = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == list(tok.encode(prompt))
        prompt += _text(rng, 150)
