"""EngineConfig's parallel layout, checked as one: tp_size, ep_size (enable_expert_parallel stored as ep_size
= tp_size), nnodes, node_rank and dist_init_addr. Called from EngineConfig.__post_init__ (longserve/config.py)
with its `need`, so a refusal is the same ConfigError naming the same settings; it imports nothing of
config.py, which imports it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def check_parallel_layout(config: Any, need: Callable[..., None]) -> None:
    """The ranks' layout of `config` (the EngineConfig being built: frozen, so ep_size is stored through
    object.__setattr__, as __post_init__ stores its normalized fields), in __post_init__'s order of checks."""
    need(
        isinstance(config.tp_size, int) and config.tp_size >= 1,
        f"tp_size must be an integer >= 1; got {config.tp_size!r}",
        "tp_size",
    )
    _normalize_expert_parallel(config, need)
    need(
        isinstance(config.nnodes, int) and config.nnodes >= 1,
        f"nnodes must be an integer >= 1; got {config.nnodes!r}",
        "nnodes",
    )
    need(
        isinstance(config.node_rank, int) and 0 <= config.node_rank < config.nnodes,
        f"node_rank must be in [0, nnodes={config.nnodes}); got {config.node_rank!r}",
        "node_rank",
        "nnodes",
    )
    need(
        config.tp_size % config.nnodes == 0,
        f"tp_size={config.tp_size} must be a multiple of nnodes={config.nnodes} (the same number of ranks per node)",
        "tp_size",
        "nnodes",
    )
    need(
        config.nnodes == 1 or bool(config.dist_init_addr),
        f"nnodes={config.nnodes} needs dist_init_addr (HOST:PORT of node 0, reachable from every node)",
        "nnodes",
        "dist_init_addr",
    )
    need(
        config.dist_init_addr is None or config.dist_init_addr.rpartition(":")[2].isdigit(),
        f"dist_init_addr must be HOST:PORT; got {config.dist_init_addr!r}",
        "dist_init_addr",
    )


def _normalize_expert_parallel(config: Any, need: Callable[..., None]) -> None:
    """enable_expert_parallel means ep_size = tp_size (stored so); ep_size must divide tp_size."""
    need(
        isinstance(config.ep_size, int) and config.ep_size >= 1,
        f"ep_size must be an integer >= 1; got {config.ep_size!r}",
        "ep_size",
    )
    if config.enable_expert_parallel:
        need(
            config.ep_size in (1, config.tp_size),
            f"enable_expert_parallel places the experts over all tp_size={config.tp_size} ranks; "
            f"ep_size={config.ep_size} disagrees (give one of the two)",
            "enable_expert_parallel",
            "ep_size",
        )
        object.__setattr__(config, "ep_size", config.tp_size)
    need(
        config.tp_size % config.ep_size == 0,
        f"ep_size={config.ep_size} must divide tp_size={config.tp_size} (the expert-parallel ranks are the "
        "tensor-parallel ones)",
        "ep_size",
        "tp_size",
    )
