"""Pooling models through the offline API (LLM.embed, LLM.score) against transformers on the same tiny
checkpoints: an embedding is the normalized last hidden state at the last token (cosine 1.0 at fp32), a
causal reranker's score the sigmoid of its yes/no logit difference there, a converted one's the sigmoid of
its score head; with the prefix cache on and off, chunked prefill, and no page leaked."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from longserve import LLM
from longserve.models.pooler import resolve_pooler
from longserve.pooling_params import PoolingParams
from longserve.sampling_params import SamplingParams
from longserve.testing.checkpoints import make_tiny_checkpoint
from longserve.testing.pooling_checkpoints import (
    RERANKER_OVERRIDES,
    make_tiny_embedding_checkpoint,
    make_tiny_score_head_checkpoint,
)

transformers = pytest.importorskip("transformers")

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Weather reports said rain would arrive by evening, with strong wind from the west and cold air.",
    "Readers borrowed books about history, science, cooking, gardening and travel. " * 3,
]
QUERY = (
    "<Instruct>: Given a question, find the passages that answer it\n<Query>: what did the readers borrow?\n"
)
DOCS = [
    "<Document>: Readers borrowed books about history and travel.",
    "<Document>: The river was quiet and the boats waited by the old stone bridge.",
    "<Document>: yes or no",
    "<Document>: Numbers such as 1, 2, 3, 42 appear in tables.",
]


@pytest.fixture(scope="module")
def embed_ckpt(tmp_path_factory):
    return make_tiny_embedding_checkpoint(tmp_path_factory.mktemp("embed"))


@pytest.fixture(scope="module")
def causal_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def tokenizer(causal_ckpt):
    return transformers.AutoTokenizer.from_pretrained(causal_ckpt)


def make_llm(path, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("page_size", 4)
    return LLM(path, **kw)


def hf_embeddings(path, tokenizer, texts):
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for t in texts:
            ids = tokenizer(t, return_tensors="pt")["input_ids"]
            out.append(model(ids).last_hidden_state[0, -1])
    return out


def hf_yes_no_scores(path, tokenizer, query, docs):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    yes, no = tokenizer.convert_tokens_to_ids(["Ġyes", "Ġno"])
    scores = []
    with torch.no_grad():
        for d in docs:
            ids = tokenizer(query, d, return_tensors="pt")["input_ids"]
            logits = model(ids).logits[0, -1]
            scores.append(torch.sigmoid(logits[yes] - logits[no]).item())
    return scores


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(enable_prefix_caching=False), dict(chunked_prefill_size=8)],
    ids=["cache", "no-cache", "chunked"],
)
def test_embeddings_equal_transformers(embed_ckpt, tokenizer, kw):
    refs = hf_embeddings(embed_ckpt, tokenizer, TEXTS)
    with make_llm(embed_ckpt, **kw) as llm:
        for round_ in range(2):  # the second round over the prefix cache (when on)
            outs = llm.embed(TEXTS)
            for ref, out in zip(refs, outs):
                got = torch.tensor(out.outputs.embedding)
                assert got.shape == ref.shape
                assert F.cosine_similarity(got, ref, dim=0).item() == pytest.approx(1.0, abs=1e-6)
                assert torch.allclose(got, F.normalize(ref, dim=0), atol=1e-5)
            if round_ == 1 and llm.config.enable_prefix_caching:
                assert all(o.cached_tokens > 0 for o in outs)
        short = llm.embed(TEXTS[:1], PoolingParams(dimensions=16))[0].outputs.embedding
        assert torch.allclose(torch.tensor(short), F.normalize(refs[0][:16], dim=0), atol=1e-5)
        raw = llm.embed(TEXTS[:1], PoolingParams(normalize=False))[0].outputs.embedding
        assert torch.allclose(torch.tensor(raw), refs[0], atol=1e-4)
        llm.engine.check_integrity()


def test_embedding_model_refuses_generation_and_vice_versa(embed_ckpt, causal_ckpt):
    with make_llm(embed_ckpt) as llm:
        with pytest.raises(ValueError, match="does not generate text"):
            llm.generate("hello", SamplingParams(max_new_tokens=2))
        with pytest.raises(ValueError, match="dimensions must be at most"):
            llm.embed("hello", PoolingParams(dimensions=65))
        llm.engine.check_integrity()
    with make_llm(causal_ckpt) as llm, pytest.raises(ValueError, match="generates text"):
        llm.embed("hello")


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(enable_prefix_caching=False), dict(chunked_prefill_size=16)],
    ids=["cache", "no-cache", "chunked"],
)
def test_reranker_scores_equal_yes_no_logits(causal_ckpt, tokenizer, kw):
    refs = hf_yes_no_scores(causal_ckpt, tokenizer, QUERY, DOCS)
    with make_llm(causal_ckpt, hf_overrides=RERANKER_OVERRIDES, **kw) as llm:
        assert llm.engine.runner.pooler.task == "classify"
        before = llm.engine.runner.num_tokens_computed
        outs = llm.score(QUERY, DOCS)
        computed = llm.engine.runner.num_tokens_computed - before
        assert [o.outputs.score for o in outs] == pytest.approx(refs, abs=1e-5)
        total = sum(len(o.prompt_token_ids) for o in outs)
        if llm.config.enable_prefix_caching:  # the documents reuse the query's pages, computed once
            assert all(o.cached_tokens > 0 for o in outs[1:])
            assert computed < total - 2 * len(tokenizer(QUERY)["input_ids"])
        else:
            assert computed == total
        pairwise = llm.score([QUERY] * 2, DOCS[:2])
        assert [o.outputs.score for o in pairwise] == pytest.approx(refs[:2], abs=1e-5)
        logits = llm.score(QUERY, DOCS[:1], PoolingParams(activation=False))[0].outputs.score
        assert torch.sigmoid(torch.tensor(logits)).item() == pytest.approx(refs[0], abs=1e-5)
        llm.engine.check_integrity()


def test_score_head_reranker_equals_sequence_classification(tmp_path, tokenizer):
    path = make_tiny_score_head_checkpoint(tmp_path / "seqcls")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        refs = [
            torch.sigmoid(model(tokenizer(QUERY, d, return_tensors="pt")["input_ids"]).logits[0, 0]).item()
            for d in DOCS
        ]
    with make_llm(path) as llm:  # architecture Qwen3ForSequenceClassification: a reranker, unasked
        assert llm.engine.runner.pooler.score_head
        assert [o.outputs.score for o in llm.score(QUERY, DOCS)] == pytest.approx(refs, abs=1e-5)
        llm.engine.check_integrity()


def test_embedding_model_scores_by_cosine(embed_ckpt, tokenizer):
    refs = hf_embeddings(embed_ckpt, tokenizer, [QUERY, *DOCS[:2]])
    with make_llm(embed_ckpt) as llm:
        outs = llm.score(QUERY, DOCS[:2])
    for ref, out in zip(refs[1:], outs):
        assert out.outputs.score == pytest.approx(F.cosine_similarity(refs[0], ref, dim=0).item(), abs=1e-5)


def test_resolve_pooler(causal_ckpt, embed_ckpt, tmp_path):
    causal = transformers.AutoConfig.from_pretrained(causal_ckpt)
    assert resolve_pooler("auto", "auto", causal, causal_ckpt) is None  # a plain causal LM generates
    assert resolve_pooler("pooling", "auto", causal, causal_ckpt).task == "embed"  # --runner pooling
    assert resolve_pooler("auto", "embed", causal, causal_ckpt).task == "embed"  # --task embed
    with pytest.raises(ValueError, match="classifier_from_token"):
        resolve_pooler("pooling", "classify", causal, causal_ckpt)
    with pytest.raises(ValueError, match="needs runner='pooling'"):
        resolve_pooler("generate", "embed", causal, causal_ckpt)
    embed = transformers.AutoConfig.from_pretrained(embed_ckpt)
    spec = resolve_pooler("auto", "auto", embed, embed_ckpt)  # sentence-transformers files: embed
    assert (spec.task, spec.normalize, spec.matryoshka, spec.base_architecture) == (
        "embed",
        True,
        True,
        "Qwen3ForCausalLM",
    )
    assert resolve_pooler("generate", "auto", embed, embed_ckpt) is None
    mean = tmp_path / "mean"
    mean.mkdir()
    (mean / "modules.json").write_text(json.dumps([{"path": "1_Pooling", "type": "x.Pooling"}]))
    os.makedirs(mean / "1_Pooling")
    (mean / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    with pytest.raises(ValueError, match="'mean' pooling"):
        resolve_pooler("auto", "auto", embed, str(mean))
