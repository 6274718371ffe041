"""Tensor-parallel worker processes: one per rank besides the engine's own (rank 0).

Rank 0 runs the scheduler and a ModelRunner shard; every other rank runs `worker_main`: join the group,
build its ModelRunner shard, then loop — receive a step's `StepInputs` over the gloo cpu group, run the
forward pass (which holds the collectives), repeat; `None` means shut down. `TPWorkers` (rank 0's side)
spawns this node's workers, watches them (a rank that dies is logged at once and fails the next step),
and stops them on shutdown. Other nodes of a multi-node run start with `run_node` (see README).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from longserve.config import EngineConfig
from longserve.distributed import broadcast_object, destroy_tp_group, get_tp_rank, init_tp_group
from longserve.platform import resolve_device

logger = logging.getLogger("longserve.runner.worker")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(config: EngineConfig) -> str:
    return "nccl" if resolve_device(config.device).type == "cuda" else "gloo"


def _check_devices(config: EngineConfig) -> None:
    per_node = config.tp_size // config.nnodes
    if resolve_device(config.device).type == "cuda" and per_node > torch.cuda.device_count():
        raise ValueError(
            f"tp_size={config.tp_size} over {config.nnodes} node(s) needs {per_node} GPUs on this node, "
            f"but {torch.cuda.device_count()} are visible; lower --tp-size or set CUDA_VISIBLE_DEVICES"
        )


def worker_main(config: EngineConfig, rank: int, local_rank: int, init_method: str, backend: str) -> None:
    """A worker rank's whole life: join, load its shard, execute steps until told to stop."""
    from longserve.models import load_hf_config
    from longserve.runner.model_runner import ModelRunner

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [tp rank {rank}] %(levelname)s %(message)s")
    if backend == "gloo":  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (config.tp_size // config.nnodes)))
    if backend == "nccl":  # bind the rank's GPU before NCCL creates its communicator
        torch.cuda.set_device(local_rank)
    init_tp_group(init_method, rank, config.tp_size, local_rank, backend)
    try:
        runner = ModelRunner(config, load_hf_config(config.model))
        while (step := broadcast_object(None)) is not None:
            runner.forward_step(step)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        raise
    finally:
        destroy_tp_group()


class TPWorkers:
    """Rank 0's handle on this node's worker processes (ranks 1..per_node-1 of node 0)."""

    def __init__(self, procs: list[Any], ranks: list[int]) -> None:
        self.procs = procs
        self.ranks = ranks
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None  # e.g. the server stops itself
        self._closing = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    @classmethod
    def start(cls, config: EngineConfig) -> TPWorkers:
        """Spawn this node's workers and join the group as rank node_rank * per_node (rank 0 on node 0)."""
        _check_devices(config)
        backend = _backend(config)
        per_node = config.tp_size // config.nnodes
        if config.dist_init_addr:
            init_method = f"tcp://{config.dist_init_addr}"
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        first = config.node_rank * per_node
        ctx = mp.get_context("spawn")
        procs, ranks = [], []
        for local_rank in range(1, per_node):
            rank = first + local_rank
            p = ctx.Process(
                target=worker_main,
                args=(config, rank, local_rank, init_method, backend),
                name=f"longserve-tp{rank}",
                daemon=True,
            )
            p.start()
            procs.append(p)
            ranks.append(rank)
        workers = cls(procs, ranks)
        try:
            init_tp_group(init_method, first, config.tp_size, 0, backend)
        except BaseException:
            workers.shutdown(graceful=False)
            raise
        logger.info("tensor parallelism: %d ranks (%s), %d on this node", config.tp_size, backend, per_node)
        return workers

    def _watch(self) -> None:
        while not self._closing.wait(0.2):
            for p, rank in zip(self.procs, self.ranks):
                if p.exitcode is not None and self.failure is None:
                    self.failure = (
                        f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}; "
                        "the engine cannot run steps without it and must be restarted"
                    )
                    logger.error(self.failure)
                    if self.on_failure is not None:
                        self.on_failure(self.failure)
            if self.failure is not None:
                return

    def check(self) -> None:
        """Raise if a worker has died (called before every step, so no step waits on a dead rank)."""
        for p, rank in zip(self.procs, self.ranks):
            if p.exitcode is not None and self.failure is None:
                self.failure = f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                logger.error(self.failure)
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def shutdown(self, graceful: bool = True, timeout: float = 10.0) -> None:
        """Tell the workers to stop (graceful), wait for them, kill stragglers, leave the group."""
        self._closing.set()
        if graceful and self.failure is None and get_tp_rank() == 0:  # rank 0 alone sends steps
            try:
                broadcast_object(None)
            except Exception as e:  # a rank already gone: fall through to terminate
                logger.warning("tensor-parallel shutdown message failed: %s", e)
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
        destroy_tp_group()


def run_node(config: EngineConfig) -> None:
    """Entry point of a node other than node 0 in a multi-node run: spawn this node's local workers and
    serve as its first rank; returns when node 0 shuts the group down."""
    if config.node_rank == 0:
        raise ValueError("run_node is for --node-rank >= 1; node 0 runs the engine (longserve serve)")
    from longserve.models import load_hf_config
    from longserve.runner.model_runner import ModelRunner

    runner = ModelRunner(config, load_hf_config(config.model))  # starts local workers, joins the group
    try:
        while (step := broadcast_object(None)) is not None:
            runner.forward_step(step)
    finally:
        runner.shutdown()


def main(argv: list[str] | None = None) -> None:
    """`python -m longserve.runner.worker <longserve serve flags> --node-rank K` on node K >= 1."""
    from longserve.server.args import parse

    logging.basicConfig(level=logging.INFO)
    engine_config, _ = parse(argv)
    run_node(engine_config)


if __name__ == "__main__":
    main()
