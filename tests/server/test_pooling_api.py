"""Embeddings and rerank through real server processes and real clients: the `openai` client's
embeddings.create (float and base64) equals transformers' normalized last hidden state at the last token
(cosine 1.0 at fp32), /v1/rerank and /v1/score equal the sigmoid of the yes/no logit difference computed
with transformers; the embedding server runs without the prefix cache, the reranker with it (the documents
reuse the query's pages), both with small chunks; no page is leaked."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from longserve.testing.checkpoints import make_tiny_checkpoint
from longserve.testing.pooling_checkpoints import RERANKER_OVERRIDES, make_tiny_embedding_checkpoint
from tests.server.conftest import ServerProcess

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
F = torch.nn.functional

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Weather reports said rain would arrive by evening, with strong wind from the west and cold air at night.",
    "Readers borrowed books about history, science, cooking, gardening and travel. " * 2,
]
QUERY = (
    "<Instruct>: Given a question, find the passages that answer it\n<Query>: what did the readers borrow?\n"
)
DOCS = [
    "<Document>: Readers borrowed books about history and travel.",
    "<Document>: The river was quiet and the boats waited by the old stone bridge.",
    "<Document>: yes or no",
]


def start(args, tmp_path_factory, name):
    args = [*args, "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "8192"]
    proc = ServerProcess(args, str(tmp_path_factory.mktemp("logs") / f"{name}.log"))
    return proc.wait_ready()


@pytest.fixture(scope="module")
def embed_ckpt(tmp_path_factory):
    return make_tiny_embedding_checkpoint(tmp_path_factory.mktemp("embed"))


@pytest.fixture(scope="module")
def rerank_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("rerank"), "qwen3")


@pytest.fixture(scope="module")
def embed_server(embed_ckpt, tmp_path_factory):
    """Found an embedding model by its sentence-transformers files; prefix cache off, 16-token chunks."""
    args = ["--model-path", embed_ckpt, "--served-model-name", "tiny-embed", "--disable-radix-cache"]
    args += [
        "--chunked-prefill-size",
        "16",
        "--hf-overrides",
        json.dumps({"matryoshka_dimensions": [16, 32, 64]}),
    ]
    proc = start(args, tmp_path_factory, "embed")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def rerank_server(rerank_ckpt, tmp_path_factory):
    """The causal checkpoint served as vLLM serves Qwen3-Reranker (--hf-overrides); prefix cache on."""
    args = [
        "--model-path",
        rerank_ckpt,
        "--hf-overrides",
        json.dumps(RERANKER_OVERRIDES),
        "--runner",
        "pooling",
    ]
    args += ["--chunked-prefill-size", "32", "--page-size", "4"]
    proc = start(args, tmp_path_factory, "rerank")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def tokenizer(rerank_ckpt):
    return transformers.AutoTokenizer.from_pretrained(rerank_ckpt)


def client_for(server):
    import httpx

    return httpx.Client(base_url=server.url, timeout=60.0)


def assert_no_leak(server):
    with client_for(server) as c:
        info = c.get("/server_info", params={"check_integrity": "1"}).json()
    assert info["kv_integrity"] == "ok" and info["num_unfinished_requests"] == 0


def hf_embeddings(path, tokenizer, inputs):
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return [
            model(
                torch.tensor([ids if isinstance(ids, list) else tokenizer(ids)["input_ids"]])
            ).last_hidden_state[0, -1]
            for ids in inputs
        ]


def hf_scores(path, tokenizer, query, docs):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    yes, no = tokenizer.convert_tokens_to_ids(["Ġyes", "Ġno"])
    with torch.no_grad():
        logits = [model(tokenizer(query, d, return_tensors="pt")["input_ids"]).logits[0, -1] for d in docs]
    return [torch.sigmoid(lg[yes] - lg[no]).item() for lg in logits]


@pytest.mark.parametrize("encoding_format", ["float", "base64", None])
def test_openai_embeddings_equal_transformers(embed_server, embed_ckpt, tokenizer, encoding_format):
    oai = openai.OpenAI(base_url=embed_server.url + "/v1", api_key="unused", max_retries=0)
    kw = {} if encoding_format is None else {"encoding_format": encoding_format}  # None: the client's base64
    r = oai.embeddings.create(model="tiny-embed", input=TEXTS, **kw)
    refs = hf_embeddings(embed_ckpt, tokenizer, TEXTS)
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == "tiny-embed"
    for ref, d in zip(refs, r.data):
        vector = d.embedding
        if encoding_format == "base64":  # asked for explicitly, the client hands the string over as is
            vector = np.frombuffer(base64.b64decode(vector), dtype="<f4").tolist()
        got = torch.tensor(vector, dtype=torch.float32)
        assert F.cosine_similarity(got, ref, dim=0).item() == pytest.approx(1.0, abs=1e-6)
        assert torch.allclose(got, F.normalize(ref, dim=0), atol=1e-5)
    assert r.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS) == r.usage.total_tokens


def test_token_ids_and_dimensions(embed_server, embed_ckpt, tokenizer):
    oai = openai.OpenAI(base_url=embed_server.url + "/v1", api_key="unused", max_retries=0)
    ids = [tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    refs = hf_embeddings(embed_ckpt, tokenizer, ids)
    r = oai.embeddings.create(model="tiny-embed", input=ids, encoding_format="float", dimensions=16)
    for ref, d in zip(refs, r.data):
        assert len(d.embedding) == 16
        assert torch.allclose(torch.tensor(d.embedding), F.normalize(ref[:16], dim=0), atol=1e-5)
    one = oai.embeddings.create(model="tiny-embed", input=ids[0], encoding_format="float")
    assert torch.allclose(torch.tensor(one.data[0].embedding), F.normalize(refs[0], dim=0), atol=1e-5)
    with pytest.raises(openai.BadRequestError, match="matryoshka dimensions"):
        oai.embeddings.create(model="tiny-embed", input="hi", dimensions=8)
    assert_no_leak(embed_server)


def test_sglang_encode(embed_server, embed_ckpt, tokenizer):
    refs = hf_embeddings(embed_ckpt, tokenizer, TEXTS[:2])
    with client_for(embed_server) as c:
        one = c.post("/encode", json={"text": TEXTS[0]}).json()
        batch = c.post("/encode", json={"input_ids": [tokenizer(t)["input_ids"] for t in TEXTS[:2]]}).json()
    assert torch.allclose(torch.tensor(one["embedding"]), F.normalize(refs[0], dim=0), atol=1e-5)
    assert one["meta_info"]["prompt_tokens"] == len(tokenizer(TEXTS[0])["input_ids"])
    for ref, item in zip(refs, batch):
        assert torch.allclose(torch.tensor(item["embedding"]), F.normalize(ref, dim=0), atol=1e-5)


def test_embedding_model_scores_by_cosine(embed_server, embed_ckpt, tokenizer):
    refs = hf_embeddings(embed_ckpt, tokenizer, [QUERY, *DOCS])
    with client_for(embed_server) as c:
        r = c.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    want = [F.cosine_similarity(refs[0], ref, dim=0).item() for ref in refs[1:]]
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-5)


BAD_EMBEDDINGS = [
    ({"input": ""}, "empty"),
    ({"input": []}, "empty"),
    ({"input": [[5, 99999]]}, "token ids"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": [5] * 600}, "maximum context length is 512 tokens"),
]


@pytest.mark.parametrize("body,words", BAD_EMBEDDINGS, ids=[w for _, w in BAD_EMBEDDINGS])
def test_bad_embedding_requests(embed_server, body, words):
    with client_for(embed_server) as c:
        r = c.post("/v1/embeddings", json=body)
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"]
        assert c.post("/v1/embeddings", json={"input": "still serving"}).status_code == 200


def test_embedding_server_does_not_generate(embed_server):
    with client_for(embed_server) as c:
        for path, body in (("/v1/completions", {"prompt": "hi"}), ("/generate", {"text": "hi"})):
            r = c.post(path, json=body)
            assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"]
        assert c.get("/model_info").json()["is_generation"] is False
        assert c.get("/health_generate").status_code == 200
    assert_no_leak(embed_server)


def test_rerank_scores_equal_yes_no_logits(rerank_server, rerank_ckpt, tokenizer):
    refs = hf_scores(rerank_ckpt, tokenizer, QUERY, DOCS)
    with client_for(rerank_server) as c:
        r = c.post("/v1/rerank", json={"model": "any-name", "query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        order = sorted(range(len(DOCS)), key=lambda i: -refs[i])
        assert [x["index"] for x in body["results"]] == order
        for x in body["results"]:
            assert x["relevance_score"] == pytest.approx(refs[x["index"]], abs=1e-5)
            assert x["document"] == {"text": DOCS[x["index"]]}
        # the documents after the first found the query's pages in the prefix cache
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * (
            len(tokenizer(QUERY)["input_ids"]) - 4
        )

        docs = [{"text": d} for d in DOCS]
        top = c.post(
            "/rerank", json={"query": QUERY, "documents": docs, "top_n": 1, "return_documents": False}
        )
        assert top.json()["results"] == [
            {"index": order[0], "relevance_score": pytest.approx(refs[order[0]], abs=1e-5)}
        ]

        for body in ({"text_1": QUERY, "text_2": DOCS}, {"queries": [QUERY] * 3, "documents": DOCS}):
            s = c.post("/v1/score", json=body)
            assert s.status_code == 200, s.text
            assert [d["score"] for d in s.json()["data"]] == pytest.approx(refs, abs=1e-5)
    assert_no_leak(rerank_server)


BAD_SCORES = [
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "", "documents": ["d"]}, "empty"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "max_tokens_per_doc": 5}, "max_tokens_per_doc"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "as many of each"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
    ("/v1/embeddings", {"input": "hi"}, "reranker"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "/v1/rerank"),
]


@pytest.mark.parametrize("path,body,words", BAD_SCORES, ids=[w for _, _, w in BAD_SCORES])
def test_bad_score_requests(rerank_server, path, body, words):
    with client_for(rerank_server) as c:
        r = c.post(path, json=body)
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"]
        assert c.post("/v1/score", json={"text_1": "a", "text_2": "b"}).status_code == 200
