"""What the soak (scripts/dev/soak.py) counts and reads: its tally of answers by kind and label, the error an
unexpected answer raises, server-sent events as data, and the wait for a server's health."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from longserve.testing.server_process import ServerProcess


async def wait_healthy(
    session: aiohttp.ClientSession, url: str, server: ServerProcess | None, timeout: float
):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if server is not None and server.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {server.proc.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.25)
    raise RuntimeError(f"the server at {url} was not healthy after {timeout:.0f}s")


class Unexpected(Exception):
    """An answer the soak did not expect (the detail goes into the report)."""


@dataclass
class Stats:
    done: int = 0
    by_label: Counter[str] = field(default_factory=Counter)  # "200", "400", "disconnect", "unexpected", ...
    by_kind: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)  # the first few, with detail

    def record(self, kind: str, label: str, detail: str = "") -> None:
        self.done += 1
        self.by_kind[kind] += 1
        self.by_label[label] += 1
        if label == "unexpected" and len(self.unexpected) < 20:
            self.unexpected.append(f"{kind}: {detail}")


def sse_events(raw: bytes) -> list[Any]:
    """The data of each server-sent event ('[DONE]' stays a string)."""
    events = []
    for line in raw.decode("utf-8", errors="replace").splitlines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def error_of(event: Any) -> dict | None:
    return event.get("error") if isinstance(event, dict) else None
