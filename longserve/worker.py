"""A tensor-parallel worker's program: `worker_main` (spawned by runner/tp_workers.TPWorkers on every rank but
the engine's) and `python -m longserve.worker`, the start of every node but node 0 in a multi-node run.

A worker joins the group, builds its ModelRunner shard, then loops: receive a step's `StepInputs` over the
gloo cpu group, run the forward pass (which holds the collectives), repeat; `None` means shut down. It
watches its parent and exits when the parent is gone (a killed server leaves no worker behind).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
from typing import Any

import torch

from longserve.config import EngineConfig
from longserve.distributed import broadcast_object, destroy_tp_group, init_tp_group
from longserve.runner.tp_workers import exit_orphan, parent_gone, watch_parent

logger = logging.getLogger("longserve.worker")


def run_message(runner: Any, message: Any) -> None:
    """One message from rank 0 on the step channel: a step's inputs, or a warm-up (runner/warm_up.py)."""
    from longserve.runner.warm_up import WarmUp

    if isinstance(message, WarmUp):
        runner.warm_up(message.counts)
    else:
        runner.forward_step(message)


def worker_main(
    config: EngineConfig, rank: int, local_rank: int, init_method: str, backend: str, joining: Any = None
) -> None:
    """A worker rank's whole life: join, load its shard, execute steps until told to stop. `joining` (an
    mp.Event) is set right before the rendezvous, so rank 0 can tell a worker that died while starting
    (an import error, a script without a __main__ guard) from one that is on its way."""
    from longserve.models import load_hf_config
    from longserve.runner.model_runner import ModelRunner

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [tp rank {rank}] %(levelname)s %(message)s")
    # rank 0 decides when the group stops: Ctrl+C in a terminal reaches the whole process group, and a
    # worker that died of it would be reported as a failure while the server shuts down cleanly
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = mp.parent_process()  # None when called in-process (not spawned by TPWorkers)
    if parent is not None:
        watch_parent(rank, parent)
    if backend == "gloo":  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (config.tp_size // config.nnodes)))
    if backend == "nccl":  # bind the rank's GPU before NCCL creates its communicator
        torch.cuda.set_device(local_rank)
    if joining is not None:
        joining.set()
    init_tp_group(init_method, rank, config.tp_size, local_rank, backend)
    runner = None
    try:
        runner = ModelRunner(config, load_hf_config(config.model))
        while (step := broadcast_object(None)) is not None:
            run_message(runner, step)
    except Exception:
        if parent is not None and parent_gone(parent, timeout=0.5):  # a collective failed: rank 0 died
            exit_orphan(rank, parent)
        logger.exception("tensor-parallel rank %d failed", rank)
        destroy_tp_group(timeout=5.0)
        raise
    if runner is not None:
        runner.release_graphs()
    destroy_tp_group()  # together with rank 0, which leaves the group as soon as it sent the stop


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
            run_message(runner, step)
    finally:
        runner.shutdown()


def main(argv: list[str] | None = None) -> int:
    """`python -m longserve.worker <longserve serve flags> --node-rank K` on node K >= 1. A refused setting
    exits 2 with one line naming its flag; a failure while serving steps raises (its traceback is the log)."""
    from longserve.server.args import build_parser, cli_message, resolve

    logging.basicConfig(level=logging.INFO)
    args = build_parser(prog="python -m longserve.worker").parse_args(argv)
    try:
        engine_config, _ = resolve(args)
        run_node(engine_config)
    except (ValueError, OSError) as e:  # settings, a missing checkpoint, a tp size the model refuses
        print(f"error: {cli_message(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
