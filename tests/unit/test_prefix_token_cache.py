"""PrefixTokenCache: a text that shares a long prefix with a recently encoded one tokenizes, through the
splice of cached tokens and a tokenized tail, to exactly the ids of tokenizing it whole.

Real `tokenizers` pipelines are trained in-process on a small synthetic corpus (no downloads): Llama-3 /
GPT-4 style byte-level BPE, SentencePiece-like Metaspace BPE and Unigram behind NFKC, a BERT WordPiece,
a RoBERTa style byte-level BPE (prefix space, GPT-2 regex, trimmed offsets) and a Llama-2 style BPE with no
pre-tokenizer (one word: the cache must fall back to whole tokenization). Random multi-turn conversations,
hand-made seams (mid digit run, mid whitespace run, mid combining sequence, at / inside a special token
string, mid word), the LRU bounds, `common_prefix_len` and concurrent use are checked against whole
tokenization.
"""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from longserve.tokenization.prefix_token_cache import PrefixTokenCache, common_prefix_len

# ---- synthetic text ----------------------------------------------------------------------------------

GPT4_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# fmt: off
_WORDS = [
    "the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are", "as", "with",
    "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by", "word", "but", "not", "what",
    "all", "were", "we", "when", "your", "can", "said", "there", "use", "an", "each", "which", "she", "do",
    "how", "their", "if", "will", "up", "other", "about", "out", "many", "then", "them", "these", "so",
    "some", "her", "would", "make", "like", "him", "into", "time", "has", "look", "two", "more", "write",
    "go", "see", "number", "no", "way", "could", "people", "my", "than", "first", "water", "been", "call",
    "who", "oil", "its", "now", "find", "long", "down", "day", "did", "get", "come", "made", "may", "part",
    "tokenizer", "prefix", "cache", "splice", "conversation", "assistant", "user", "system", "function",
]
_PUNCT = list(".,;:!?-()[]{}\"'/\\@#$%^&*=+_~`|")
_APOS = ["it's", "we'll", "I'M", "they'RE", "don't", "you'd", "'s", "O'Neil", "we've", "'T"]
_WS = [" ", "  ", "\n", "\n\n", "\t", " \n", "\r\n", "   \n  \n ", "\t\t  ", "    ", "\n \n"]
_UNI = [
    "é", "ü", "ß", "Ω", "漢字", "日本語の", "한국어", "🙂", "👍🏽", "👩\u200d💻", "e\u0301", "a\u0308\u0323",
    "ﬁ", "ﬀ", "½", "²", "Ⅻ", "\u00a0", "\u3000", "ﷺ", "\u1100\u1161\u11a8", "ﾊﾝｶｸ", "\u200b", "Ǆ", "İ",
    "…", "“quoted”", "—", "\u2028", "Ａｂｃ", "①", "x\u0327\u0301",
]
_MARKS = ["\u0301", "\u0308", "\u0323", "\u0327", "\u0331", "\u030a"]
SPECIAL_STRINGS = [
    "<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "<unk>", "[CLS]", "[SEP]",
    "<|im_", "_start|>", "<|", "|>", "</", "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n",
]
# fmt: on


def _piece(rng: random.Random, specials: bool) -> str:
    r = rng.random()
    if r < 0.50:
        w = rng.choice(_WORDS)
        w = w.capitalize() if rng.random() < 0.15 else (w.upper() if rng.random() < 0.03 else w)
        return (" " if rng.random() < 0.8 else "") + w
    if r < 0.58:
        if rng.random() < 0.05:
            return "".join(rng.choice("0123456789") for _ in range(rng.randint(20, 200)))
        return (" " if rng.random() < 0.5 else "") + str(rng.randint(0, 10 ** rng.randint(1, 8)))
    if r < 0.66:
        if rng.random() < 0.04:
            return "".join(rng.choice("  \n\t") for _ in range(rng.randint(50, 300)))
        return rng.choice(_WS)
    if r < 0.74:
        return (
            "".join(rng.choice(_PUNCT) for _ in range(rng.randint(1, 3))).replace("<", "(").replace(">", ")")
        )
    if r < 0.79:
        return " " + rng.choice(_APOS)
    if r < 0.89:
        return (" " if rng.random() < 0.5 else "") + rng.choice(_UNI)
    if r < 0.91:
        return " " + "".join(rng.choice("abcdefghijklmnopqrstuvwxyzé") for _ in range(rng.randint(30, 200)))
    if r < 0.92:
        return "a" + "".join(rng.choice(_MARKS) for _ in range(rng.randint(20, 120)))
    if r < 0.95 and specials:
        return rng.choice(SPECIAL_STRINGS)
    return rng.choice([". ", ", ", "\n", " -"])


