"""`longserve bench accuracy --base-url ... --reference-base-url ...` against two real `longserve serve`
processes (the reference checkpoint, and the same one with an fp8 KV cache), and the same comparison offline:
the servers' numbers equal the offline ones (both use the top-k prompt logprobs); the report files parse."""

from __future__ import annotations

import json

import httpx
import pytest

from longserve.cli import main
from longserve.testing.server_process import ServerProcess

FLAGS = ["--max-new-tokens", "8", "--top-k", "10"]


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    procs = []
    try:
        for kv in ("auto", "fp8"):
            args = ["--model-path", tiny_model, "--device", "cpu", "--dtype", "float32",
                    "--max-total-tokens", "4096", "--kv-cache-dtype", kv]  # fmt: skip
            procs.append(ServerProcess(args, str(tmp_path_factory.mktemp("logs") / f"server-{kv}.log")))
        yield [p.wait_ready() for p in procs]
    finally:
        for p in procs:
            p.stop()


def test_two_servers_equal_offline(servers, tiny_model, tmp_path):
    auto, fp8 = servers
    out = tmp_path / "served"
    assert main(["bench", "accuracy", "--base-url", fp8.url + "/v1", "--reference-base-url", auto.url,
                 *FLAGS, "--output-dir", str(out)]) == 0  # fmt: skip
    served = json.loads((out / "accuracy.json").read_text())
    assert "| mean KL(reference ‖ model) |" in (out / "accuracy.md").read_text()
    off = tmp_path / "offline"
    assert main(["bench", "accuracy", "--model", tiny_model, "--reference", tiny_model, "--kv-cache-dtype", "fp8",
                 "--dtype", "float32", "--device", "cpu", "--max-total-tokens", "4096", *FLAGS,
                 "--output-dir", str(off)]) == 0  # fmt: skip
    offline = json.loads((off / "accuracy.json").read_text())
    assert served["positions"] == offline["positions"] > 0
    assert served["top1_agreement"] == offline["top1_agreement"] and served["mean_kl"] > 0  # fp8 rounds
    assert served["mean_kl"] == pytest.approx(offline["mean_kl"], rel=1e-3, abs=1e-6)
    assert served["perplexity"]["model"] == pytest.approx(offline["perplexity"]["model"], rel=1e-4)
    assert [p["model_answer"] for p in served["prompts"]] == [p["model_answer"] for p in offline["prompts"]]
    for s in (auto, fp8):  # the servers kept every page
        info = httpx.get(s.url + "/server_info", params={"check_integrity": "true"}).json()
        assert info["kv_integrity"] == "ok"
