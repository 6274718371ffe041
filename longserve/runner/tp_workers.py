"""Rank 0's handle on tensor-parallel worker processes: spawn this node's workers, watch them, stop them.

`TPWorkers` spawns one process per local rank besides its own, running `longserve.worker.worker_main`
(imported in the child by name: runner/ never imports the worker program built on it). A rank that dies is
logged at once, fails the next step and calls `on_failure` (the server shuts itself down). The helpers a
worker uses to watch its own parent (it exits when the parent is gone) live here too.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from longserve.config import EngineConfig
from longserve.distributed import RankFailure, broadcast_object, destroy_tp_group, get_tp_rank, init_tp_group
from longserve.platform import resolve_device

logger = logging.getLogger("longserve.runner.tp_workers")

# the program of a worker process, "module:function"; called with (config, rank, local_rank, init_method,
# backend, joining)
WORKER_ENTRY = "longserve.worker:worker_main"


def _run_worker(entry: str, *args: Any) -> None:
    """A spawned process's target: import the worker program by name and run it."""
    module, _, name = entry.partition(":")
    getattr(importlib.import_module(module), name)(*args)


def _backend(config: EngineConfig) -> str:
    return "nccl" if resolve_device(config.device).type == "cuda" else "gloo"


def _check_devices(config: EngineConfig) -> None:
    """Refuse more ranks per node than visible GPUs; TPWorkers.start calls it before spawning anything."""
    per_node = config.tp_size // config.nnodes
    if resolve_device(config.device).type != "cuda":
        return
    visible = torch.cuda.device_count()
    if per_node > visible:
        raise ValueError(
            f"tp_size={config.tp_size} over {config.nnodes} node(s) needs {per_node} GPUs on this node, "
            f"but {visible} {'is' if visible == 1 else 'are'} visible; lower --tp-size or set "
            "CUDA_VISIBLE_DEVICES"
        )


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"{code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


def _exit_message(proc: Any, rank: int) -> str:
    return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {_describe_exit(proc.exitcode)}"


_orphan_exit = threading.Lock()


def parent_gone(parent: Any, timeout: float = 0.0) -> bool:
    """Whether the process that spawned this worker has exited (waits up to `timeout` for it)."""
    from multiprocessing.connection import wait

    # the sentinel turns readable when the parent's end of the pipe closes, i.e. when it exited
    return bool(wait([parent.sentinel], timeout=timeout)) or os.getppid() != parent.pid


def exit_orphan(rank: int, parent: Any) -> None:
    """One log line, then exit at once: nothing is left to serve, and the group cannot be left cleanly."""
    _orphan_exit.acquire()  # the watcher and a failed collective may both get here: one line, one exit
    logger.critical("tensor-parallel rank %d: its parent process (pid %s) is gone; exiting", rank, parent.pid)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(3)


def watch_parent(rank: int, parent: Any, poll: float = 1.0) -> None:
    """Exit this worker when the process that spawned it (rank 0, or a node's first rank) is gone: the
    worker would otherwise wait for its next step forever."""

    def watch() -> None:
        while not parent_gone(parent, poll):
            pass
        exit_orphan(rank, parent)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


