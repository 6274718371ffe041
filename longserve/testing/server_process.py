"""A real server process for tests and dev scripts: `python -m longserve.launch_server` on a loopback port with its
log in a file, and what /proc says of a process (RSS, CPU time, per-mapping RSS)."""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# longserve.server.launch.serve's line once its socket is bound (before the model loads)
_LISTENING = re.compile(r"listening on http://\S+:(\d+); loading the model")


def free_port() -> int:
    """A TCP port on 127.0.0.1 free a moment ago (bound and released), for a listener that must be named before it
    starts (torch.distributed's rendezvous). Picked below the kernel's ephemeral range when the range is known
    (/proc/sys/net/ipv4/ip_local_port_range): a port the kernel chose and released can be handed out again at once,
    to a server on `--port 0` or a client's outgoing connection, before its user binds it (the multi-node tests'
    rendezvous could lose such a race); one outside the range only another explicit bind can take. A server itself is
    better started on `--port 0` (ServerProcess does)."""
    low = ephemeral_ports()[0]
    for _ in range(64 if low > 2048 else 0):
        port = random.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken: another try
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (Linux; elsewhere (0, 0): unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return 0, 0
    return low, high


def read_rss(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile of a process, in KiB (/proc/PID/status)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def read_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its threads so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_smaps(pid: int) -> dict[str, int]:
    """Rss (KiB) of each mapping of a process, keyed by 'start name' (/proc/PID/smaps; [heap] grows at its end)."""
    rss: dict[str, int] = {}
    key = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if "-" in head[0] and not head[0].endswith(":"):
                name = head[5].strip() if len(head) > 5 else "[anon]"
                key = f"{head[0].split('-')[0]} {name}"
            elif head[0] == "Rss:":
                rss[key] = int(head[1])
    return rss


def smaps_growth(before: dict[str, int], after: dict[str, int], top: int = 8) -> list[str]:
    """The mappings whose Rss grew most between two read_smaps() (new mappings count in full)."""
    growth = sorted(((after[k] - before.get(k, 0), k) for k in after), reverse=True)
    lines = [f"{g / 1024:9.1f} MiB  {k}" for g, k in growth[:top] if g > 0]
    by_name: Counter[str] = Counter()
    for k in set(before) | set(after):
        by_name[k.split(" ", 1)[1]] += after.get(k, 0) - before.get(k, 0)
    lines += [f"{g / 1024:9.1f} MiB  all {name}" for name, g in by_name.most_common(4) if g > 0]
    return lines


class ServerProcess:
    """`python -m longserve.launch_server ARGS` with its output in `log_path`; PYTHONPATH has the repository
    first, so the checkout is what runs. Without `--port` in ARGS it listens on `--port 0`, a port the kernel
    picks at bind: a port chosen here and passed on could be taken by another process before the server
    binds it (CI once lost a run so). That port is read from the server's log (`port`, `url`) by `wait_ready()`,
    which needs its INFO lines (the default --log-level)."""

    def __init__(self, args: Sequence[str], log_path: str, env: Mapping[str, str] | None = None) -> None:
        args = list(args) if "--port" in args else [*args, "--port", "0"]
        given = int(args[args.index("--port") + 1])
        # a port given is the port; port 0 is read from the INFO line (the default --log-level)
        self._port: int | None = given or None
        self.log_path = log_path
        path = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
        full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "longserve.launch_server", *args],
            cwd=REPO,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @property
    def port(self) -> int:
        """The port the server bound (known once wait_ready() returns)."""
        port = self._bound_port()
        if port is None:
            raise RuntimeError(f"the server has not said its port yet:\n{self.log_tail()}")
        return port

    def _bound_port(self) -> int | None:
        """From the server's log: its `listening on` line, written once its socket is bound."""
        if self._port is None and (found := _LISTENING.search(self.log())) is not None:
            self._port = int(found.group(1))
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_tail(self, n: int = 30) -> str:
        return "".join(self.log().splitlines(keepends=True)[-n:])

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        """Until GET /health answers 200; raises with the log if the process exits or time runs out."""
        import httpx

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                bound = self._bound_port() is not None
                if bound and httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log()}")

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (the server drains), then SIGKILL after `timeout` seconds; the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode
