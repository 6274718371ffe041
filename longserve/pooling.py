"""What the offline API (`LLM.embed`, `LLM.score`) and the server's /v1/embeddings, /v1/rerank and /v1/score
share: vLLM's output shapes, the pairing of queries with documents, and how a (query, document) pair becomes
one reranker prompt.

A pair is tokenized as the tokenizer's text pair (`tokenizer(query, document)`), as vLLM's score API does
for a cross-encoder: the query's tokens come first in every prompt of a call, so the documents' prompts
share their leading pages (`shared_prefix_len`), which the engine computes once (PoolingParams.prefix_group).
For Qwen3-Reranker the caller formats the query with the model card's instruction prefix and each document
with its suffix, as vLLM's examples do. An embedding model scores a pair by the cosine similarity of the two
embeddings, as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    """One prompt's result (vLLM's EmbeddingRequestOutput / ScoringRequestOutput): `.outputs.embedding` or
    `.outputs.score`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ScoringOutput
    cached_tokens: int = 0
    finished: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def pair_up(first: Sequence[Any], second: Sequence[Any]) -> list[tuple[Any, Any]]:
    """vLLM's pairing of text_1 with text_2: one with each of N, or N with N element by element."""
    if not first or not second:
        raise ValueError("both sides of a score request need at least one text")
    if len(first) == 1:
        return [(first[0], s) for s in second]
    if len(first) != len(second):
        raise ValueError(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1 for all of text_2, or "
            "as many of each"
        )
    return list(zip(first, second))


def encode_pair(tokenizer: Any, query: str, document: str, add_special_tokens: bool = True) -> list[int]:
    """The token ids of one reranker prompt: the tokenizer's text pair (query first)."""
    return list(tokenizer(query, document, add_special_tokens=add_special_tokens)["input_ids"])


def shared_prefix_len(prompts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every prompt shares."""
    if not prompts:
        return 0
    first, n = prompts[0], min(len(p) for p in prompts)
    for i in range(n):
        t = first[i]
        if any(p[i] != t for p in prompts[1:]):
            return i
    return n


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0
