"""Serving-benchmark workloads: `random`, `long-doc`, `shared-prefix` and `jsonl`, each a reproducible list of
BenchRequests (seeded). Prompts are token ids drawn from a pool of ordinary-word tokens (the tokenizer's own
ids for a built-in English text), so they decode to clean text; text prompts are re-encoded to count tokens."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from typing import Any, Protocol

DATASETS = ("random", "long-doc", "shared-prefix", "multi-turn", "jsonl")

_CORPUS = """
The history of the river town begins with a mill, a bridge and a market square where farmers sold grain,
apples, cheese and wool every Saturday morning. Over the years the town grew: a school, a library, a small
hospital, two churches and a railway station arrived, and with them teachers, doctors, engineers and clerks.
Scientists measure the temperature of the ocean, the speed of the wind and the height of the waves to
understand the climate. Computers store numbers in memory, read instructions, compute results and write
them back; a program is a list of such instructions, and a compiler translates it from one language to
another. Questions about economics, politics, music, painting, literature, mathematics, physics, chemistry,
biology and medicine fill the shelves of every university. Travelers cross mountains, deserts and forests,
sail across lakes and seas, and write letters home about food, weather, strangers, languages and customs.
"""


_VOCAB_SCAN = 2048  # ids tried when the built-in text gives too few (see _word_ids)
_VOCAB_POOL = 512


def _word_ids(tokenizer: Tokenizer) -> list[int]:
    """Up to _VOCAB_POOL ids among the first _VOCAB_SCAN whose piece is one alphanumeric word that encodes back
    to that id alone (special tokens such as <s> and </s> are not alphanumeric, so they are left out)."""
    out: list[int] = []
    for i in range(_VOCAB_SCAN):
        try:
            piece = tokenizer.decode([i]).strip()
        except (ValueError, IndexError, KeyError, OverflowError):
            continue
        if piece.isalnum() and tokenizer.encode(piece, add_special_tokens=False) == [i]:
            out.append(i)
            if len(out) == _VOCAB_POOL:
                break
    return out


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class LocalTokenizer:
    """A Hugging Face tokenizer from a local directory (--tokenizer)."""

    def __init__(self, path: str) -> None:
        from longserve.tokenization.tokenizer import load_tokenizer

        self.tok = load_tokenizer(path)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


class RemoteTokenizer:
    """The server's own tokenizer through POST /tokenize and /detokenize (longserve, vLLM, SGLang)."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.server.tokenize(text, add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.server.detokenize(ids)


@dataclass(slots=True)
class BenchRequest:
    """One request of a workload. `prompt_len` counts the tokens the server should see for `text` (with its
    special tokens) or `input_ids`; `group` names a shared document (shared-prefix) or conversation
    (multi-turn), or is None; `after` is the index of the request that must finish before this one is sent
    (a conversation's previous turn), or None."""

    prompt_len: int
    output_len: int
    input_ids: list[int] | None = None
    text: str | None = None
    group: int | None = None
    after: int | None = None