class TPWorkers:
    """Rank 0's handle on this node's worker processes (ranks 1..per_node-1 of node 0)."""

    def __init__(self, procs: list[Any], ranks: list[int], rendezvous_dir: str | None = None) -> None:
        self.procs = procs
        self.ranks = ranks
        self.rendezvous_dir = rendezvous_dir  # removed at shutdown
        self.failure: str | None = None
        # called once, on the watchdog thread, with the failure message when a worker dies (even if set
        # after the death); the server sets it to shut itself down
        self.on_failure: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    @classmethod
    def start(cls, config: EngineConfig) -> TPWorkers:
        """Spawn this node's workers and join the group as rank node_rank * per_node (rank 0 on node 0)."""
        _check_devices(config)
        backend = _backend(config)
        per_node = config.tp_size // config.nnodes
        rendezvous_dir = None
        if config.dist_init_addr:
            init_method = f"tcp://{config.dist_init_addr}"
        else:  # one node: a file, not a port found free here, which another process could bind before the
            # rendezvous does (the race CI once lost with a test server's port)
            rendezvous_dir = tempfile.mkdtemp(prefix="longserve-tp-")
            init_method = f"file://{rendezvous_dir}/store"
        first = config.node_rank * per_node
        ctx = mp.get_context("spawn")
        procs, ranks, joining = [], [], []
        for local_rank in range(1, per_node):
            rank = first + local_rank
            event = ctx.Event()
            p = ctx.Process(
                target=_run_worker,
                args=(WORKER_ENTRY, config, rank, local_rank, init_method, backend, event),
                name=f"longserve-tp{rank}",
                daemon=True,
            )
            p.start()
            procs.append(p)
            ranks.append(rank)
            joining.append(event)
        workers = cls(procs, ranks, rendezvous_dir)
        try:
            workers._wait_joining(joining)
            init_tp_group(init_method, first, config.tp_size, 0, backend)
        except BaseException:
            workers.shutdown(graceful=False)
            raise
        logger.info(
            "tensor parallelism: %d ranks (%s), %d on this node; worker pids: %s",
            config.tp_size,
            backend,
            per_node,
            ", ".join(f"rank {r} pid {p.pid}" for r, p in zip(ranks, procs)) or "none",
        )
        return workers

    def _wait_joining(self, joining: list[Any], timeout: float = 600.0) -> None:
        """Wait until every worker is about to join the rendezvous; raise at once if one died first
        (rank 0 would otherwise wait in the rendezvous for a rank that never comes)."""
        deadline = time.monotonic() + timeout
        while not all(e.is_set() for e in joining):
            for p, rank in zip(self.procs, self.ranks):
                if p.exitcode is not None:
                    raise RuntimeError(
                        f"{_exit_message(p, rank)} while starting (its error is logged above). Workers "
                        "are started with multiprocessing's spawn: a script that creates an LLM with "
                        "tp_size > 1 must do it under `if __name__ == '__main__':`"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not start within {timeout:.0f} s")
            time.sleep(0.05)

    def _record(self) -> str | None:
        """The failure, recorded (and logged) once, by whichever thread notices a dead worker first."""
        with self._lock:
            if self.failure is None and not self._closing.is_set():
                for p, rank in zip(self.procs, self.ranks):
                    if p.exitcode is not None:
                        self.failure = (
                            f"{_exit_message(p, rank)}; the engine cannot run steps without it and "
                            "must be restarted"
                        )
                        logger.error(self.failure)
                        break
            return self.failure

    def _watch(self) -> None:
        while not self._closing.wait(0.2):
            failure = self._record()
            if failure is not None and self.on_failure is not None:
                try:
                    self.on_failure(failure)
                except Exception:
                    logger.exception("tensor-parallel on_failure callback failed")
                return

    def dead_worker(self, wait: float = 0.0) -> str | None:
        """The failure message if one of this node's workers has exited, waiting up to `wait` seconds for
        the exit to show (a collective can break a moment before the process is reaped)."""
        deadline = time.monotonic() + wait
        while True:
            failure = self._record()
            if failure is not None or time.monotonic() >= deadline:
                return failure
            time.sleep(0.02)

    def fail(self, message: str) -> None:
        """Record a failure seen by rank 0 itself (a collective that broke: e.g. a rank on another node
        died); the watchdog then calls `on_failure`, as for a local worker's death."""
        with self._lock:
            if self.failure is None:
                self.failure = message
                logger.error(message)

    def check(self) -> None:
        """Raise if a worker has died (called before every step, so no step waits on a dead rank)."""
        failure = self._record()
        if failure is not None:
            raise RankFailure(failure)

    def shutdown(self, graceful: bool = True, timeout: float = 10.0) -> None:
        """Tell the workers to stop (graceful), wait for them, kill stragglers, leave the group."""
        self._record()  # a worker already dead gets no shutdown message (nor a hang on sending it)
        self._closing.set()
        clean = graceful and self.failure is None
        if clean and get_tp_rank() == 0:  # rank 0 alone sends steps
            try:
                broadcast_object(None)
            except Exception as e:  # a rank already gone: fall through to terminate
                logger.warning("tensor-parallel shutdown message failed: %s", e)
                clean = False
        # leave the group while the workers do the same (NCCL's shutdown is collective), then reap them
        destroy_tp_group(timeout=timeout if clean else 2.0)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        if self.rendezvous_dir is not None:
            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)
