"""vLLM's and SGLang's surface on a real server process: any `model` name (and "default"), the admin
endpoints (/v1/models/{id}, /version, /ping, /health_generate, /abort_request, GET and POST /flush_cache),
the context-length error as LiteLLM and LangChain map it (their real clients raise their context-window
errors), unsupported fields refused with a 400 naming them, and vLLM's published Grafana dashboards
(vendored in dashboards/, sources in each file) finding every series they query under --metrics-names vllm."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import pytest

from longserve import __version__
from longserve.testing.checkpoints import CHAT_TEMPLATE
from tests.server.conftest import ServerProcess

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

DASHBOARDS = Path(__file__).parent / "dashboards"
NAME = "tiny-compat"
CONTEXT = 512
MSGS = [{"role": "user", "content": "Hello there"}]
TOO_LONG = "The library opened at nine. " * 200  # ~1,200 tokens: over the 512-token context


# the tiny model's template with a marker: --chat-template replaces the tokenizer's
SERVED_TEMPLATE = CHAT_TEMPLATE.replace("{{ bos_token }}", "{{ bos_token }}[served]")


@pytest.fixture(scope="module")
def compat_server(tiny_model, tmp_path_factory):
    """Launched as a vLLM user would: the model positional (`vllm serve MODEL`), --trust-remote-code,
    --swap-space, --data-parallel-size 1 and --chat-template FILE; lenient model names (the default),
    vLLM's metric names."""
    logs = tmp_path_factory.mktemp("logs")
    template = logs / "served.jinja"
    template.write_text(SERVED_TEMPLATE)
    args = [tiny_model, "--device", "cpu", "--dtype", "float32"]
    args += ["--served-model-name", NAME, "--context-length", str(CONTEXT), "--max-total-tokens", "8192"]
    args += ["--metrics-names", "vllm", "--trust-remote-code", "--swap-space", "4"]
    args += ["--data-parallel-size", "1", "--chat-template", str(template)]
    proc = ServerProcess(args, str(logs / "compat.log")).wait_ready()
    yield proc
    proc.stop()


@pytest.fixture
def c(compat_server):
    with httpx.Client(base_url=compat_server.url, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def oai(compat_server):
    return openai.OpenAI(base_url=compat_server.url + "/v1", api_key="unused", max_retries=0)


# ---- model names and admin endpoints -----------------------------------------------------------------
@pytest.mark.parametrize("model", ["default", NAME, "gpt-4o"])
def test_any_model_name_is_served(oai, model):
    r = oai.chat.completions.create(model=model, messages=MSGS, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


def test_strict_model_name_is_a_404(server):  # the shared server runs with --strict-model-name
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "gpt-4o", "messages": MSGS})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.post(server.url + "/v1/chat/completions", json={"model": "default", "messages": MSGS,
                                                                  "max_tokens": 1}).status_code == 200  # fmt: skip


def test_retrieve_model(oai, c):
    assert oai.models.retrieve(NAME).id == NAME
    card = c.get("/v1/models/default").json()
    assert card["id"] == NAME and card["max_model_len"] == CONTEXT
    r = c.get("/v1/models/other-model")
    assert r.status_code == 404 and "other-model" in r.json()["error"]["message"]


def test_version_ping_health_generate_flush(c):
    assert c.get("/version").json() == {"version": __version__}
    assert c.get("/ping").status_code == 200 and c.post("/ping").status_code == 200
    r = c.get("/health_generate")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    for method in ("GET", "POST"):
        r = c.request(method, "/flush_cache")
        assert r.status_code == 200 and "flushed_pages" in r.json()


def _generate_in_thread(url: str, body: dict) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        result["response"] = httpx.post(url + "/generate", json=body, timeout=120)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def _wait_inflight(c, n: int) -> None:
    end = time.monotonic() + 30
    while c.get("/server_info").json()["num_unfinished_requests"] < n:
        assert time.monotonic() < end, "the request never started"
        time.sleep(0.05)


