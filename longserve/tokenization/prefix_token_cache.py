"""Prefix token cache: tokenize a long prompt by re-using the tokens of a recent prompt it starts with.

A multi-turn chat or an agent re-sends its whole history every turn; the engine's radix cache skips the
history's prefill, but the server still has to tokenize it: ~40 ms for a 32K-token prompt on one CPU core,
several times the engine's own time-to-first-token of a 32K prefix hit. This cache keeps the token ids
of recent prompts and tokenizes only what follows the longest text prefix a new prompt shares with one of
them.

Why the splice is exact. A fast tokenizer normalizes characters, splits the text into pre-tokens ("words":
regex matches, whitespace runs, added tokens) scanning left to right, and turns each word into tokens on
its own. Once two scans start a word at the same position of the same text, they split everything after it
the same way. So the new prompt's tail is tokenized from a point `s` shortly before the shared prefix ends;
where that tokenization and the cached one start a word at the same position `p` (past the first words of
the tail, which may differ because the tail starts mid-text, and before the end of the shared prefix, so
that nothing after it was looked at) and agree on the tokens just before it, the cached tokens up to `p`
and the tail's tokens from `p` are the prompt's tokens. When no such `p` exists (a tokenizer without
pre-tokenization has a single word) the prompt is tokenized whole, as it would be without the cache.
Special tokens a post-processor adds at the start are in the cached tokens; tokens it adds at the end are
appended. `tests/unit/test_prefix_token_cache.py` compares cached and whole tokenizations over random
conversations for byte-level BPE, Metaspace and normalizing tokenizers.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from longserve.tokenization.tokenizer import apply_chat_template, render_chat_template

__all__ = ["PrefixTokenCache", "PromptTokenizer", "common_prefix_len"]

logger = logging.getLogger("longserve.tokenization")


def encode_unlocked(backend: Any, text: str, add_special_tokens: bool) -> Any:
    """`backend.encode(text)` (a `tokenizers.Tokenizer`'s Encoding) with the GIL released while it runs.

    `Tokenizer.encode` holds the GIL for the whole call; `encode_batch` releases it (the same Encoding: ids
    and offsets). A 16K-word prompt takes 15-20 ms on a 2-core CI machine, and through `encode` every other
    thread stands still meanwhile (tests/unit/test_prefix_token_cache.py measures it): the server's engine
    thread, whose step launches are Python, would wait for every long prompt being tokenized, as when the HTTP
    multi-turn workload sends eight 16K openings at once. transformers' fast tokenizers call `encode_batch`
    too."""
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]


_PROBE = "Hello world! It's 12345 tokens,  and\n\n  more: 漢字 🙂 <|im_start|> é."  # digits, spaces, specials


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings (C-level compares, O(n) copies at most)."""
    if len(a) > len(b):
        a, b = b, a
    if b.startswith(a):
        return len(a)
    step, i = 8192, 0
    while a[i : i + step] == b[i : i + step]:
        i += step
    lo, hi = i, min(i + step, len(a))  # the first difference lies in [lo, hi)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class _Entry:
    text: str
    ids: np.ndarray  # [N] int64 token ids of the whole text
    word_pos: np.ndarray  # [W] char offsets of the tokens that start a word in the text's last region_chars
    word_tok: np.ndarray  # [W] those tokens' indices


def _word_starts(enc: Any, lo_char: int, hi_char: int) -> tuple[np.ndarray, np.ndarray]:
    """(char offsets, token indices) of the tokens of `enc` that start a word at a char offset in
    [lo_char, hi_char): their word differs from the previous token's. Reads only the tokens in that range
    (reading all offsets of a 32K-token text costs ~10% of tokenizing it). Tokens with no word or no
    offsets (specials a post-processor adds at either end) start nothing."""
    n = len(enc.ids)

    def start(i: int) -> int:
        chars = enc.token_to_chars(i)
        return chars[0] if chars is not None else (-1 if i < n // 2 else 1 << 62)

    lo, hi = 0, n  # the first token starting at or after lo_char
    while lo < hi:
        mid = (lo + hi) // 2
        if start(mid) < lo_char:
            lo = mid + 1
        else:
            hi = mid
    pos, tok = [], []
    prev = enc.token_to_word(lo - 1) if lo > 0 else None
    for i in range(lo, n):
        chars = enc.token_to_chars(i)
        if chars is not None and chars[0] >= hi_char:
            break
        word = enc.token_to_word(i)
        if word is not None and word != prev and chars is not None:
            pos.append(chars[0])
            tok.append(i)
        prev = word
    return np.asarray(pos, dtype=np.int64), np.asarray(tok, dtype=np.int64)


class PrefixTokenCache:
    """Token ids of texts, re-using a cached text's tokens up to the prefix they share (module docstring).

    backend: a `tokenizers.Tokenizer` (a fast HF tokenizer's `backend_tokenizer`). Texts shorter than
    `min_reuse_chars` are tokenized whole and not kept. Thread-safe: the lookups and inserts hold a lock;
    tokenizing does not (pass each thread its own backend through `encode(..., backend=)`)."""

    def __init__(
        self,
        backend: Any,
        max_entries: int = 64,
        max_chars: int = 32 << 20,
        min_reuse_chars: int = 2048,
        window_chars: int = 512,
        skip_chars: int = 128,
        margin_chars: int = 64,
        agree_tokens: int = 4,
        candidates: int = 8,
        key_chars: int = 256,
        region_chars: int = 8192,
    ) -> None:
        assert skip_chars + margin_chars < window_chars <= min_reuse_chars and key_chars <= min_reuse_chars
        assert window_chars < region_chars
        self.backend = backend
        self.max_entries, self.max_chars = max_entries, max_chars
        self.min_reuse_chars, self.window_chars = min_reuse_chars, window_chars
        self.skip_chars, self.margin_chars, self.agree_tokens = skip_chars, margin_chars, agree_tokens
        self.candidates, self.key_chars = candidates, key_chars
        # word starts are kept for each text's last region_chars: a prompt that leaves a cached one less
        # than ~region_chars - window_chars before its end re-uses it; an earlier difference tokenizes whole
        self.region_chars = region_chars
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # LRU: most recent last
        self._buckets: dict[tuple[bool, str], list[int]] = {}  # (specials, first key_chars) -> entry keys
        self._next_key = 0
        self._chars = 0
        self.hits = self.misses = 0
        self.reused_tokens = 0  # tokens taken from the cache instead of tokenized
        self._specials = {flag: self._special_ends(flag) for flag in (False, True)}

    def _special_ends(self, add_special_tokens: bool) -> tuple[list[int], list[int]] | None:
        """(ids a post-processor puts before, after) a text; None if it does something else (no caching)."""
        bare = self.backend.encode(_PROBE, add_special_tokens=False).ids
        full = self.backend.encode(_PROBE, add_special_tokens=add_special_tokens).ids
        for start in range(len(full) - len(bare) + 1):
            if full[start : start + len(bare)] == bare:
                return full[:start], full[start + len(bare) :]
        return None

    # ---- encode -------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, backend: Any = None) -> list[int]:
        backend = backend or self.backend
        specials = self._specials[add_special_tokens]
        if len(text) < self.min_reuse_chars or specials is None:
            return encode_unlocked(backend, text, add_special_tokens).ids
        spliced = self._splice(text, add_special_tokens, specials[1], backend)
        if spliced is not None:
            return spliced
        enc = encode_unlocked(backend, text, add_special_tokens)
        ids = enc.ids
        word_pos, word_tok = _word_starts(enc, len(text) - self.region_chars, len(text) + 1)
        self._insert(_Entry(text, np.asarray(ids, dtype=np.int64), word_pos, word_tok), add_special_tokens)
        with self._lock:
            self.misses += 1
        return ids

    def _splice(self, text: str, flag: bool, suffix: list[int], backend: Any) -> list[int] | None:
        found = self._lookup(text, flag)
        if found is None:
            return None
        key, entry, shared = found
        if shared == len(text) == len(entry.text):  # the same text again
            with self._lock:
                self.hits += 1
                self.reused_tokens += len(entry.ids)
            return entry.ids.tolist()
        start = shared - self.window_chars  # tokenize the tail from here
        tail = encode_unlocked(backend, text[start:], False)
        tail_ids = tail.ids
        # word starts both tokenizations share, late enough for the tail's scan to have caught up and
        # early enough that the cached scan never looked past the shared text
        lo, hi = start + self.skip_chars, shared - self.margin_chars
        tail_pos, tail_tok = _word_starts(tail, lo - start, hi - start + 1)
        tail_pos += start
        keep = (entry.word_pos >= lo) & (entry.word_pos <= hi)
        common, in_cache, in_tail = np.intersect1d(entry.word_pos[keep], tail_pos, return_indices=True)
        cache_tok = entry.word_tok[keep]
        k = self.agree_tokens
        for i in range(len(common) - 1, -1, -1):  # the latest first: the fewest tokens to take from the tail
            j_cache, j_tail = int(cache_tok[in_cache[i]]), int(tail_tok[in_tail[i]])
            if j_tail < k or j_cache < k:
                continue
            if entry.ids[j_cache - k : j_cache].tolist() != tail_ids[j_tail - k : j_tail]:
                continue
            ids = entry.ids[:j_cache].tolist()
            ids += tail_ids[j_tail:]
            ids += suffix
            p = int(common[i])
            region = len(text) - self.region_chars
            old = (entry.word_pos >= region) & (entry.word_pos < p)
            new_pos, new_tok = _word_starts(tail, max(p, region) - start, len(text) - start + 1)
            self._insert(
                _Entry(
                    text,
                    np.asarray(ids, dtype=np.int64),
                    np.concatenate([entry.word_pos[old], new_pos + start]),
                    np.concatenate([entry.word_tok[old], new_tok - j_tail + j_cache]),
                ),
                flag,
                replaces=key if shared == len(entry.text) else None,  # the new text extends it
            )
            with self._lock:
                self.hits += 1
                self.reused_tokens += j_cache
            return ids
        return None

    # ---- the LRU --------------------------------------------------------------------------------------

    def _lookup(self, text: str, flag: bool) -> tuple[int, _Entry, int] | None:
        """(key, entry, shared length) of the recent entry sharing the longest prefix with `text`, if that
        prefix is at least min_reuse_chars long; the entry becomes the most recently used."""
        with self._lock:
            keys = self._buckets.get((flag, text[: self.key_chars]), [])[-self.candidates :]
            entries = [(k, self._entries[k]) for k in reversed(keys)]
        best, best_len = None, self.min_reuse_chars - 1
        for k, e in entries:
            n = common_prefix_len(text, e.text)
            if n > best_len:
                best, best_len = (k, e), n
        if best is None:
            return None
        with self._lock:
            if best[0] in self._entries:
                self._entries.move_to_end(best[0])
        return best[0], best[1], best_len

    def _insert(self, entry: _Entry, flag: bool, replaces: int | None = None) -> None:
        with self._lock:
            if replaces is not None and replaces in self._entries:
                self._drop(replaces, flag)
            key, self._next_key = self._next_key, self._next_key + 1
            self._entries[key] = entry
            self._buckets.setdefault((flag, entry.text[: self.key_chars]), []).append(key)
            self._chars += len(entry.text)
            while self._entries and (len(self._entries) > self.max_entries or self._chars > self.max_chars):
                self._drop(next(iter(self._entries)), None)

    def _drop(self, key: int, flag: bool | None) -> None:
        """Remove an entry (lock held); flag None: look in both flags' buckets."""
        old = self._entries.pop(key)
        self._chars -= len(old.text)
        for f in (False, True) if flag is None else (flag,):
            bucket_key = (f, old.text[: self.key_chars])
            bucket = self._buckets.get(bucket_key)
            if bucket and key in bucket:
                bucket.remove(key)
                if not bucket:
                    del self._buckets[bucket_key]

    def clear(self) -> int:
        """Forget every kept text; returns how many there were."""
        with self._lock:
            n = len(self._entries)
            self._entries.clear()
            self._buckets.clear()
            self._chars = 0
        return n

    def __len__(self) -> int:
        return len(self._entries)


class PromptTokenizer:
    """Prompt and chat tokenization of a fast HF tokenizer through a PrefixTokenCache, with the ids
    transformers gives (`tokenizer.encode`, `apply_chat_template`). The cache is used only where that holds
    on probe inputs: the tokenizer's ids are its Rust backend's, and (for chats) `apply_chat_template`'s ids
    are its rendered text's without added specials. `size` 0 (or a slow tokenizer): no cache.

    Methods take `tokenizer=` to tokenize with another instance of the same tokenizer (one per thread)."""

    def __init__(self, tokenizer: Any, size: int = 64) -> None:
        self.tokenizer = tokenizer
        self.cache: PrefixTokenCache | None = None
        self.chat_cached = False
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if size <= 0 or backend is None:
            return
        for flag in (True, False):
            if (
                list(tokenizer.encode(_PROBE, add_special_tokens=flag))
                != backend.encode(_PROBE, add_special_tokens=flag).ids
            ):
                logger.info("prefix token cache off: this tokenizer's ids are not its backend's")
                return
        self.cache = PrefixTokenCache(backend, max_entries=size)
        chat = [{"role": "user", "content": _PROBE}]
        try:
            rendered = backend.encode(render_chat_template(tokenizer, chat), add_special_tokens=False).ids
            self.chat_cached = apply_chat_template(tokenizer, chat) == rendered
        except Exception:  # no chat template, or one that wants other messages: chats are tokenized whole
            self.chat_cached = False

    def encode(
        self, text: str, add_special_tokens: bool = True, tokenizer: Any = None, use_cache: bool = True
    ) -> list[int]:
        tok = tokenizer or self.tokenizer
        if self.cache is None or not use_cache:
            return list(tok.encode(text, add_special_tokens=add_special_tokens))
        return self.cache.encode(text, add_special_tokens, backend=tok.backend_tokenizer)

    def chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenizer: Any = None,
        use_cache: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        tok = tokenizer or self.tokenizer
        if self.cache is None or not self.chat_cached or not use_cache:
            return apply_chat_template(tok, messages, add_generation_prompt, **kwargs)
        text = render_chat_template(tok, messages, add_generation_prompt, **kwargs)
        return self.cache.encode(text, add_special_tokens=False, backend=tok.backend_tokenizer)