def gen_text(rng: random.Random, n: int, specials: bool = True) -> str:
    out, size = [], 0
    while size < n:
        p = _piece(rng, specials)
        out.append(p)
        size += len(p)
    return "".join(out)


# ---- tokenizers -----------------------------------------------------------------------------------------

KINDS = [
    "bytelevel_llama3",
    "metaspace_bpe_nfkc",
    "metaspace_unigram_eos",
    "wordpiece_bert",
    "bytelevel_roberta",
]
NO_PRETOK = "no_pretokenizer"


def _template(tok: Tokenizer, single: str) -> processors.TemplateProcessing:
    names = [t for t in single.split() if t != "$A"]
    return processors.TemplateProcessing(
        single=single, special_tokens=[(t, tok.token_to_id(t)) for t in names]
    )


def _build(kind: str, corpus: list[str]) -> Tokenizer:
    if kind == "bytelevel_llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(GPT4_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=1200, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        tok.train_from_iterator(corpus, trainer)
        tok.post_processor = _template(tok, "<|begin_of_text|> $A")
    elif kind == "metaspace_bpe_nfkc":
        specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
        tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
        tok.normalizer = normalizers.Sequence([normalizers.NFKC()])
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=1200, special_tokens=specials))
        tok.post_processor = _template(tok, "<s> $A")
    elif kind == "metaspace_unigram_eos":
        specials = ["<pad>", "</s>", "<unk>"]
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        trainer = trainers.UnigramTrainer(vocab_size=800, special_tokens=specials, unk_token="<unk>")
        tok.train_from_iterator(corpus, trainer)
        tok.post_processor = _template(tok, "$A </s>")  # T5: an end token only
    elif kind == "wordpiece_bert":
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)  # cleans, spaces CJK, strips accents
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        tok.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=1000, special_tokens=specials))
        tok.post_processor = _template(tok, "[CLS] $A [SEP]")
    elif kind == "bytelevel_roberta":
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=1000, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        tok.train_from_iterator(corpus, trainer)
        # RoBERTa's own: <s> $A </s>, offsets trimmed of spaces (a whitespace token's start moves to its end)
        tok.post_processor = processors.RobertaProcessing(
            ("</s>", tok.token_to_id("</s>")),
            ("<s>", tok.token_to_id("<s>")),
            trim_offsets=True,
            add_prefix_space=True,
        )
    elif kind == NO_PRETOK:
        # Llama-2 style: no pre-tokenizer, the whole text (between added tokens) is one word
        specials = ["<unk>", "<s>", "</s>"]
        tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=800, special_tokens=specials))
        tok.post_processor = _template(tok, "<s> $A")
    else:
        raise ValueError(kind)
    return tok


@pytest.fixture(scope="module")
def toks() -> dict[str, Tokenizer]:
    rng = random.Random(1234)
    corpus = [gen_text(rng, rng.randint(300, 700)) for _ in range(250)]
    out = {kind: _build(kind, corpus) for kind in KINDS}
    out[NO_PRETOK] = _build(NO_PRETOK, corpus[:80])  # each sample is one long word: keep its training small
    return out


# ---- helpers ---------------------------------------------------------------------------------------------

SMALL = dict(
    min_reuse_chars=600, window_chars=256, skip_chars=64, margin_chars=32, region_chars=2048, key_chars=128
)
# seams close to the tail's start and the shared prefix's end, one agreeing token: splices at the edges
TIGHT = dict(
    min_reuse_chars=300,
    window_chars=96,
    skip_chars=32,
    margin_chars=8,
    agree_tokens=1,
    region_chars=1024,
    key_chars=64,
)


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check(
    cache: PrefixTokenCache, backend: Tokenizer, text: str, flag: bool, prev: str | None = None
) -> list[int]:
    """cache.encode(text) == whole tokenization, with a message that locates a mismatch."""
    got = cache.encode(text, flag)
    want = backend.encode(text, add_special_tokens=flag).ids
    if got != want:
        i = _first_diff(got, want)
        seam = common_prefix_len(text, prev) if prev is not None else None
        raise AssertionError(
            f"cached ids differ from whole tokenization: len(text)={len(text)} flag={flag} "
            f"len(prev)={None if prev is None else len(prev)} shared={seam} first differing token {i}: "
            f"got {got[i - 3 : i + 3]} want {want[i - 3 : i + 3]} "
            f"({len(got)} vs {len(want)} tokens); text near seam: {text[(seam or 0) - 80 : (seam or 0) + 40]!r}"
        )
    return got


