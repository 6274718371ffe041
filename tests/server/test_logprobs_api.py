"""Prompt logprobs, logit_bias, best_of and SGLang's sampling keys through a real server process: OpenAI's
completions `echo` (with max_tokens 0, as evaluation harnesses send it), vLLM's prompt_logprobs on both
OpenAI routes, SGLang's return_logprob / logprob_start_len / top_logprobs_num / return_text_in_logprobs,
all against transformers' log-softmax of the same fp32 model, cached or not; bad values are 400s and the
server's KV accounting stays exact."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

TOL = 2e-4
PROMPT = "In the morning the river was quiet and the boats waited by the old stone bridge."


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(tiny_model):
    """(tokenizer, ids -> log-softmax [L, V]) of transformers on the served checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="eager")

    def logsoftmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return AutoTokenizer.from_pretrained(tiny_model), logsoftmax


def expected(ref: torch.Tensor, ids: list[int], start: int = 0) -> list[float]:
    """transformers' logprob of each prompt token after `start` (the entry of `start` itself is None)."""
    return [ref[p - 1, ids[p]].item() for p in range(start + 1, len(ids))]


def close(got, want) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=TOL, rtol=0)


def assert_integrity(client) -> None:
    info = client.get("/server_info", params={"check_integrity": "1"}).json()
    assert info["kv_integrity"] == "ok"


# ---- OpenAI completions: echo ------------------------------------------------------------------------
def test_echo_logprobs_with_max_tokens_0_cached_and_not(oai, client, hf, tiny_model):
    tok, logsoftmax = hf
    ids = tok(PROMPT).input_ids
    ref = logsoftmax(ids)
    client.post("/flush_cache")
    answers = []
    for _ in range(2):  # cold, then with the prompt in the prefix cache
        r = oai.completions.create(model=tiny_model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
        choice = r.choices[0]
        assert choice.text == PROMPT and r.usage.completion_tokens == 0
        lp = choice.logprobs
        assert lp.tokens == [tok.decode([t]) for t in ids] and len(lp.text_offset) == len(ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        close(lp.token_logprobs[1:], expected(ref, ids))
        for p in range(1, len(ids)):  # each position: its own token and the top 2
            top = ref[p - 1].topk(2)
            want = {tok.decode([ids[p]]): ref[p - 1, ids[p]].item()}
            want |= {tok.decode([t]): v for t, v in zip(top.indices.tolist(), top.values.tolist())}
            assert lp.top_logprobs[p].keys() == want.keys()
            close(list(lp.top_logprobs[p].values()), list(want.values()))
        answers.append(lp.token_logprobs)
    assert answers[0] == answers[1]
    # the lm-evaluation-harness shape: token ids in, one generated token after the prompt's logprobs
    r = oai.completions.create(
        model=tiny_model, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and r.choices[0].text.startswith(tok.decode(ids))
    close(lp.token_logprobs[1 : len(ids)], expected(ref, ids))
    close([lp.token_logprobs[-1]], [ref[-1].max().item()])  # greedy: the most likely next token
    assert_integrity(client)


def test_echo_streams_the_prompt_first(oai, hf, tiny_model):
    tok, logsoftmax = hf
    ids = tok(PROMPT).input_ids
    chunks = list(
        oai.completions.create(
            model=tiny_model, prompt=PROMPT, max_tokens=3, echo=True, logprobs=0, temperature=0, stream=True
        )
    )
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT) and first.logprobs.token_logprobs[0] is None
    close(first.logprobs.token_logprobs[1 : len(ids)], expected(logsoftmax(ids), ids))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    plain = oai.completions.create(model=tiny_model, prompt=PROMPT, max_tokens=3, temperature=0)
    assert text == PROMPT + plain.choices[0].text


# ---- vLLM's prompt_logprobs ---------------------------------------------------------------------------
def test_prompt_logprobs_field_on_both_routes(client, hf):
    tok, logsoftmax = hf
    ids = tok(PROMPT).input_ids
    ref = logsoftmax(ids)
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        entry, row = entries[p], ref[p - 1]
        own = entry[str(ids[p])]
        assert own["decoded_token"] == tok.decode([ids[p]])
        close([own["logprob"]], [row[ids[p]].item()])
        assert own["rank"] == int((row > row[ids[p]]).sum()) + 1
        top = row.topk(2)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[str(t)]["rank"] == rank
            close([entry[str(t)]["logprob"]], [v])
    messages = [{"role": "user", "content": PROMPT}]
    chat_ids = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    r = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "prompt_logprobs": 0}
    )
    assert r.status_code == 200, r.text
    entries = r.json()["prompt_logprobs"]  # vLLM puts the chat prompt's beside the choices
    assert len(entries) == len(chat_ids) and entries[0] is None
    close(
        [entries[p][str(chat_ids[p])]["logprob"] for p in range(1, len(chat_ids))],
        expected(logsoftmax(chat_ids), chat_ids),
    )
    for route, body in [
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}),
        ("/v1/chat/completions", {"messages": messages, "prompt_logprobs": 1, "stream": True}),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 41}),
    ]:
        r = client.post(route, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def test_max_logprobs_lets_a_request_ask_past_20_and_caps_it(oai, client, hf, tiny_model):
    """The server runs with --max-logprobs 40 (vLLM's flag; 20 by default): the openai client's chat call with
    top_logprobs 30 gets 30 a token, transformers' likeliest; 41 is a 400 naming the field as each route spells
    it, and nothing is left queued."""
    tok, logsoftmax = hf
    messages = [{"role": "user", "content": PROMPT}]
    chat = oai.chat.completions.create(
        model=tiny_model, messages=messages, max_tokens=1, temperature=0, logprobs=True, top_logprobs=30
    )
    first = chat.choices[0].logprobs.content[0]
    chat_ids = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    want = logsoftmax(chat_ids)[-1].topk(30).values.tolist()
    assert len(first.top_logprobs) == 30
    close([t.logprob for t in first.top_logprobs], want)
    for route, body, param in [
        (
            "/v1/chat/completions",
            {"messages": messages, "logprobs": True, "top_logprobs": 41},
            "top_logprobs",
        ),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 41}, "logprobs"),
        ("/generate", {"text": PROMPT, "return_logprob": True, "top_logprobs_num": 41}, "top_logprobs_num"),
    ]:
        r = client.post(route, json=body)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param, r.text
        assert error["message"] == f"{param} must be at most 40 (max_logprobs, --max-logprobs), got 41"
    # vLLM's -1, every token of the vocabulary: more than 40 here
    body = {"messages": messages, "logprobs": True, "top_logprobs": -1}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    assert r.json()["error"]["message"].endswith(f"got {len(tok)}")
    assert_integrity(client)


