"""Multi-node tensor parallelism through torch.distributed's TCP rendezvous, on one machine: "node 0" is a
`longserve serve --tp-size 2 --nnodes 2 --node-rank 0 --dist-init-addr` server and "node 1" a separate
`python -m longserve.worker ... --node-rank 1` process (gloo). Greedy /generate equals the offline
TP=1 engine; stopping node 0 stops node 1 cleanly; a dead node 1 takes node 0 down with a clear line.
Also an SGLang launch command line with `--tp-size 4`, on the CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from longserve import LLM, SamplingParams
from tests.server.conftest import REPO, ServerProcess, free_port

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 300, 301, 7, 8, 9, 200, 201, 202, 17, 18]]
MAX_NEW = 12
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


def expected(model: str) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with LLM(model, dtype="float32", device="cpu", max_total_tokens=2048) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, params)]


def start_pair(model: str, logs, name: str) -> tuple[ServerProcess, subprocess.Popen, object]:
    rdv = free_port()  # torch.distributed's rendezvous (the HTTP port is the kernel's pick: ServerProcess)
    common = ["--model-path", model, "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "2048"]
    common += ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{rdv}"]
    node0 = ServerProcess([*common, "--node-rank", "0"], str(logs / f"{name}0.log"))
    log1 = open(logs / f"{name}1.log", "w")  # noqa: SIM115 - closed by the caller
    node1 = subprocess.Popen(
        [sys.executable, "-m", "longserve.worker", *common, "--node-rank", "1"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        stdout=log1,
        stderr=subprocess.STDOUT,
    )
    return node0, node1, log1


def test_two_nodes_serve_and_stop_together(tiny_model, tmp_path):
    node0, node1, log1 = start_pair(tiny_model, tmp_path, "ok")
    try:
        node0.wait_ready()
        r = httpx.post(
            node0.url + "/generate", json={"input_ids": PROMPTS, "sampling_params": GREEDY}, timeout=60
        )
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == expected(tiny_model)
        assert "tensor parallelism: 2 ranks (gloo), 1 on this node" in node0.log()
        node0.proc.send_signal(signal.SIGTERM)
        assert node0.proc.wait(20) == 0  # drained, then a clean exit
        assert node1.wait(20) == 0, (tmp_path / "ok1.log").read_text()  # told to stop: a clean exit
    finally:
        node0.stop()
        if node1.poll() is None:
            node1.kill()
        log1.close()


def test_dead_node_takes_node0_down(tiny_model, tmp_path):
    node0, node1, log1 = start_pair(tiny_model, tmp_path, "dead")
    try:
        node0.wait_ready()
        ok = httpx.post(
            node0.url + "/generate", json={"input_ids": PROMPTS[0], "sampling_params": GREEDY}, timeout=60
        )
        assert ok.status_code == 200
        node1.kill()
        node1.wait(10)
        r = httpx.post(
            node0.url + "/generate", json={"input_ids": PROMPTS[0], "sampling_params": GREEDY}, timeout=60
        )
        assert r.status_code == 500 and "a tensor-parallel rank failed" in r.text, r.text
        assert "tensor-parallel step failed" in node0.log()  # the details: in the log, not the body
        assert node0.proc.wait(20) != 0
        assert "shutting down the server" in node0.log()
    finally:
        node0.stop()
        log1.close()


def test_sglang_launch_line_at_tp4(tiny_model, tmp_path):
    """SGLang's launch flags with --tp-size 4 (--mem-fraction-static, --context-length 131072,
    --chunked-prefill-size, --enable-prefix-caching) answer /generate on the CPU: 4 ranks, the tiny model's
    2 kv heads replicated, greedy output equal to TP=1."""
    line = (
        f"--model-path {tiny_model} --host 127.0.0.1 --port 0 --tp-size 4 --mem-fraction-static 0.8 "
        "--context-length 131072 --chunked-prefill-size 8192 --enable-prefix-caching --device cpu --dtype float32"
    )
    server = ServerProcess(line.split(), str(tmp_path / "tp4.log"), {"LONGSERVE_MAX_TOTAL_TOKENS": "131088"})
    try:
        server.wait_ready(timeout=180)
        r = httpx.post(
            server.url + "/generate", json={"input_ids": PROMPTS, "sampling_params": GREEDY}, timeout=120
        )
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == expected(tiny_model)
        assert "tensor parallelism: 4 ranks (gloo), 4 on this node" in server.log()
    finally:
        server.stop()


def test_worker_refuses_node_0_with_one_line(tiny_model):
    """Node 0 runs the engine (`longserve serve`): the worker program says so and exits 2, no traceback."""
    out = subprocess.run(
        [sys.executable, "-m", "longserve.worker", "--model-path", tiny_model, "--node-rank", "0"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "error: run_node is for --node-rank >= 1; node 0 runs the engine" in out.stderr
    assert "Traceback" not in out.stderr
