"""Fixtures of the server tests: a tiny checkpoint and real `python -m longserve.launch_server` processes on
free loopback ports (started once per session, killed at teardown; their logs land in the tmp dir)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from longserve.testing.checkpoints import make_tiny_checkpoint
from longserve.testing.server_process import REPO, ServerProcess, free_port  # noqa: F401 - fixtures' API

CONTEXT = 8192  # beyond the tiny model's 512 positions: long enough to disconnect mid-generation


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory) -> Iterator[ServerProcess]:
    """The shared server: no API key, float32 on the CPU, a small KV pool."""
    args = ["--model-path", tiny_model, "--device", "cpu", "--dtype", "float32"]
    args += ["--max-total-tokens", str(4 * CONTEXT), "--context-length", str(CONTEXT), "--log-requests"]
    args += ["--strict-model-name"]  # vLLM's 404 for a model name not served (test_compat_api: the default)
    args += ["--max-logprobs", "40"]  # vLLM's flag: more top logprobs than OpenAI's 20 (test_logprobs_api)
    # overlapped steps, as a GPU server runs by default (the engine tests cover the plain schedule on the CPU)
    args += ["--enable-overlap-schedule"]
    proc = ServerProcess(args, str(tmp_path_factory.mktemp("logs") / "server.log"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture
def client(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=60.0) as c:
        yield c