# ---- SGLang /generate -----------------------------------------------------------------------------------
def test_generate_input_logprobs(client, hf):
    tok, logsoftmax = hf
    ids = tok(PROMPT).input_ids
    ref = logsoftmax(ids)
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 20,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})  # cache it
    meta = client.post("/generate", json=body).json()["meta_info"]
    assert meta["cached_tokens"] == 16  # the cache supplies the whole pages before logprob_start_len
    entries = meta["input_token_logprobs"]
    assert [t for _, t, _ in entries] == ids[20:] and entries[0][0] is None
    assert [text for _, _, text in entries] == [tok.decode([t]) for t in ids[20:]]
    close([lp for lp, _, _ in entries[1:]], expected(ref, ids, start=20))
    tops = meta["input_top_logprobs"]
    assert tops[0] is None and len(tops) == len(ids) - 20
    for j, p in enumerate(range(21, len(ids)), start=1):
        top = ref[p - 1].topk(2)
        assert [t for _, t, _ in tops[j]] == top.indices.tolist()
        close([lp for lp, _, _ in tops[j]], top.values.tolist())
    out = meta["output_token_logprobs"]
    assert len(out) == 2 and out[0][2] is not None and len(meta["output_top_logprobs"]) == 2
    # SGLang's default (-1): the prompt's last token only; no text unless asked
    meta = client.post("/generate", json={"input_ids": ids, "return_logprob": True}).json()["meta_info"]
    assert meta["input_token_logprobs"] == [[None, ids[-1], None]]
    r = client.post("/generate", json={**body, "logprob_start_len": len(ids)})
    assert r.status_code == 400 and "logprob_start_len" in r.json()["error"]["message"]
    assert_integrity(client)


