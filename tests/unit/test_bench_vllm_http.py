"""`bench serve`/`bench compare` against vLLM's OpenAI server, as scripts/gpu/compare_vllm_http.sh drives it,
with a stand-in for vLLM (stdlib HTTP, no engine): the served model name from /v1/models goes in every
request, the cache is flushed through POST /reset_prefix_cache, a server without it (vLLM started without
VLLM_SERVER_DEV_MODE=1) makes a loud error in the record, the report and the exit code; and the word-level
tokenizer of that script (`w123` words, no English) builds text prompts of exact length."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from longserve import cli
from longserve.bench.serve import parse_args, run_once
from longserve.bench.workloads import LocalTokenizer, PromptBuilder, build_workload

pytest.importorskip("aiohttp")
MODEL = "/tmp/fake-llama"


class FakeVllm(ThreadingHTTPServer):
    """vLLM 0.24's OpenAI server as the benchmark sees it: /health, /v1/models, /version, /metrics (404),
    dev-mode POST /reset_prefix_cache, and streamed /v1/completions that 404 a model name it does not serve."""

    daemon_threads = True

    def __init__(self, dev_mode: bool) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.dev_mode = dev_mode
        self.calls: list[str] = []  # "POST /reset_prefix_cache", "completion"...
        self.models_sent: set[str | None] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakeVllm

    def log_message(self, *args) -> None:  # quiet
        pass

    def _json(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {})
        elif self.path == "/v1/models":
            card = {"id": MODEL, "object": "model", "owned_by": "vllm", "max_model_len": 131072}
            self._json(200, {"object": "list", "data": [card]})
        elif self.path == "/server_info":  # dev mode: a slow dump (collect_env) the benchmark should skip
            self.server.calls.append("GET /server_info")
            self._json(200, {"vllm_config": "..."})
        elif self.path == "/version":
            self._json(200, {"version": "0.24.0"})
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path == "/reset_prefix_cache" and self.server.dev_mode:
            self.server.calls.append("POST /reset_prefix_cache")
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/v1/completions":
            self.server.calls.append("completion")
            self.server.models_sent.add(body.get("model"))
            if body.get("model") != MODEL:
                self._json(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chunks = [{"choices": [{"index": 0, "text": " w7"}]} for _ in range(body["max_tokens"])]
            usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": body["max_tokens"]}
            chunks.append({"choices": [], "usage": usage})
            for c in chunks:
                self.wfile.write(b"data: " + json.dumps(c).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
        else:
            self._json(404, {"detail": "Not Found"})


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> str:
    """A word-level tokenizer of `w3`..`w599` like the one of .anchor/bench_vllm.py (which has 128,256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, 600)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    path = str(tmp_path_factory.mktemp("word-tokenizer"))
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(path)
    return path


@pytest.fixture
def fake_vllm(request) -> Iterator[FakeVllm]:
    server = FakeVllm(dev_mode=request.param)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _flags(server: FakeVllm, tokenizer: str) -> list[str]:
    return [
        "--base-url", server.url, "--backend", "vllm", "--dataset", "random", "--num-prompts", "3",
        "--random-input-len", "40", "--random-output-len", "4", "--warmup-requests", "1", "--flush-cache",
        "--tokenizer", tokenizer, "--disable-tqdm",
    ]  # fmt: skip


def test_word_level_tokenizer_builds_exact_text_prompts(word_tokenizer):
    tok = LocalTokenizer(word_tokenizer)
    builder = PromptBuilder(tok, as_text=True)  # the built-in English text is all <unk> here
    assert len(builder.pool) >= 8 and not {0, 1, 2} & set(builder.pool)
    args = parse_args(
        [
            "--base-url",
            "-",
            "--dataset",
            "random",
            "--num-prompts",
            "4",
            "--random-input-len",
            "50",
            "--random-range-ratio",
            "0.5",
        ]
    )
    for r in build_workload(args, builder):
        assert r.prompt_len == len(tok.encode(r.text)) and 25 <= r.prompt_len <= 50
        assert 2 not in tok.encode(r.text)  # no unknown word
    flags = ["--dataset", "multi-turn", "--multi-turn-conversations", "2", "--multi-turn-turns", "3"]
    flags += ["--multi-turn-first-len", "60", "--multi-turn-turn-len", "10", "--output-len", "5"]
    reqs = build_workload(parse_args(["--base-url", "-", *flags]), builder)
    for r in reqs:  # a turn's tokens extend its previous turn's exactly: its whole history is a prefix hit
        ids = tok.encode(r.text)
        assert 2 not in ids and r.prompt_len == len(ids)
        if r.after is not None:
            prev = tok.encode(reqs[r.after].text)
            assert ids[: len(prev)] == prev and len(ids) == len(prev) + 15


@pytest.mark.parametrize("fake_vllm", [True], indirect=True)
def test_vllm_dev_mode_flush_and_served_model_name(fake_vllm, word_tokenizer):
    record = run_once(parse_args(_flags(fake_vllm, word_tokenizer)))
    assert record["summary"]["completed"] == 3 and record["summary"]["failed"] == 0
    assert fake_vllm.models_sent == {MODEL}  # the name /v1/models gave, in every request
    # vLLM's route first, after the warm-up and before the measured requests
    assert fake_vllm.calls == ["completion", "POST /reset_prefix_cache"] + ["completion"] * 3
    meta = record["metadata"]
    assert (meta["cache_flushed"], meta["cache_flush_error"]) == ("/reset_prefix_cache", None)
    assert meta["model"] == MODEL
    assert meta["server_info"] == {"version": "0.24.0", "served_model": MODEL, "max_model_len": 131072}
    assert all(r["prompt_tokens"] == r["prompt_len"] for r in record["requests"])


@pytest.mark.parametrize("fake_vllm", [False], indirect=True)
def test_vllm_without_dev_mode_flush_failure_is_loud(fake_vllm, word_tokenizer, tmp_path, capsys):
    assert cli.main(["bench", "serve", *_flags(fake_vllm, word_tokenizer)]) == 1
    out, err = capsys.readouterr()
    assert "VLLM_SERVER_DEV_MODE=1" in err and "the cache was NOT flushed" in out
    assert "POST /reset_prefix_cache: HTTP 404" in err
    config = tmp_path / "compare.yaml"
    workload = {"dataset": "random", "num_prompts": 2, "random_input_len": 30, "random_output_len": 3,
                "warmup_requests": 0, "flush_cache": True, "tokenizer": word_tokenizer}  # fmt: skip
    endpoint = {"name": "vllm", "base_url": fake_vllm.url, "backend": "vllm", "endpoint": "completions"}
    config.write_text(json.dumps({"workload": workload, "endpoints": [endpoint]}))  # JSON is YAML
    report_dir = tmp_path / "report"
    assert cli.main(["bench", "compare", "--config", str(config), "--output-dir", str(report_dir)]) == 1
    report = (report_dir / "report.md").read_text()
    assert "asked, but **FAILED** for vllm" in report and "- vllm: the cache was NOT flushed" in report
    results = json.loads((report_dir / "results.json").read_text())
    assert results["runs"][0]["metadata"]["cache_flushed"] is None
    assert results["runs"][0]["summary"]["completed"] == 2  # measured anyway
