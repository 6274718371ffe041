"""Block sizes of the fused MoE kernel: JSON tables per (E, N, device, dtype) that `tune_moe` writes into
`moe_configs/`, the nearest num_tokens bucket of one, or an untuned default when no table fits (no triton).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import TypeVar

import torch

__all__ = [
    "CONFIG_DIR",
    "config_file_name",
    "current_device_name",
    "default_moe_config",
    "find_table",
    "get_moe_config",
    "table_devices",
]

logger = logging.getLogger("longserve.kernels.moe_config")
T = TypeVar("T")

CONFIG_DIR = Path(__file__).parent / "moe_configs"
KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
DOWN_KEYS = KEYS[1:]  # BLOCK_M is shared: one alignment of the tokens serves both GEMMs


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_file_name(
    num_experts: int, inter: int, device_name: str, dtype: torch.dtype, weights: str | None = None
) -> str:
    """vLLM's naming: N is the expert intermediate size I per rank (w2 is [E, H, N]); dtype names the
    quantized experts' format (MoEQuant.weight_dtype: int4, int8, fp8_e4m3) where they are, else the
    activations' dtype: tiles tuned for bf16 experts are not the quantized kernels' best."""
    kind = weights or dtype_name(dtype)
    return f"E={num_experts},N={inter},device_name={device_name.replace(' ', '_')},dtype={kind}.json"


@lru_cache(maxsize=8)
def current_device_name(index: int | None = None) -> str:
    """`torch.cuda.get_device_name` with spaces as underscores (NVIDIA_H200), or "cpu" without CUDA."""
    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(index).replace(" ", "_")


# The part whose tables (these MoE tiles, gemv_tables' GEMV tiles) answer on a GPU of the same architecture that
# has none of its own: the tiles of a prefill GEMM are set by the SM (its shared memory, tensor cores, registers),
# which an H100 and an H200 share, not by the memory around it. Measured on an H100 (2026-12-06, 9daccd2,
# RESULTS.md thirty-sixth session): with the untuned defaults the A3B FP8 experts' GEMMs took 668 ms of a cold 32K
# (bf16's 235) and the cold TTFT was 0.258 s at 8K, 1.509 s at 32K; with the H200's tables 0.190 s and 1.266 s
# (bf16 0.153 / 1.125 s with either: its table holds decode sizes only).
ARCH_TABLE_DEVICES = {(9, 0): "NVIDIA_H200"}


@lru_cache(maxsize=8)
def current_capability(index: int | None = None) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(index) if torch.cuda.is_available() else None


def table_devices(device_name: str | None = None, index: int | None = None) -> tuple[str, ...]:
    """The device names whose tables answer, in order: `device_name` alone when given, else this GPU's own, then
    the reference part of its architecture (ARCH_TABLE_DEVICES) if that is another."""
    if device_name:
        return (device_name.replace(" ", "_"),)
    own, ref = current_device_name(index), ARCH_TABLE_DEVICES.get(current_capability(index))
    return (own,) if ref is None or ref == own else (own, ref)


def find_table(
    path_of: Callable[[str], str],
    load: Callable[[str], T],
    device_name: str | None = None,
    index: int | None = None,
) -> T | None:
    """The first table that exists (`load(path)` truthy) among table_devices' names, a file each (`path_of(name)`);
    logged once per file when it is another part's. None when there is none."""
    devices = table_devices(device_name, index)
    for device in devices:
        path = path_of(device)
        if table := load(path):
            if device != devices[0]:
                _note_borrowed(path, devices[0])
            return table
    return None


@lru_cache(maxsize=64)
def _note_borrowed(path: str, own: str) -> None:
    logger.info("no tuned table of its own for this GPU (%s): reading %s", own, path)


