"""Tensor-parallel process group setup and collectives; every collective is the identity at tp=1. Expert
parallelism uses the same ranks and collectives (its size is an attribute of the group)."""

from __future__ import annotations

from longserve.distributed.parallel_state import (
    RankFailure,
    TPGroup,
    broadcast_object,
    destroy_tp_group,
    get_ep_size,
    get_tp_group,
    get_tp_rank,
    get_tp_size,
    init_tp_group,
    min_over_ranks,
    set_ep_size,
    tp_all_gather,
    tp_all_reduce,
    tp_all_reduce_async,
    tp_broadcast,
)

__all__ = [
    "RankFailure",
    "TPGroup",
    "broadcast_object",
    "destroy_tp_group",
    "get_ep_size",
    "get_tp_group",
    "get_tp_rank",
    "get_tp_size",
    "init_tp_group",
    "min_over_ranks",
    "set_ep_size",
    "tp_all_gather",
    "tp_all_reduce",
    "tp_all_reduce_async",
    "tp_broadcast",
]