def test_sglang_sampling_keys(client):
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = client.post("/generate", json={"text": PROMPT, "sampling_params": sp}).json()["text"]
    at = next(i for i in range(1, len(full) - 3) if full.index(full[i : i + 3]) == i)
    stop = full[at : at + 3]
    for keep in (False, True):
        body = {"text": PROMPT, "sampling_params": {**sp, "stop": stop, "no_stop_trim": keep}}
        out = client.post("/generate", json=body).json()
        assert out["text"] == full[: at + (3 if keep else 0)], keep
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        body = {
            "prompt": PROMPT,
            "max_tokens": 12,
            "temperature": 0,
            "stop": stop,
            "include_stop_str_in_output": keep,
        }
        assert (
            client.post("/v1/completions", json=body).json()["choices"][0]["text"] == out["text"]
        )  # vLLM's name
    # the keys sglang.lang sends, and custom_params (carried along; there are no custom logit processors)
    extra = {"spaces_between_special_tokens": True, "custom_params": {"x": 1}, "logit_bias": None}
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": {**sp, **extra}})
    assert r.status_code == 200 and r.json()["text"] == full
    # stream_interval: an event every 4 tokens (12 tokens: 3 events), each with the text so far
    body = {"text": PROMPT, "sampling_params": {**sp, "stream_interval": 4}, "stream": True}
    with client.stream("POST", "/generate", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [e["meta_info"]["completion_tokens"] for e in events] == [4, 8, 12]
    assert events[-1]["text"] == full
    for bad, param in [
        ({"sampling_params": {**sp, "stream_interval": 0}}, "sampling_params.stream_interval"),
        ({"custom_logit_processor": "{}"}, "custom_logit_processor"),
        ({"sampling_params": {**sp, "no_such_key": 1}}, None),
    ]:
        r = client.post("/generate", json={"text": PROMPT, **bad})
        assert r.status_code == 400, r.text
        if param:
            assert r.json()["error"]["param"] == param


# ---- logit_bias --------------------------------------------------------------------------------------
def test_logit_bias_on_both_apis(oai, client, tiny_model):
    greedy = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    base = client.post("/generate", json={"text": PROMPT, "sampling_params": greedy}).json()["output_ids"]
    forced = client.post(
        "/generate", json={"text": PROMPT, "sampling_params": {**greedy, "logit_bias": {"77": 100}}}
    ).json()["output_ids"]
    assert forced == [77] * 5 and base != forced
    r = oai.completions.create(
        model=tiny_model, prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={str(base[0]): -100}
    )
    banned = client.post("/tokenize", json={"prompt": r.choices[0].text, "add_special_tokens": False}).json()
    assert banned["tokens"][0] != base[0]
    r = oai.chat.completions.create(
        model=tiny_model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logit_bias={"77": 100},
    )
    assert (
        r.choices[0].message.content == client.post("/detokenize", json={"tokens": [77] * 3}).json()["text"]
    )
    for bias, words in [({"abc": 1}, "token ids"), ({"5": 150}, "[-100, 100]"), ({"512": 1}, "[0, 512)")]:
        r = client.post("/v1/completions", json={"prompt": PROMPT, "logit_bias": bias})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        r = client.post("/generate", json={"text": PROMPT, "sampling_params": {"logit_bias": bias}})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert_integrity(client)


# ---- best_of -----------------------------------------------------------------------------------------
def test_best_of(client):
    common = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 99, "ignore_eos": True}
    every = client.post("/v1/completions", json={**common, "n": 3, "logprobs": 0}).json()["choices"]
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in every]
    assert len({c["text"] for c in every}) > 1, "identical candidates: the test would prove little"
    best = client.post("/v1/completions", json={**common, "n": 1, "best_of": 3}).json()
    assert [c["text"] for c in best["choices"]] == [every[max(range(3), key=lambda i: sums[i])]["text"]]
    assert best["choices"][0]["logprobs"] is None and best["usage"]["completion_tokens"] == 6
    for body, words in [
        ({"n": 2, "best_of": 1}, "best_of must be an integer >= n (2)"),
        ({"best_of": 2, "stream": True}, "cannot stream"),
        ({"best_of": 1000}, "at most"),
    ]:
        r = client.post("/v1/completions", json={**common, **body})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert_integrity(client)