@lru_cache(maxsize=64)
def load_table(path: str) -> dict[int, dict] | None:
    """num_tokens bucket -> config, checked once per file; None when the file does not exist."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        raw = json.load(f)
    table = {}
    for bucket, cfg in raw.items():
        bad = [k for k in KEYS if k not in cfg] + [k for k in cfg.get("down", {}) if k not in DOWN_KEYS]
        if bad or not bucket.isdigit():
            raise ValueError(
                f"{path}: bad entry {bucket!r}: {cfg} (needs {KEYS}; 'down' may override {DOWN_KEYS})"
            )
        table[int(bucket)] = cfg
    return table


def smem_per_stage(cfg: dict, elem: int, fused_gate_up: bool) -> int:
    """Shared memory of one pipeline stage: an a tile and one (down) or two (gate+up) b tiles."""
    return (
        cfg["BLOCK_M"] * cfg["BLOCK_K"] + (2 if fused_gate_up else 1) * cfg["BLOCK_K"] * cfg["BLOCK_N"]
    ) * elem


@lru_cache(maxsize=8)
def max_smem(index: int | None = None) -> int:
    """Shared memory one program may use on this GPU (227 KB on H100/H200; smaller on consumer parts)."""
    if not torch.cuda.is_available():
        return 227 * 1024
    return getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 99 * 1024)


def default_moe_config(
    num_experts: int, inter: int, hidden: int, top_k: int, dtype: torch.dtype, num_tokens: int
) -> dict:
    """Untuned (no GPU table has been written yet), sized by the average rows per expert, T*k/E.

    Decode (<= 16 rows per expert) is memory-bound: 16-row blocks so each touched expert's weights are
    read about once, narrow N tiles so a handful of experts still spreads over the SMs, long K steps.
    Prefill is compute-bound: 128-row blocks, 8 warps, grouped ordering for L2 reuse; the gate+up GEMM's
    BLOCK_N counts output columns, so its 128 means 256 weight rows (vLLM's tuned H200 tile). Stages are
    cut to what this GPU's shared memory holds."""
    del inter, hidden
    if os.environ.get("TRITON_INTERPRET", "0") == "1":  # the CPU interpreter: small tiles are fastest
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}
    rows_per_expert = num_tokens * top_k / num_experts
    wide = 1 if dtype == torch.float32 else 2  # fp32 tiles are twice the bytes: halve K
    if rows_per_expert <= 16:
        up = {
            "BLOCK_M": 16,
            "BLOCK_N": 32,
            "BLOCK_K": 64 * wide,
            "GROUP_M": 1,
            "num_warps": 4,
            "num_stages": 4,
        }
        down = {"BLOCK_N": 64}
    elif rows_per_expert <= 96:
        up = {
            "BLOCK_M": 64,
            "BLOCK_N": 64,
            "BLOCK_K": 32 * wide,
            "GROUP_M": 16,
            "num_warps": 4,
            "num_stages": 3,
        }
        down = {"BLOCK_N": 128}
    else:
        up = {
            "BLOCK_M": 128,
            "BLOCK_N": 128,
            "BLOCK_K": 32 * wide,
            "GROUP_M": 16,
            "num_warps": 8,
            "num_stages": 3,
        }
        down = {"BLOCK_N": 256 if wide == 2 else 128}
    elem = torch.tensor([], dtype=dtype).element_size()
    down = {**{k: up[k] for k in DOWN_KEYS}, **down}
    for cfg, fused in ((up, True), (down, False)):
        per_stage = smem_per_stage({"BLOCK_M": up["BLOCK_M"], **cfg}, elem, fused)
        cfg["num_stages"] = max(1, min(cfg["num_stages"], max_smem() // per_stage))
    return {**up, "down": down}


def get_moe_config(
    E: int,  # noqa: N803 - the usual MoE names: E experts, N intermediate, K hidden
    N: int,  # noqa: N803
    K: int,  # noqa: N803
    top_k: int,
    dtype: torch.dtype,
    num_tokens: int,
    device_name: str | None = None,
    config_dir: str | Path | None = None,
    weights: str | None = None,
) -> dict:
    """Launch config for T = num_tokens: the bucket nearest to T (ties: the smaller) of the table for
    (E, N, device, dtype) in `config_dir` (default: the package's moe_configs/), the device's own or else its
    architecture's reference part's (table_devices), else `default_moe_config`.
    A table answers only within a factor of 2 of its buckets: one tuned at decode sizes (tune_moe with a
    few --batch-sizes) must not hand its 16-row tiles to an 8K-token prefill chunk.

    Entries: {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"} for the gate+up GEMM,
    with an optional "down": {...} overriding all but BLOCK_M for the down GEMM. Host-only, cached."""
    if config_dir is None and os.environ.get("TRITON_INTERPRET", "0") == "1":
        return default_moe_config(E, N, K, top_k, dtype, num_tokens)
    directory = Path(config_dir or CONFIG_DIR)
    table = find_table(lambda device: str(directory / config_file_name(E, N, device, dtype, weights)), load_table,
                       device_name)  # fmt: skip
    if not table or not min(table) / 2 <= num_tokens <= 2 * max(table):
        return default_moe_config(E, N, K, top_k, dtype, num_tokens)
    return table[min(table, key=lambda bucket: (abs(bucket - num_tokens), bucket))]
