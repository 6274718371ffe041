"""The tensor-parallel group (one of the two globals DESIGN.md allows) and its collectives.

A process joins with `init_tp_group`; until then (and at tp=1) `get_tp_size()` is 1 and every collective
returns its input untouched, so the single-device path runs no torch.distributed code at all.
Two groups: `device_group` (NCCL on CUDA, gloo on CPU) for activations, and `cpu_group` (gloo, a very long
timeout, since workers wait in it while the server is idle) for the per-step Python objects.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("longserve.distributed")

# a rank blocked this long in a model collective means a peer is gone: fail instead of hanging
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
IDLE_TIMEOUT = datetime.timedelta(days=365)  # workers wait for the next step in the cpu group


@dataclass
class TPGroup:
    rank: int
    world_size: int
    local_rank: int
    device_group: Any  # dist.ProcessGroup
    cpu_group: Any  # dist.ProcessGroup (gloo)
    # expert parallelism: the ranks form ep_size groups of world_size / ep_size; a group holds 1/ep_size of
    # the experts whole (models/moe_layout.py). Set once per process before the model is built.
    ep_size: int = 1


_TP: TPGroup | None = None


def init_tp_group(
    init_method: str,
    rank: int,
    world_size: int,
    local_rank: int,
    backend: str,
    timeout: datetime.timedelta = COLLECTIVE_TIMEOUT,
) -> TPGroup:
    """Join the world (`init_method` e.g. tcp://127.0.0.1:PORT) and make the tp group global."""
    global _TP
    if _TP is not None or dist.is_initialized():
        raise RuntimeError(
            "a tensor-parallel process group already exists in this process: close the previous engine "
            "(LLM.close() / Engine.close()) before starting another with tp_size > 1"
        )
    dist.init_process_group(
        backend=backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
    )
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    _TP = TPGroup(rank, world_size, local_rank, dist.group.WORLD, cpu_group)
    return _TP


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or a collective broke: the ranks are out of step for good."""


def destroy_tp_group(timeout: float = 30.0) -> None:
    """Leave the group. NCCL's clean shutdown is collective (every rank finalizes its communicator), so
    ranks call this together; when a peer is gone it could wait forever, so it runs on a helper thread
    and is given up after `timeout` seconds (the process then just exits without a clean NCCL shutdown)."""
    global _TP
    _TP = None
    if not dist.is_initialized():
        return
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as e:  # a peer already gone: nothing left to shut down cleanly
            logger.warning("leaving the tensor-parallel group: %s", e)
        done.set()

    threading.Thread(target=destroy, name="tp-destroy", daemon=True).start()
    if not done.wait(timeout):
        logger.warning("the tensor-parallel group did not shut down within %.0f s; leaving it as is", timeout)


def get_tp_group() -> TPGroup | None:
    return _TP


def get_tp_size() -> int:
    return 1 if _TP is None else _TP.world_size


def get_tp_rank() -> int:
    return 0 if _TP is None else _TP.rank


def set_ep_size(ep_size: int) -> None:
    """Place whole experts on `ep_size` groups of this process's tp ranks (the engine's ep_size setting)."""
    if _TP is None:
        if ep_size != 1:
            raise ValueError(f"ep_size={ep_size} needs tensor-parallel ranks (tp_size > 1)")
        return
    if ep_size < 1 or _TP.world_size % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide tp_size={_TP.world_size}")
    _TP.ep_size = ep_size


def get_ep_size() -> int:
    """Expert-parallel groups among the tp ranks (1: every rank holds a slice of every expert)."""
    return 1 if _TP is None else _TP.ep_size


def min_over_ranks(value: int, tp: TPGroup | None) -> int:
    """The smallest of every rank's `value` (the rank's own without a group): a count that must agree across
    the ranks, such as the KV pages or state slots their memory fits (ids are global, handed out on rank 0)."""
    if tp is None:
        return value
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return int(t.item())


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tp ranks in place (identity at tp=1)."""
    if _TP is None or _TP.world_size == 1:
        return x
    dist.all_reduce(x, group=_TP.device_group)
    return x


def tp_all_reduce_async(x: torch.Tensor) -> Any:
    """Start summing `x` over the tp ranks in place; returns the work to `.wait()` on (None at tp=1). On
    NCCL the wait only orders the current stream after the collective: the host runs on, so the caller
    can launch other work (the other micro-batch) while the sum is in flight."""
    if _TP is None or _TP.world_size == 1:
        return None
    return dist.all_reduce(x, group=_TP.device_group, async_op=True)


def tp_broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank `src`'s `x` on every rank, in place (identity at tp=1); on NCCL queued on the stream like a kernel
    (the overlapped schedule sends rank 0's sampled ids to the ranks that take them as inputs)."""
    if _TP is None or _TP.world_size == 1:
        return x
    dist.broadcast(x, src=src, group=_TP.device_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order (identity at tp=1)."""
    if _TP is None or _TP.world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP.world_size)]
    dist.all_gather(parts, x, group=_TP.device_group)
    return torch.cat(parts, dim=dim)


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """Send a picklable object from rank `src` to every rank over the gloo cpu group; returns it."""
    assert _TP is not None
    group = _TP.cpu_group
    if _TP.rank == src:
        payload = torch.frombuffer(
            bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8
        )
        size = torch.tensor([payload.numel()], dtype=torch.long)
        dist.broadcast(size, src=src, group=group)
        dist.broadcast(payload, src=src, group=group)
        return obj
    size = torch.empty(1, dtype=torch.long)
    dist.broadcast(size, src=src, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=src, group=group)
    return pickle.loads(payload.numpy().tobytes())
