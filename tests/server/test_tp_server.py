"""`--tp-size 2` servers on the CPU (gloo), as real processes: greedy /generate equals the offline TP=1
engine; a worker killed mid-request fails that request with 500 and takes the server down (non-zero exit,
one clear log line); SIGTERM stops the server and its worker; a SIGKILLed server's worker exits by itself;
tp sizes the heads cannot split, or more ranks than visible GPUs, are refused before anything starts.

The three servers start at once (their start-up is mostly imports) and each serves one ending."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from longserve import LLM, SamplingParams
from tests.server.conftest import REPO, ServerProcess

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 300, 301, 7, 8, 9, 200, 201, 202, 17, 18]]
MAX_NEW = 16


def _args(model: str, tp: int = 2) -> list[str]:
    return ["--model-path", model, "--device", "cpu", "--dtype", "float32", "--tp-size", str(tp)] + [
        "--max-total-tokens",
        "2048",
    ]


def worker_pid(server: ServerProcess) -> int:
    """Rank 1's pid, as the server logs it; it must be one of the server's child processes."""
    m = re.search(r"worker pids: rank 1 pid (\d+)", server.log())
    assert m, server.log()
    pid = int(m.group(1))
    assert pid in children(server.proc.pid)
    return pid


def children(pid: int) -> set[int]:
    found: set[int] = set()
    task_dir = f"/proc/{pid}/task"
    for tid in os.listdir(task_dir):
        with open(f"{task_dir}/{tid}/children") as f:
            found.update(int(c) for c in f.read().split())
    return found


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped has exited: this container's init may not reap orphans)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def wait_gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return not alive(pid)


@pytest.fixture(scope="module")
def tp_servers(tiny_model, tmp_path_factory):
    """Three TP=2 servers: "healthy" (greedy check, then SIGTERM), "victim" (its worker is killed) and
    "orphan" (the server is SIGKILLed)."""
    logs = tmp_path_factory.mktemp("tp-servers")
    servers = {}
    for name in ("healthy", "victim", "orphan"):
        servers[name] = ServerProcess(_args(tiny_model), str(logs / f"{name}.log"))
    try:
        for s in servers.values():
            s.wait_ready()
        yield servers
    finally:
        for s in servers.values():
            s.stop()


def test_tp2_greedy_generate_equals_offline_tp1(tp_servers, tiny_model):
    server = tp_servers["healthy"]
    worker_pid(server)
    lines = server.log().splitlines()
    worker_loaded = next(i for i, x in enumerate(lines) if "[tp rank 1]" in x and "Loaded" in x)
    ready = next(i for i, x in enumerate(lines) if "KV pool:" in x)
    assert worker_loaded < ready, "the engine reported ready before its worker had its weights"
    body = {
        "input_ids": PROMPTS,
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
    }
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = [out["output_ids"] for out in r.json()]
    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with LLM(tiny_model, dtype="float32", device="cpu", max_total_tokens=2048) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    assert got == expected
    assert all(len(ids) == MAX_NEW for ids in got) and len(set(got[1])) > 3  # not degenerate


def test_sigterm_stops_the_server_and_its_worker(tp_servers):
    server = tp_servers["healthy"]
    pid = worker_pid(server)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(15) in (0, -signal.SIGTERM)
    assert wait_gone(pid, 2.0), "the worker outlived the server"
    log = server.log()
    assert "CRITICAL" not in log and "Traceback" not in log, log


def test_dead_worker_takes_the_server_down(tp_servers):
    server = tp_servers["victim"]
    pid = worker_pid(server)
    body = {
        "input_ids": PROMPTS[0],
        "stream": True,
        "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
    }
    events = []
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = (line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: "))
        events.append(next(lines))  # generating: now the rank dies mid-request
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        events.extend(lines)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "tensor-parallel" in error["message"], error
    assert all(json.loads(e)["meta_info"]["finish_reason"] is None for e in events[:-2])  # cut short

    code = server.proc.wait(15)  # the server exits by itself
    assert code not in (0, None) and time.monotonic() - start < 15
    log = server.log()
    line = next((x for x in log.splitlines() if "shutting down the server" in x), None)
    assert line is not None, log
    assert "CRITICAL" in line and f"tensor-parallel rank 1 (pid {pid}) exited with code -9" in line, line


def test_worker_exits_when_the_server_is_killed(tp_servers):
    server = tp_servers["orphan"]
    pid = worker_pid(server)
    assert alive(pid)
    server.proc.kill()
    server.proc.wait(10)
    assert wait_gone(pid, 10.0), "the worker outlived its SIGKILLed server"
    assert "its parent process" in server.log()


def test_bad_tp_size_is_refused_at_start(tiny_model):
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "longserve.launch_server", *_args(tiny_model, tp=3), "--port", "0"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "error: tp_size=3 does not divide the model's 4 attention heads" in out.stderr
    assert time.monotonic() - start < 30


def test_more_ranks_than_gpus_are_refused_before_spawning(tiny_model, monkeypatch):
    """--device cuda with tp above the visible GPUs: refused with both counts, no process started."""
    import longserve.runner.tp_workers as tp_workers
    from longserve.config import EngineConfig
    from longserve.models import load_hf_config
    from longserve.runner.model_runner import ModelRunner

    class NoSpawn:
        @staticmethod
        def get_context(*args, **kwargs):
            raise AssertionError("a worker process was about to be spawned")

    monkeypatch.setattr(tp_workers, "resolve_device", lambda name: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(tp_workers, "mp", NoSpawn)
    config = EngineConfig(tiny_model, device="cuda", tp_size=2)
    with pytest.raises(ValueError, match=r"tp_size=2 .* needs 2 GPUs on this node, but 1 is visible"):
        ModelRunner(config, load_hf_config(tiny_model))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(AssertionError, match="about to be spawned"):  # enough GPUs: it gets that far
        tp_workers.TPWorkers.start(EngineConfig(tiny_model, device="cuda", tp_size=4))
