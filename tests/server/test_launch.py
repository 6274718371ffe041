"""Two launch lines, in SGLang's and vLLM's spellings (SGLang's with --tp-size 1), start real servers with
`--device cpu` and the tiny model; the API key is enforced (set here through LONGSERVE_API_KEY, so the vLLM
line itself stays unchanged).

Each line's fixed port is swapped for 0 (the kernel picks a free one at bind), and LONGSERVE_MAX_TOTAL_TOKENS
keeps the CPU KV pool at the 131,072-token context instead of a fraction of the machine's RAM (env vars rank
below flags, so the lines are otherwise as written)."""

from __future__ import annotations

import pytest

from tests.server.conftest import ServerProcess

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

SGLANG_LINE = (
    "--model-path {model} --host 0.0.0.0 --port 30000 --tp-size 1 --mem-fraction-static 0.8 "
    "--context-length 131072 --chunked-prefill-size 8192 --attention-backend flashinfer --enable-prefix-caching"
)
VLLM_LINE = (
    "--model {model} --port 8000 --max-model-len 131072 --max-num-batched-tokens 8192 "
    "--enable-prefix-caching --gpu-memory-utilization 0.8"
)
KEY = "sk-longserve-test"
POOL = {"LONGSERVE_MAX_TOTAL_TOKENS": str(131072 + 16)}


def _args(line: str, model: str) -> list[str]:
    args = line.format(model=model).split() + ["--device", "cpu"]
    args[args.index("--port") + 1] = "0"
    return args


@pytest.fixture(scope="module")
def launched(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("launch-lines")
    sglang = ServerProcess(_args(SGLANG_LINE, tiny_model), str(logs / "sglang.log"), POOL)
    vllm = ServerProcess(
        _args(VLLM_LINE, tiny_model), str(logs / "vllm.log"), {**POOL, "LONGSERVE_API_KEY": KEY}
    )
    try:  # both start at once
        yield sglang.wait_ready(), vllm.wait_ready()
    finally:
        sglang.stop()
        vllm.stop()


def test_sglang_line_serves_generate(launched):
    sglang, _ = launched
    info = httpx.get(sglang.url + "/server_info").json()
    assert info["context_length"] == 131072 and info["engine_config"]["chunked_prefill_size"] == 8192
    assert (
        info["engine_config"]["attention_backend"] == "torch" and info["server_config"]["host"] == "0.0.0.0"
    )
    assert "attention backend 'flashinfer'" in sglang.log()
    body = {
        "text": "請用三句話說明什麼是 Prefill 階段。",
        "sampling_params": {"max_new_tokens": 256, "temperature": 0.7},
    }
    r = httpx.post(sglang.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] >= 1


def test_vllm_line_with_api_key(launched, tiny_model):
    _, vllm = launched
    url = vllm.url
    assert httpx.get(url + "/health").status_code == 200  # open without a key
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/generate"), ("GET", "/server_info")):
            r = httpx.request(method, url + path, headers=headers, json={"text": "x"})
            assert r.status_code == 401, (headers, path)
            assert r.json()["error"]["type"] == "authentication_error"
    ok = httpx.get(url + "/server_info", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert ok["context_length"] == 131072 and ok["engine_config"]["chunked_prefill_size"] == 8192
    assert ok["server_config"]["api_key"] == "***"
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(
        model=tiny_model, messages=[{"role": "user", "content": "你好，請介紹 Prefill 優化。"}], max_tokens=16
    )
    assert r.usage.completion_tokens <= 16 and r.choices[0].message.content is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()


def test_no_model_serves_the_embedded_default(tmp_path):
    """`longserve serve` alone serves the built-in demo model: plausible words, not noise."""
    import re

    from longserve.assets import default_model_path

    server = ServerProcess(["--device", "cpu"], str(tmp_path / "default.log"))
    try:
        server.wait_ready()
        info = httpx.get(server.url + "/model_info").json()
        assert info["model_path"] == default_model_path()
        body = {"text": "Return the", "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
        out = httpx.post(server.url + "/generate", json=body, timeout=60).json()
        words = re.findall(r"[A-Za-z]+", out["text"])
        assert len(words) >= 8
        assert (
            sum(
                w.lower()
                in {
                    "the",
                    "a",
                    "of",
                    "is",
                    "to",
                    "and",
                    "file",
                    "list",
                    "name",
                    "return",
                    "value",
                    "number",
                    "line",
                    "current",
                    "object",
                    "string",
                }
                for w in words
            )
            >= 3
        )
    finally:
        server.stop()


def test_launch_server_errors_name_the_flags(tiny_model, tmp_path, capsys):
    """`python -m longserve.launch_server` says a refused setting as its flag, as `longserve serve` does: a
    checkpoint without tokenizer files points at --tokenizer-path, not the Python keyword."""
    import shutil

    from longserve.server.launch import main

    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(f"{tiny_model}/{name}", model / name)
    argv = ["--model-path", str(model), "--device", "cpu", "--port", "0"]
    assert main([*argv, "--max-total-tokens", "1024"]) == 2
    err = capsys.readouterr().err
    assert f"error: no tokenizer in {str(model)!r}" in err
    assert "(pass --tokenizer-path DIR to load it from elsewhere)" in err and "tokenizer=DIR" not in err