@pytest.mark.parametrize("by", ["rid", "abort_all"])
def test_abort_request(compat_server, c, by):
    long = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}
    thread, result = _generate_in_thread(compat_server.url, {"text": "Once", "sampling_params": long,
                                                             "rid": f"abort-me-{by}"})  # fmt: skip
    _wait_inflight(c, 1)
    body = {"rid": f"abort-me-{by}"} if by == "rid" else {"abort_all": True}
    assert c.post("/abort_request", json=body).status_code == 200
    thread.join(60)
    out = result["response"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < out["meta_info"]["completion_tokens"] < 400
    assert c.post("/abort_request", json={"rid": "no-such-request"}).status_code == 200  # as SGLang
    assert c.post("/abort_request", json={}).status_code == 400
    info = c.get("/server_info", params={"check_integrity": "1"}).json()
    assert info["kv_integrity"] == "ok" and info["num_unfinished_requests"] == 0


# ---- the context-length error ------------------------------------------------------------------------
def test_context_length_error_is_worded_as_openai(c):
    r = c.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": TOO_LONG}], "max_tokens": 10}
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["type"] == "invalid_request_error" and err["param"] == "messages"
    m = re.fullmatch(
        r"This model's maximum context length is 512 tokens\. However, you requested (\d+) tokens \((\d+) in the "
        r"messages, 10 in the completion\)\. Please reduce the length of the messages or completion\. "
        r"\(context_length_exceeded\)",
        err["message"],
    )
    assert m and int(m.group(1)) == int(m.group(2)) + 10
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 600})
    assert r.json()["error"]["message"].startswith(
        "This model's maximum context length is 512 tokens, however"
    )


def test_litellm_raises_context_window_exceeded(compat_server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at import
    litellm = pytest.importorskip("litellm")
    for model in (f"openai/{NAME}", f"hosted_vllm/{NAME}"):
        with pytest.raises(litellm.ContextWindowExceededError):
            litellm.completion(
                model=model,
                api_base=compat_server.url + "/v1",
                api_key="unused",
                messages=[{"role": "user", "content": TOO_LONG}],
                max_tokens=8,
                num_retries=0,
            )
    ok = litellm.completion(model=f"openai/{NAME}", api_base=compat_server.url + "/v1", api_key="unused",
                            messages=MSGS, max_tokens=3, temperature=0)  # fmt: skip
    assert ok.usage.completion_tokens == 3


def test_langchain_raises_context_overflow(compat_server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.exceptions import ContextOverflowError

    chat = langchain_openai.ChatOpenAI(
        model=NAME, base_url=compat_server.url + "/v1", api_key="unused", max_retries=0, max_tokens=8
    )
    with pytest.raises(ContextOverflowError):
        chat.invoke(TOO_LONG)
    assert chat.invoke("Hello there").content is not None


# ---- fields: honoured, accepted as no-ops, or refused by name ----------------------------------------
REFUSED = [
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}]),
    ("/v1/chat/completions", "reasoning_effort", "low"),
    ("/v1/chat/completions", "use_beam_search", True),
    ("/v1/completions", "truncate_prompt_tokens", 10),
    ("/v1/completions", "tempreature", 0.5),  # a typo is not a silent default
    ("/v1/chat/completions", "chat_template", "{{ messages }}"),
]


@pytest.mark.parametrize("path,field,value", REFUSED, ids=[f for _, f, _ in REFUSED])
def test_unsupported_fields_are_400s_naming_them(c, path, field, value):
    body = {"messages": MSGS} if "chat" in path else {"prompt": "hi"}
    r = c.post(path, json={**body, field: value, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and repr(field) in err["message"]


def test_stream_options_fields(c):
    bad = c.post("/v1/chat/completions", json={"messages": MSGS, "stream": True,
                                                "stream_options": {"continuous_usage_stats": True}})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_options.continuous_usage_stats"
    ok = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "stream": True,
                                               "stream_options": {"include_usage": True, "include_obfuscation": False}})  # fmt: skip
    assert ok.status_code == 200 and ok.text.rstrip().endswith("data: [DONE]")


def test_harmless_fields_are_accepted(oai):
    r = oai.chat.completions.create(
        model=NAME, messages=MSGS, max_tokens=3, temperature=0, user="u-1", store=False,
        metadata={"team": "rag"}, service_tier="auto", extra_body={"safety_identifier": "s", "prompt_cache_key": "k"},
    )  # fmt: skip
    plain = oai.chat.completions.create(model=NAME, messages=MSGS, max_tokens=3, temperature=0)
    assert r.choices[0].message.content == plain.choices[0].message.content  # no effect on the output


# ---- vLLM's launch line, SGLang's /generate fields ----------------------------------------------------
def test_vllm_launch_line_is_served(compat_server, c):
    """The fixture's vLLM-style flags started the server: the no-op ones are said once in its log, and the
    --chat-template file renders chats (the tokenizer's own template has no marker)."""
    log = compat_server.log()
    assert log.count("trust_remote_code (--trust-remote-code) has no effect") == 1
    assert "swap_space=4.0 GiB (--swap-space) has no effect" in log
    for add_generation_prompt in (True, False):
        r = c.post("/tokenize", json={"messages": MSGS, "add_generation_prompt": add_generation_prompt})
        text = c.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["text"]
        assert "[served]<|im_start|>user\nHello there<|im_end|>" in text
        assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
        c.post("/tokenize", json={"messages": MSGS}).json()["tokens"]
    )


