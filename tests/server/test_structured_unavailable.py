"""A server whose xgrammar does not import (installed with `.[server]` alone, or a wheel missing its own
dependency: on the GPU machine xgrammar without `apache-tvm-ffi` raised "No module named 'tvm_ffi'" at the first
constrained request, which the client got as a 500) refuses each request asking for an output constraint with a
400 that names the field and says how to install it, through the openai client and SGLang's /generate, and keeps
serving every other request with every page back. Offline, the compiler raises the same reason."""

from __future__ import annotations

import os
import sys

import httpx
import pytest

from longserve.structured.grammar import GrammarCompiler, StructuredOutputsUnavailable
from longserve.testing.server_process import REPO, ServerProcess
from tests.fixtures.tool_checkpoints import make_tool_checkpoint

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The Qwen2.5-style tool checkpoint served with an xgrammar package that fails to import as the GPU machine's
    did (its own dependency missing), ahead of the real one on the path."""
    broken = tmp_path_factory.mktemp("broken-xgrammar")
    (broken / "xgrammar").mkdir()
    (broken / "xgrammar" / "__init__.py").write_text("from tvm_ffi_not_installed import register_error\n")
    path = make_tool_checkpoint(tmp_path_factory.mktemp("qwen25"), "qwen25")
    args = ["--model-path", path, "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "8192"]
    args += ["--served-model-name", "qwen25", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    env = {"PYTHONPATH": os.pathsep.join([str(broken), REPO, os.environ.get("PYTHONPATH", "")])}
    proc = ServerProcess(args, str(tmp_path_factory.mktemp("logs") / "server.log"), env=env)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _refused(err: Exception, field: str) -> None:
    message = str(err)
    assert "structured outputs are not available on this server" in message, message
    assert (
        "tvm_ffi_not_installed" in message
        and "pip install xgrammar (longserve's `structured` extra)" in message
    ), message
    assert field in message, message


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "w", "schema": {"type": "object"}},
                }
            },
            "response_format",
        ),  # fmt: skip
        ({"tools": TOOLS, "tool_choice": "required"}, "tools"),  # the grammar of the tools forced
        ({"extra_body": {"structured_outputs": {"regex": "[0-9]+"}}}, "structured_outputs"),
    ],
    ids=["json_object", "json_schema", "forced_tool", "vllm_regex"],
)
def test_a_constrained_request_is_a_400_saying_why(oai, fields, named) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="qwen25", messages=USER, max_tokens=16, **fields)
    assert info.value.status_code == 400
    _refused(info.value, named)


def test_sglang_generate_and_the_rest_keep_serving(server, oai) -> None:
    r = httpx.post(server.url + "/generate", json={"text": "The weather", "sampling_params": {
        "max_new_tokens": 8, "json_schema": '{"type": "object"}'}}, timeout=60)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    _refused(Exception(r.json()["error"]["message"]), "json_schema")
    # unconstrained requests, and tools the model may or may not call (no grammar), are served
    out = oai.chat.completions.create(model="qwen25", messages=USER, max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")
    auto = oai.chat.completions.create(
        model="qwen25", messages=USER, max_tokens=8, tools=TOOLS, tool_choice="auto"
    )
    assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")
    info = httpx.get(server.url + "/server_info", params={"check_integrity": "1"}, timeout=30).json()
    assert info["kv_integrity"] == "ok" and info["num_unfinished_requests"] == 0
    assert "Traceback" not in server.log()


def test_the_offline_compiler_raises_the_reason(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LLM.generate with SamplingParams.structured_outputs reaches the same compiler: its error says why."""
    from transformers import AutoTokenizer

    from longserve.testing.checkpoints import make_tiny_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_checkpoint(tmp_path, "llama"))
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` fails: ModuleNotFoundError
    with pytest.raises(StructuredOutputsUnavailable, match=r"xgrammar did not import .*pip install xgrammar"):
        GrammarCompiler(tokenizer, vocab_size=len(tokenizer))