# ---- 1/2: random multi-turn conversations ------------------------------------------------------------------


def _conversations(
    cache: PrefixTokenCache,
    backend: Tokenizer,
    rng: random.Random,
    n_convs: int,
    turns: int,
    scale: int,
    specials: bool,
) -> dict[str, int]:
    """Conversations that start from long texts (some sharing a 'system prompt'), then per turn: append,
    truncate-then-append, edit one char in the last ~1000 then append, truncate only, or re-send as is."""
    seen: set[tuple[bool, str]] = set()
    stats = {"long": 0, "repeats": 0}
    systems = [gen_text(rng, int(scale * 1.2), specials) for _ in range(2)]
    for c in range(n_convs):
        flag = c % 2 == 0
        if rng.random() < 0.5:
            text = rng.choice(systems) + gen_text(rng, rng.randint(scale // 4, scale), specials)
        else:
            text = gen_text(rng, rng.randint(int(scale * 1.2), int(scale * 2.5)), specials)
        prev = None
        for _ in range(turns):
            r = rng.random()
            if r < 0.2:
                text = text[: len(text) - rng.randint(1, 300)]
            elif r < 0.35:
                pos = len(text) - rng.randint(1, min(1000, len(text)))
                text = text[:pos] + _piece(rng, specials)[-1:] + text[pos + 1 :]
            if r < 0.35 and rng.random() < 0.2:
                pass  # truncated or edited, nothing appended
            elif 0.35 <= r < 0.42:
                pass  # re-sent as is
            elif rng.random() < 0.25:  # a few chars: often continues the last word, digit run, ...
                text += gen_text(rng, rng.randint(1, 6), specials)
            else:
                text += gen_text(rng, rng.randint(20, scale // 2), specials)
            stats["long"] += len(text) >= cache.min_reuse_chars
            stats["repeats"] += (flag, text) in seen
            seen.add((flag, text))
            check(cache, backend, text, flag, prev)
            if rng.random() < 0.1:  # the other flavour of the same text
                check(cache, backend, text, not flag, prev)
                stats["long"] += len(text) >= cache.min_reuse_chars
                stats["repeats"] += (not flag, text) in seen
                seen.add((not flag, text))
            prev = text
    return stats


@pytest.mark.parametrize("params", [{}, SMALL, TIGHT], ids=["default", "small", "tight"])
@pytest.mark.parametrize("kind", KINDS)
def test_random_conversations_match_whole_tokenization(toks, kind, params) -> None:
    backend = toks[kind]
    cache = PrefixTokenCache(backend, **params)
    rng = random.Random(f"{kind}-{sorted(params.items())}")
    scale = 4 * cache.min_reuse_chars // 3 if params else 2600
    stats = _conversations(cache, backend, rng, n_convs=8, turns=7, scale=scale, specials=True)
    assert stats["long"] > 40
    # the splice path ran, not only the same-text path, and most long texts re-used a previous one
    assert cache.hits > stats["repeats"] and cache.reused_tokens > 0
    assert cache.hits >= stats["long"] // 3, (cache.hits, cache.misses, stats)
    assert cache.hits + cache.misses == stats["long"]


@pytest.mark.parametrize("params", [{}, SMALL], ids=["default", "small"])
def test_no_pretokenizer_falls_back_to_whole_tokenization(toks, params) -> None:
    """One word per text: no word start to splice at, so only a text seen before is a hit, and every id is
    still exact."""
    backend = toks[NO_PRETOK]
    cache = PrefixTokenCache(backend, max_entries=1000, **params)
    rng = random.Random(7)
    scale = 4 * cache.min_reuse_chars // 3 if params else 2600
    stats = _conversations(cache, backend, rng, n_convs=4, turns=6, scale=scale, specials=False)
    assert stats["long"] > 20
    assert cache.hits == stats["repeats"] and cache.misses == stats["long"] - stats["repeats"]


def test_no_pretokenizer_with_special_strings_is_exact(toks) -> None:
    """Added tokens split the text into words even without a pre-tokenizer: the cache may splice after one,
    and the ids stay exact."""
    backend = toks[NO_PRETOK]
    cache = PrefixTokenCache(backend, **SMALL)
    _conversations(cache, backend, random.Random(8), n_convs=4, turns=6, scale=800, specials=True)
    rng = random.Random(9)
    # "<s>" ~100 chars before the end of the shared prefix: inside [tail start + skip, end - margin]
    base = gen_text(rng, 1500, specials=False) + "<s>" + gen_text(rng, 100, specials=False)
    hits = cache.hits
    for tail in ["<s> and more text", "</s>", " plain tail", "<unk>x", "s>"]:
        check(cache, backend, base, True)
        check(cache, backend, base + tail, True, base)
    assert cache.hits > hits


# ---- 3: hand-made seams -------------------------------------------------------------------------------------

# (end of the shared prefix, what the first text continues with, what the second continues with)
SEAMS = {
    "mid_digit_run": ("order number 1234567", "89012 shipped", "0 items"),
    "mid_digit_run_x3": ("value 12345678901", "23456789 ok", "x"),
    "mid_space_run": ("first line   ", "   second", "\tthird"),
    "mid_newline_run": ("para one.\n\n", "\n\nnext para", "  \n x"),
    "spaces_then_newline": ("a b     ", "\n", "c"),
    "mid_crlf": ("line\r", "\nnext", "x"),
    "mid_combining": ("caf" + "e", "\u0301 au lait", "\u0323\u0308 bar"),
    "mid_combining_run": ("na\u0308", "\u0323\u0301ve", "\u0301x"),
    "mid_emoji_zwj": ("coder 👩", "\u200d💻 here", "🏽 there"),
    "mid_hangul_jamo": ("han \u1100", "\u1161\u11a8 ok", "\u1162 no"),
    "mid_cjk": ("漢", "字 text", "語 text"),
    "before_special": ("the prompt ends here ", "<|im_start|>user\nhi", "<|im_end|>\n"),
    "before_special_no_space": ("the prompt ends here", "<|im_start|>user", "</s> next"),
    "inside_special": ("turn over <|im_st", "art|>assistant\n", "arting now"),
    "inside_special_2": ("turn over <", "/s> more", "s> more"),
    "after_special": ("turn over <|im_end|>", "\n<|im_start|>", "x"),
    "inside_word": ("the assist", "ant said", "ive technology"),
    "inside_apostrophe": ("it'", "s done", "ll be"),
    "after_space": ("the end ", "of it", " of it"),
    "before_punct": ("really", "?!...", "... no"),
    "nfkc_ligature": ("o", "ﬁce ﬀ", "ffice"),
}
# seams inside long runs that start well before the end of the shared prefix (> margin_chars)
LONG_SEAMS = {
    "long_digit_run": ("numbers " + "1234567890" * 30, "98765 done", " done"),
    "long_digit_run_2": ("numbers " + "1234567890" * 30 + "1", "2 done", "x done"),
    "long_space_run": ("indent" + " " * 300, "x", "\n\ny"),
    "long_space_run_newline": ("indent\n" + " " * 300, "x", "   \n\n y"),
    "long_mixed_ws": ("block" + " \t" * 150, "\n", "z"),
    "long_word": ("word " + "abcdefghij" * 30, "klm end", " end"),
    "long_combining": ("a" + "\u0301\u0323\u0308" * 60, "\u0327 x", "b y"),
    "long_punct": ("look " + "!?" * 150, "\n\nok", "x"),
    # longer than the tail's window: no word start to splice at, tokenized whole
    "window_long_word": ("word " + "abcdefghij" * 70, "klm end", " end"),
    "window_long_space_run": ("indent" + " " * 700, "x", "\n\ny"),
    # a digit run the tail starts inside: its 3-digit groups are shifted by 0, 1 or 2 from the whole text's
    "window_long_digits": ("n " + "1234567890" * 70, "98765 done", " done"),
    "window_long_digits_1": ("n " + "1234567890" * 70 + "1", "2 done", " done"),
    "window_long_digits_2": ("n " + "1234567890" * 70 + "12", "3 done", " done"),
}


@pytest.mark.parametrize("params", [{}, SMALL], ids=["default", "small"])
@pytest.mark.parametrize("kind", KINDS + [NO_PRETOK])
def test_hard_seams_are_exact(toks, kind, params) -> None:
    backend = toks[kind]
    cache = PrefixTokenCache(backend, **params)
    n = 3 * cache.min_reuse_chars // 2
    filler = gen_text(random.Random(f"seams-{kind}"), n, specials=kind != NO_PRETOK) + "\n"
    hits = plain_hits = 0
    for name, (end, cont1, cont2) in {**SEAMS, **LONG_SEAMS}.items():
        rng = random.Random(name)
        shared = filler + gen_text(rng, 200, specials=False) + end
        more = gen_text(rng, 300, specials=False)
        for flag in (True, False):
            first = shared + cont1 + more
            check(cache, backend, first, flag)
            before = cache.hits
            check(cache, backend, shared + cont2 + more, flag, first)
            check(cache, backend, shared + cont2, flag, shared + cont2 + more)  # a prefix of the last one
            check(cache, backend, shared, flag, shared + cont2)  # ends right at the seam
            check(cache, backend, shared + cont1 + more + cont2, flag, shared)
            hits += cache.hits - before
            if not any(s in end + cont1 + cont2 for s in ("<s>", "</s>", "<unk>")):
                plain_hits += cache.hits - before
    if kind == NO_PRETOK:
        # no pre-tokenizer and no added token in the text: one word, nothing to splice at
        assert plain_hits == 0
    else:
        assert hits >= len(SEAMS) * 2 * 3, hits  # most seams above re-used the previous text


class _ReversingBackend:
    """A backend whose 'post-processor' reverses the ids: not specials around the text, so not cacheable."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def encode(self, text: str, add_special_tokens: bool = True):
        enc = self.tok.encode(text, add_special_tokens=add_special_tokens)
        return SimpleNamespace(ids=enc.ids[::-1]) if add_special_tokens else enc

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True):
        return [self.encode(t, add_special_tokens) for t in texts]


def test_a_post_processor_that_is_not_specials_at_the_ends_is_never_cached(toks) -> None:
    backend = _ReversingBackend(toks["bytelevel_llama3"])
    cache = PrefixTokenCache(backend)
    text = gen_text(random.Random(13), 3000)
    for t in (text, text + " more", text + " more"):
        assert cache.encode(t, True) == backend.encode(t, add_special_tokens=True).ids
    assert len(cache) == 0 and cache.hits == cache.misses == 0
    for t in (text, text + " more"):  # the other flavour is cached as usual
        assert cache.encode(t, False) == backend.encode(t, add_special_tokens=False).ids
    assert len(cache) == 1 and (cache.hits, cache.misses) == (1, 1)


# ---- 4: identical texts and early differences --------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_same_text_twice_is_a_hit(toks, kind) -> None:
    backend = toks[kind]
    cache = PrefixTokenCache(backend)
    text = gen_text(random.Random(1), 5000)
    for flag in (True, False):
        first = check(cache, backend, text, flag)
        hits, misses, reused = cache.hits, cache.misses, cache.reused_tokens
        assert check(cache, backend, text, flag) == first
        assert (cache.hits, cache.misses, cache.reused_tokens) == (hits + 1, misses, reused + len(first))
    assert len(cache) == 2  # one entry per flag
    short = text[:1000]  # below min_reuse_chars: neither cached nor counted
    check(cache, backend, short, True)
    check(cache, backend, short, True)
    assert len(cache) == 2 and cache.hits == 2 and cache.misses == 2


@pytest.mark.parametrize("kind", KINDS)
def test_difference_before_the_region_tokenizes_whole(toks, kind) -> None:
    backend = toks[kind]
    cache = PrefixTokenCache(backend)  # region_chars 8192
    rng = random.Random(2)
    text = gen_text(rng, 14000, specials=False)
    check(cache, backend, text, True)
    # a change 3000 chars in: shared prefix >= min_reuse_chars but before the cached text's last 8192 chars
    pos = 3000
    changed = text[:pos] + ("Q" if text[pos] != "Q" else "R") + text[pos + 1 :] + " more"
    hits = cache.hits
    check(cache, backend, changed, True, text)
    assert cache.hits == hits and cache.misses == 2
    # a change inside the region is re-used
    pos = len(changed) - 3000
    late = changed[:pos] + ("Q" if changed[pos] != "Q" else "R") + changed[pos + 1 :] + " more"
    check(cache, backend, late, True, changed)
    assert cache.hits == hits + 1 and cache.reused_tokens > 0


def _plain_text(rng: random.Random, n: int) -> str:
    """Short words, single spaces and a little punctuation: every word is shorter than 16 chars."""
    out = []
    while sum(map(len, out)) < n:
        out.append(rng.choice(_WORDS) + rng.choice([" "] * 8 + [", ", ". "]))
    return "".join(out)


@pytest.mark.parametrize("kind", KINDS)
def test_splice_reuses_the_tokens_up_to_the_last_words_before_the_seam(toks, kind) -> None:
    """An appended turn re-uses every token that ends more than margin_chars + a word before the end of the
    shared prefix (the latest common word start wins), and never a token past it."""
    backend = toks[kind]
    cache = PrefixTokenCache(backend)
    rng = random.Random(12)
    text = _plain_text(rng, 4000)
    check(cache, backend, text, True)
    for _ in range(5):
        prev, text = text, text + _plain_text(rng, rng.randint(1, 400))
        before = cache.reused_tokens
        check(cache, backend, text, True, prev)
        reused = cache.reused_tokens - before
        enc = backend.encode(text, add_special_tokens=True)
        n, ends = len(enc.ids), []
        for i in range(n):  # where each token ends; the specials before the text at -1, after it at infinity
            chars = enc.token_to_chars(i)
            ends.append(chars[1] if chars is not None else (-1 if i < n // 2 else 1 << 62))
        surely = sum(e <= len(prev) - cache.margin_chars - 20 for e in ends)
        at_most = sum(e <= len(prev) for e in ends)
        assert surely <= reused <= at_most, (surely, reused, at_most)


# ---- 5: common_prefix_len ---------------------------------------------------------------------------------


def _naive_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_common_prefix_len_matches_naive() -> None:
    rng = random.Random(3)
    alphabet = "ab漢🙂\n"
    pairs = [("", ""), ("", "x"), ("x", ""), ("abc", "abc"), ("abc", "abd"), ("abc", "ab"), ("a", "b")]
    for n in [1, 100, 8191, 8192, 8193, 16383, 16384, 16385, 20000]:
        base = "".join(rng.choice(alphabet) for _ in range(n))
        pairs += [(base, base), (base, base + "x"), (base + "x", base), (base[:-1], base)]
        diffs = {0, 1, n // 2, n - 1, 8191, 8192, 8193, 16383, 16384, 16385}
        diffs |= {rng.randrange(n) for _ in range(5)}
        for d in sorted(x for x in diffs if 0 <= x < n):
            other = base[:d] + ("Z" if base[d] != "Z" else "Y") + base[d + 1 :]
            pairs += [(base, other), (other + "tail", base), (base, other[: d + 1])]
    for _ in range(200):
        n = rng.choice([0, 5, 8192, 8200, 16384, 16400, rng.randint(0, 30000)])
        a = "".join(rng.choice("ab") for _ in range(n))
        b = a[: rng.randint(0, n)] + "".join(rng.choice("ab") for _ in range(rng.randint(0, 50)))
        pairs.append((a, b))
    for a, b in pairs:
        assert common_prefix_len(a, b) == _naive_prefix(a, b), (len(a), len(b), _naive_prefix(a, b))
        assert common_prefix_len(b, a) == _naive_prefix(a, b)


# ---- 6: the LRU -------------------------------------------------------------------------------------------


def test_lru_bounds_entries_and_chars(toks) -> None:
    backend = toks["bytelevel_llama3"]
    rng = random.Random(4)
    texts = [f"{i:04d} " + gen_text(rng, 2500, specials=False) for i in range(12)]
    cache = PrefixTokenCache(backend, max_entries=4)
    for t in texts:
        check(cache, backend, t, True)
        assert len(cache) <= 4
    assert len(cache) == 4 and cache.misses == 12
    # texts[0] was evicted: its successor is tokenized whole; texts[-1] is kept: its successor re-uses it
    check(cache, backend, texts[0] + " and one more turn", True, texts[0])
    assert (cache.hits, cache.misses) == (0, 13)
    check(cache, backend, texts[-1] + " and one more turn", True, texts[-1])
    assert (cache.hits, cache.misses) == (1, 13)

    limit = 3 * 2600
    cache = PrefixTokenCache(backend, max_chars=limit)
    for t in texts:
        check(cache, backend, t, False)
        kept = sum(len(e.text) for e in cache._entries.values())
        assert kept <= limit and kept == cache._chars
    assert 1 <= len(cache) <= 3
    check(cache, backend, texts[0] + "!", False, texts[0])
    assert cache.hits == 0 and cache.misses == 13


def test_lru_keeps_the_recently_used(toks) -> None:
    backend = toks["bytelevel_llama3"]
    rng = random.Random(5)
    texts = [f"{i:04d} " + gen_text(rng, 2500, specials=False) for i in range(5)]
    cache = PrefixTokenCache(backend, max_entries=3)
    for t in texts[:3]:
        check(cache, backend, t, True)
    check(cache, backend, texts[0], True)  # a hit: texts[0] becomes the most recent
    check(cache, backend, texts[3], True)  # evicts texts[1], the least recent
    check(cache, backend, texts[4], True)  # evicts texts[2]
    hits = cache.hits
    check(cache, backend, texts[0] + " next", True, texts[0])
    assert cache.hits == hits + 1
    check(cache, backend, texts[1] + " next", True, texts[1])
    assert cache.hits == hits + 1


@pytest.mark.parametrize("kind", KINDS)
def test_extending_a_text_replaces_its_entry(toks, kind) -> None:
    backend = toks[kind]
    cache = PrefixTokenCache(backend)
    rng = random.Random(6)
    text = gen_text(rng, 3000)
    check(cache, backend, text, True)
    assert len(cache) == 1
    for _ in range(6):
        prev, text = text, text + gen_text(rng, rng.randint(50, 800))
        hits = cache.hits
        check(cache, backend, text, True, prev)
        assert cache.hits == hits + 1 and len(cache) == 1
    # a truncated text does not extend the cached one: both are kept
    check(cache, backend, text[:-200], True, text)
    assert len(cache) == 2
    # the other flag keeps its own entries
    check(cache, backend, text, False)
    check(cache, backend, text + " more", False, text)
    assert len(cache) == 3


# ---- 7: threads -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bytelevel_llama3", "metaspace_bpe_nfkc"])
def test_threads_share_the_cache(toks, kind) -> None:
    main = toks[kind]
    cache = PrefixTokenCache(main, max_entries=16, **SMALL)
    rng = random.Random(11)
    systems = [gen_text(rng, 1500) for _ in range(2)]
    n_threads, errors = 4, []
    barrier = threading.Barrier(n_threads)

    def work(t: int) -> None:
        backend = Tokenizer.from_str(main.to_str())
        r = random.Random(100 + t)
        try:
            barrier.wait()
            for c in range(3):
                text = systems[(t + c) % 2] + gen_text(r, r.randint(100, 600))
                flag = (t + c) % 2 == 0
                for _ in range(6):
                    if r.random() < 0.3:
                        text = text[: -r.randint(1, 200)]
                    text += gen_text(r, r.randint(1, 400))
                    got = cache.encode(text, flag, backend=backend)
                    want = backend.encode(text, add_special_tokens=flag).ids
                    if got != want:
                        errors.append((t, c, len(text), _first_diff(got, want)))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((t, repr(e)))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert cache.hits > 0 and len(cache) <= 16
    assert cache._chars == sum(len(e.text) for e in cache._entries.values())


def test_tokenizing_a_long_prompt_lets_other_threads_run(toks) -> None:
    """The cache tokenizes with the GIL released (`encode_unlocked`): while a worker thread tokenizes a long
    prompt, another thread (the server's engine thread, launching a step) keeps running. Through
    `Tokenizer.encode` it would stand still for the whole encode."""
    import time

    backend = toks["bytelevel_llama3"]
    rng = random.Random(5)
    text = gen_text(rng, 4000, specials=False)
    while True:
        start = time.perf_counter()
        want = backend.encode(text, add_special_tokens=True).ids
        whole_s = time.perf_counter() - start
        if whole_s >= 0.4:
            break
        text += text  # long enough that a stall of the whole encode stands out from scheduling noise
    cache = PrefixTokenCache(backend)
    got: list[list[int]] = []
    worker = threading.Thread(target=lambda: got.append(cache.encode(text, True)))
    stamps = [time.perf_counter()]
    worker.start()
    while worker.is_alive():
        stamps.append(time.perf_counter())
    worker.join()
    assert got == [want]
    longest = max(b - a for a, b in zip(stamps, stamps[1:]))
    assert longest < whole_s / 3, (
        f"this thread stood still {longest * 1e3:.0f} ms of a {whole_s * 1e3:.0f} ms encode"
    )
