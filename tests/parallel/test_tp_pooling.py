"""A reranker over two CPU ranks (gloo) gives TP=1's scores: it scores with its LM head's yes/no rows, of
which every rank holds a vocabulary slice, so each computes its slice of the logits (all-gathered) before
rank 0 picks the two columns. (An embedding model needs no collective: the last hidden state is whole on
every rank.)"""

from __future__ import annotations

import pytest

from longserve import LLM
from longserve.testing.checkpoints import make_tiny_checkpoint
from longserve.testing.pooling_checkpoints import RERANKER_OVERRIDES

QUERY = "<Query>: what did the readers borrow at the library today?\n"
DOCS = ["<Document>: books about history and travel", "<Document>: the river was quiet", "<Document>: yes"]


def scores(path: str, tp: int) -> list[float]:
    with LLM(path, device="cpu", dtype="float32", max_total_tokens=2048, page_size=4, tp_size=tp,
             hf_overrides=RERANKER_OVERRIDES) as llm:  # fmt: skip
        return [o.outputs.score for o in llm.score(QUERY, DOCS)]


def test_tp2_reranker_equals_tp1(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    expected = scores(path, 1)
    assert len(set(expected)) == len(DOCS)
    assert scores(path, 2) == pytest.approx(expected, abs=1e-5)
