"""Fixtures of the server tests: a tiny checkpoint and real `python -m longserve.launch_server` processes on
free loopback ports (started once per session, killed at teardown; their logs land in the tmp dir)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence

import pytest

from longserve.testing.checkpoints import make_tiny_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONTEXT = 8192  # beyond the tiny model's 512 positions: long enough to disconnect mid-generation


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: Sequence[str], port: int, log_path: str, env: Mapping[str, str] | None = None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        full_env = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "longserve.launch_server", *args],
            cwd=REPO,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        import httpx

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory) -> Iterator[ServerProcess]:
    """The shared server: no API key, float32 on the CPU, a small KV pool."""
    port = free_port()
    args = ["--model-path", tiny_model, "--device", "cpu", "--port", str(port), "--dtype", "float32"]
    args += ["--max-total-tokens", str(4 * CONTEXT), "--context-length", str(CONTEXT), "--log-requests"]
    proc = ServerProcess(args, port, str(tmp_path_factory.mktemp("logs") / "server.log"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture
def client(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=60.0) as c:
        yield c