class PromptBuilder:
    """Turns token-id sequences into the prompt form a backend takes (ids, or text re-encoded to count)."""

    def __init__(self, tokenizer: Tokenizer, as_text: bool) -> None:
        self.tokenizer = tokenizer
        self.as_text = as_text
        pool = sorted(set(tokenizer.encode(_CORPUS, add_special_tokens=False)))
        from_text = len(pool)
        if from_text < 8:  # a vocabulary without English words (the word-level `w123` test tokenizers)
            pool = _word_ids(tokenizer)
        if len(pool) < 8:
            raise ValueError(
                f"the tokenizer gave only {from_text} distinct ids for the built-in text, and only "
                f"{len(pool)} of its first {_VOCAB_SCAN} ids decode to a word that encodes back to itself"
            )
        self.pool = pool

    def ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.choice(self.pool) for _ in range(n)]

    def request(
        self, ids: list[int], output_len: int, rng: random.Random, group: int | None = None
    ) -> BenchRequest:
        """A request of len(ids) prompt tokens. Text is decoded from a few surplus ids, then cut (at its end)
        until the server's tokenization of it, special tokens included, has the target length."""
        if not self.as_text:
            return BenchRequest(len(ids), output_len, input_ids=ids, group=group)
        target = len(ids)
        text = self.tokenizer.decode(ids + self.ids(rng, target // 8 + 8))
        n = len(self.tokenizer.encode(text))
        for _ in range(4):
            if n <= target:
                break
            canonical = self.tokenizer.encode(text, add_special_tokens=False)
            text = self.tokenizer.decode(canonical[: max(len(canonical) - (n - target), 1)])
            n = len(self.tokenizer.encode(text))
        return BenchRequest(n, output_len, text=text, group=group)

    def text_request(self, text: str, output_len: int) -> BenchRequest:
        ids = self.tokenizer.encode(text)
        if self.as_text:
            return BenchRequest(len(ids), output_len, text=text)
        return BenchRequest(len(ids), output_len, input_ids=ids)


def _lengths(rng: random.Random, n: int, full: int, ratio: float) -> list[int]:
    low = max(int(full * ratio), 1)
    return [rng.randint(low, max(full, low)) for _ in range(n)]


def random_workload(b: PromptBuilder, args: argparse.Namespace, rng: random.Random) -> list[BenchRequest]:
    n = args.num_prompts
    ins = _lengths(rng, n, args.random_input_len, args.random_range_ratio)
    outs = _lengths(rng, n, args.random_output_len, args.random_range_ratio)
    return [b.request(b.ids(rng, i), o, rng) for i, o in zip(ins, outs)]


def long_doc_workload(b: PromptBuilder, args: argparse.Namespace, rng: random.Random) -> list[BenchRequest]:
    """--num-prompts unique documents, their lengths cycling through --long-doc-lens (cold prefill each)."""
    lens = sorted(args.long_doc_lens)
    return [b.request(b.ids(rng, lens[i % len(lens)]), args.output_len, rng) for i in range(args.num_prompts)]


def shared_prefix_workload(
    b: PromptBuilder, args: argparse.Namespace, rng: random.Random
) -> list[BenchRequest]:
    """D documents x Q questions, document-major (RAG over a few documents, or turns of a conversation)."""
    out = []
    for d in range(args.shared_prefix_docs):
        doc = b.ids(rng, args.shared_prefix_doc_len)
        for _ in range(args.shared_prefix_questions):
            question = b.ids(rng, args.shared_prefix_question_len)
            out.append(b.request(doc + question, args.output_len, rng, d))
    return out


def multi_turn_workload(b: PromptBuilder, args: argparse.Namespace, rng: random.Random) -> list[BenchRequest]:
    """C conversations x T turns (agents, chat): a conversation opens with --multi-turn-first-len tokens;
    each later turn re-sends everything so far, a canned --output-len-token reply to the last turn, and
    --multi-turn-turn-len new tokens, once the previous turn has finished (`after`). Turn-major order, so the
    conversations interleave. Text prompts extend the previous turn's text exactly (pieces decoded apart)."""
    convs, turns = args.multi_turn_conversations, args.multi_turn_turns
    history_ids: list[list[int]] = []
    history_text: list[str] = []
    for _ in range(convs):
        opening = b.ids(rng, args.multi_turn_first_len)
        history_ids.append(opening)
        history_text.append(b.tokenizer.decode(opening) if b.as_text else "")
    out: list[BenchRequest] = []
    index_of: dict[int, int] = {}  # conversation -> its last turn's index in `out`
    for turn in range(turns):
        for c in range(convs):
            if turn:
                new = b.ids(rng, args.output_len) + b.ids(rng, args.multi_turn_turn_len)  # reply + question
                history_ids[c] = history_ids[c] + new
                if b.as_text:
                    history_text[c] = _join(history_text[c], b.tokenizer.decode(new))
            after = index_of.get(c)
            if b.as_text:
                text = history_text[c]
                req = BenchRequest(
                    len(b.tokenizer.encode(text)), args.output_len, text=text, group=c, after=after
                )
            else:
                ids = history_ids[c]
                req = BenchRequest(len(ids), args.output_len, input_ids=list(ids), group=c, after=after)
            index_of[c] = len(out)
            out.append(req)
    return out


def _join(text: str, piece: str) -> str:
    """text + piece, with a space between when neither side has one (a word-level tokenizer's decode has no
    leading space: "w5" + "w6 w7" would read as the one unknown word "w5w6")."""
    if text and piece and not text[-1].isspace() and not piece[0].isspace():
        return text + " " + piece
    return text + piece


def jsonl_workload(b: PromptBuilder, args: argparse.Namespace, rng: random.Random) -> list[BenchRequest]:
    """One {"prompt": str, "output_len": int} per line; the first --num-prompts lines (all when 0)."""
    if not args.dataset_path:
        raise ValueError('--dataset jsonl needs --dataset-path FILE (one {"prompt": ...} per line)')
    out = []
    with open(args.dataset_path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                prompt = item["prompt"]
                output_len = int(item.get("output_len") or args.output_len)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f'{args.dataset_path}:{lineno}: expected {{"prompt": str, "output_len": int}}: {e}'
                ) from None
            out.append(b.text_request(prompt, output_len))
            if args.num_prompts and len(out) >= args.num_prompts:
                break
    if not out:
        raise ValueError(f"{args.dataset_path} holds no prompts")
    return out


_BUILDERS = {
    "random": random_workload,
    "long-doc": long_doc_workload,
    "shared-prefix": shared_prefix_workload,
    "multi-turn": multi_turn_workload,
    "jsonl": jsonl_workload,
}


def build_workload(args: argparse.Namespace, builder: PromptBuilder) -> list[BenchRequest]:
    """The workload of `args.dataset`, the same for the same --seed and tokenizer."""
    return _BUILDERS[args.dataset](builder, args, random.Random(args.seed))


def warmup_requests(builder: PromptBuilder, num: int, seed: int) -> list[BenchRequest]:
    """Short prompts unlike the workload's (their own seed), so warm-up leaves no useful prefix behind."""
    rng = random.Random(seed + 1_000_003)
    return [builder.request(builder.ids(rng, 16), 4, rng) for _ in range(num)]


def arrival_delays(num: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: Poisson arrivals at `rate` per second; zeros when rate is inf."""
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed + 7)
    return [rng.expovariate(rate) for _ in range(num)]
