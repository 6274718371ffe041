"""Tuned tiles of the decode GEMVs per GPU: JSON tables in `gemv_configs/`, one per (kernel, device), that
`python -m longserve.kernels.tune_gemv` writes from timings on that GPU, read by the GEMVs' config functions
(fp8_gemv.fp8_gemv_config; quant_gemv.wna16_gemv_config for the one-row int4 kernel; dense_gemm.tuned_dense_config
for the 16-bit GEMM, whose entries also say where it beats cuBLAS). Where no table or entry fits, those functions
keep their untuned defaults.

Why: the defaults size SPLIT_K for ~8 programs an SM, and what is best differs by kernel and shape. Measured on
an H200 (2026-12-02, 35fd681, `bench_quant_kernels.py --sweep-gemv --sweep-tokens 1`, RESULTS.md seventh
session), at M=1: the block-FP8 GEMV read the Llama-3.1-8B gate_up weights in 35.0 us with 2 splits against
40.4 with the default's 3, and down in 23.4 us with 128-row tiles and 16 splits against 27.7 (64 rows, 17);
the int4 general kernel wanted more splits instead (gate_up 6 against 3: 38.1 against 42.0 us).

Entries are exact: the kernel's name (the variant in it: `int4_fast_gemv_bk128`), N, K and M; a shape that was
not timed gets the default (the dense GEMM, kernels/dense_gemm.py, reads the entry of M's next power of two, and
no entry means cuBLAS there). File: `kernel=KERNEL,device_name=NVIDIA_H200.json`, {"N,K,M": {"BLOCK_N": ..,
"SPLIT_K": .., "num_warps": .., optionally "num_stages": ..}, ...}.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import torch

from longserve.kernels.moe_config import find_table

__all__ = [
    "OPTIONAL_KEYS",
    "TABLE_DIR",
    "TABLE_KEYS",
    "gemv_table_name",
    "load_gemv_table",
    "tuned_gemv_config",
]

TABLE_DIR = Path(__file__).parent / "gemv_configs"
TABLE_KEYS = ("BLOCK_N", "SPLIT_K", "num_warps")
OPTIONAL_KEYS = ("num_stages",)  # the dense GEMM's pipeline depth (tl.dot's loads), which it tunes too


def gemv_table_name(kernel: str, device_name: str) -> str:
    return f"kernel={kernel},device_name={device_name.replace(' ', '_')}.json"


@lru_cache(maxsize=32)
def load_gemv_table(path: str) -> dict[tuple[int, int, int], dict[str, int]]:
    """(N, K, M) -> tiles, checked once per file; empty when the file does not exist."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        raw = json.load(f)
    table = {}
    for key, cfg in raw.items():
        dims = key.split(",")
        ok = len(dims) == 3 and all(d.isdigit() for d in dims) and isinstance(cfg, dict)
        if (
            not ok
            or not set(TABLE_KEYS) <= set(cfg) <= set(TABLE_KEYS + OPTIONAL_KEYS)
            or not all(isinstance(v, int) and v > 0 for v in cfg.values())
        ):
            raise ValueError(
                f"{path}: bad entry {key!r}: {cfg} (needs 'N,K,M': {{{', '.join(TABLE_KEYS)}}}, optionally "
                f"{', '.join(OPTIONAL_KEYS)})"
            )
        n, k, m = map(int, dims)
        table[(n, k, m)] = dict(cfg)
    return table


def tuned_gemv_config(
    kernel: str, n: int, k: int, m: int, device: torch.device, table_dir: str | Path | None = None
) -> dict[str, int] | None:
    """The table's tiles for this product on this GPU, or None (no table, no entry, not a CUDA device, or the
    Triton interpreter, whose tiles are the defaults')."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return None
    directory = Path(table_dir or TABLE_DIR)  # its own table, else its architecture's reference part's
    table = find_table(
        lambda name: str(directory / gemv_table_name(kernel, name)), load_gemv_table, index=device.index or 0
    )
    return None if table is None else table.get((n, k, m))
