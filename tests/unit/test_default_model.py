"""The embedded default model (longserve/assets/default_model): it ships, is small, loads in the engine,
and writes English-looking, Python-docs-flavoured words rather than noise (random weights fail the same
check), and its tokenizer has a ChatML chat template."""

from __future__ import annotations

import builtins
import functools
import json
import os
import re

import pytest

from longserve import LLM, SamplingParams
from longserve.assets import default_model_path

PROMPTS = ["Return the", "The file"]
GREEDY20 = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
REQUIRED = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


@functools.cache
def known_words() -> frozenset[str]:
    """Lower-case words of text the model was trained on: pydoc's topic pages and builtins' docstrings."""
    texts = [getattr(obj, "__doc__", None) or "" for obj in vars(builtins).values()]
    texts += [m.__doc__ or "" for t in (str, list, dict, bytes) for m in vars(t).values()]
    try:
        from pydoc_data.topics import topics

        texts += topics.values()
    except ImportError:  # some distributions strip pydoc_data
        pass
    return frozenset(re.findall(r"[a-z]+", "\n".join(texts).lower()))


def real_word_fraction(text: str) -> float:
    """Share of the whitespace-separated words (those with a letter) made only of known words; dotted or
    snake_case names count when every part is known (os.path.join, max_length)."""
    words = known_words()
    pieces = [p for p in text.split() if re.search(r"[A-Za-z]", p)]
    if not pieces:
        return 0.0
    real = sum(all(w in words for w in re.findall(r"[a-z]+", p.lower())) for p in pieces)
    return real / len(pieces)


def distinct_words(text: str) -> int:
    return len({w.lower() for w in re.findall(r"[A-Za-z]+", text)})


def plausible(text: str) -> bool:
    """Mostly known words, and not one word over and over (a degenerate model repeats a single token)."""
    return real_word_fraction(text) >= 0.6 and distinct_words(text) >= 5


@pytest.fixture(scope="module")
def llm():
    return LLM(default_model_path(), device="cpu", dtype="float32", max_total_tokens=1024)


def test_assets_exist_and_are_small():
    path = default_model_path()
    for name in REQUIRED:
        assert os.path.isfile(os.path.join(path, name)), name
    total = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert 1e6 < total <= 8e6, f"default model is {total / 1e6:.2f} MB"
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    with open(os.path.join(path, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"]


def test_greedy_text_is_words(llm):
    outs = llm.generate(PROMPTS, GREEDY20)
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.outputs[0].token_ids) == 20
        text = out.outputs[0].text
        frac = real_word_fraction(text)
        assert frac >= 0.6, f"{prompt!r} -> {text!r}: only {frac:.0%} real words"
        assert plausible(text), f"{prompt!r} -> {text!r}: {distinct_words(text)} distinct words"


def test_random_weights_fail_the_word_check():
    """The check above means something: the same architecture with random weights (two seeds) writes
    noise or repeats one token."""
    for seed in (0, 1):
        dummy = LLM(
            default_model_path(), device="cpu", dtype="float32", max_total_tokens=1024, load_format="dummy",
            seed=seed,
        )  # fmt: skip
        for out in dummy.generate(PROMPTS, GREEDY20):
            assert not plausible(out.outputs[0].text), out.outputs[0].text


def test_chat_template(llm):
    tok = llm.tokenizer
    assert tok.chat_template
    messages = [{"role": "user", "content": "What does `os.path.join` do?"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|begin_of_text|><|im_start|>user\nWhat does `os.path.join` do?<|im_end|>\n<|im_start|>assistant\n"
    )
    out = llm.chat(messages, SamplingParams(max_new_tokens=40, temperature=0.0))[0].outputs[0]
    assert out.text.strip() and real_word_fraction(out.text) >= 0.6, out.text