GENERATE = {"text": "The library", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}


@pytest.mark.parametrize(
    "extra,field,message",
    [
        (
            {"max_new_tokens": 3},
            "max_new_tokens",
            "unknown field 'max_new_tokens'",
        ),  # belongs in sampling_params
        ({"modle": "x", "tempreature": 0}, "modle", "unknown fields 'modle', 'tempreature'"),
        ({"image_data": "cat.png"}, "image_data", "multimodal inputs are not supported"),
        ({"lora_path": "adapter"}, "lora_path", "LoRA adapters are not supported"),
        ({"return_hidden_states": True}, "return_hidden_states", "unsupported field"),
        ({"session_params": {"id": "s"}}, "session_params", "sessions are not supported"),
    ],
)
def test_generate_refuses_unknown_and_unsupported_fields(c, extra, field, message):
    """SGLang ignores a field its GenerateReqInput does not declare; longserve names it, as on /v1."""
    r = c.post("/generate", json={**GENERATE, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == field


def test_generate_accepts_sglangs_own_fields(c):
    """SGLang's routing/logging hints, and its other fields at their defaults (what a client that sends
    every field sends; SGLang's Runtime.generate sends top_logprobs_num and lora_path as null)."""
    plain = c.post("/generate", json=GENERATE).json()
    hints = {"session_id": "s1", "log_metrics": False, "routed_dp_rank": 0, "custom_labels": {"team": "a"},
             "no_logs": True, "routing_key": "k"}  # fmt: skip
    defaults = {"image_data": None, "lora_path": None, "return_hidden_states": False, "top_logprobs_num": None,
                "logprob_start_len": None, "return_logprob": None, "routed_experts_start_len": 0,
                "token_ids_logprob": []}  # fmt: skip
    for extra in (hints, defaults):
        r = c.post("/generate", json={**GENERATE, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == plain["output_ids"]


@pytest.mark.parametrize(
    "path,body,message",
    [
        ("/tokenize", {"prompt": "hi", "bogus": 1}, "unknown field 'bogus'"),
        (
            "/tokenize",
            {"messages": MSGS, "chat_template": "{{ messages }}"},
            "cannot bring its own chat template",
        ),
        ("/detokenize", {"tokens": [5], "skip_special": True}, "unknown field 'skip_special'"),
    ],
)
def test_tokenize_routes_refuse_unknown_fields(c, path, body, message):
    r = c.post(path, json=body)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


# ---- vLLM's Grafana dashboards -----------------------------------------------------------------------
def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(vllm:[A-Za-z0-9_:]+)", expr))


@pytest.mark.parametrize("dashboard", ["vllm_grafana.json", "vllm_grafana_v0.json"])
def test_vllm_dashboard_queries_find_their_series(compat_server, c, oai, dashboard):
    from prometheus_client.parser import text_string_to_metric_families

    # traffic: streamed tokens (inter-token latency), finished, aborted and refused requests
    for stream in (False, True):
        r = oai.chat.completions.create(model=NAME, messages=MSGS, max_tokens=6, temperature=0, stream=stream)
        if stream:
            assert len([chunk for chunk in r]) > 2
    c.post("/v1/completions", json={"prompt": TOO_LONG})
    samples = [s for family in text_string_to_metric_families(c.get("/metrics").text) for s in family.samples]
    ours = {
        s.name for s in samples if s.labels.get("model_name") == NAME
    }  # $model_name: label_values(model_name)

    board = json.loads((DASHBOARDS / dashboard).read_text())
    assert board["templating"]["list"][1]["query"]["query"] == "label_values(model_name)"
    queried = set()
    for panel in board["panels"]:
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, target["expr"]
            missing = names - ours
            assert not missing, f"panel {panel['title']!r} queries {sorted(missing)}, absent from /metrics"
            queried |= names
    assert len(queried) >= 15
    by_name = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s)
    assert {s.labels["finished_reason"] for s in by_name["vllm:request_success_total"]} >= {
        "length",
        "rejected",
    }
    for counted in ("vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count",
                    "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):  # fmt: skip
        assert by_name[counted][0].value > 0, counted
    itl = (
        "vllm:inter_token_latency_seconds_count"
        if dashboard == "vllm_grafana.json"
        else "vllm:time_per_output_token_seconds_count"
    )
    assert by_name[itl][0].value > 0
