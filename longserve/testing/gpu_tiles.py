"""The attention kernels' launches as the GPU makes them, from the interpreter's records, for CI's sm90 compile check.

The interpreted tests launch the decode and extend attention kernels (mostly float32) at the interpreter's 16-wide
tiles (decode_config and extend_config answer so under TRITON_INTERPRET), so the check compiled variants no GPU runs:
the decode kernel's 64-key tiles and the extend kernel's 128x64 wgmma tiles on bf16 went unchecked until a GPU call.
`gpu_variants(records)` gives, for each recorded launch of these kernels, the same launch (its switches kept) on
bf16 tensors at each tile the GPU's config functions and the Triton backend's short-chunk tiles choose for the head
shapes of `bench latency`'s built-in models; greedily, only the variants needed to cover every switch value, head
shape and tile seen (as load_records covers the records).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from typing import Any

import torch

from longserve.testing import records

_DECODE = ("longserve.kernels.decode_attention", "_decode_split_kernel")
_EXTEND = ("longserve.kernels.extend_attention", "_extend_kernel")


def head_shapes() -> list[tuple[int, int]]:
    """(head_dim, query heads per kv head) of the built-in model shapes (bench/configs.py), test shapes aside."""
    from longserve.bench.configs import BUILTIN_CONFIGS

    shapes = set()
    for name, cfg in BUILTIN_CONFIGS.items():
        if name.startswith("tiny"):
            continue
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        shapes.add((head_dim, heads // cfg.get("num_key_value_heads", heads)))
    return sorted(shapes)


def _on_bf16(rec: dict[str, Any], tensors: tuple[str, ...]) -> dict[str, Any]:
    """rec with its model tensors (`tensors`) in bf16 and bf16's dot precision; float32 workspaces kept."""
    out = copy.deepcopy(rec)
    for name in tensors:
        if out["signature"][name] == "*fp32":
            out["signature"][name] = "*bf16"
    if out["constexprs"].get("DOT_PRECISION") == "ieee":
        out["constexprs"]["DOT_PRECISION"] = "tf32"
    return out


def _with_tile(rec: dict[str, Any], label: str, constexprs: dict, cfg: dict[str, int]) -> dict[str, Any]:
    out = copy.deepcopy(rec)
    out["constexprs"].update(constexprs, **{k: v for k, v in cfg.items() if k.startswith("BLOCK")})
    out["options"] = {**out["options"], **{k: v for k, v in cfg.items() if not k.startswith("BLOCK")}}
    out["tile"] = label
    return out


def _decode_tiles(rec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """decode_config's tiles, for a launch of few programs and of many (the warps follow the grid)."""
    import triton

    from longserve.kernels.decode_attention import DECODE_FEW_PROGRAMS, decode_config

    split = rec["constexprs"]["SPLIT"]
    # unsplit, the partials and the unused lock are the output itself (decode_attention's launch)
    own = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "lock_ptr")
    base = _on_bf16(rec, own + (() if split else ("mid_o_ptr", "mid_lse_ptr")))
    for head_dim, group in head_shapes():
        shape = {"HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim), "GROUP": group,
                 "BLOCK_H": max(16, triton.next_power_of_2(group))}  # fmt: skip
        for programs in (DECODE_FEW_PROGRAMS, DECODE_FEW_PROGRAMS + 1):
            cfg = decode_config(head_dim, torch.bfloat16, programs)
            yield _with_tile(base, f"decode {json.dumps(cfg)}", shape, cfg)


def _extend_tiles(rec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The Triton backend's launches on a GPU (attention/triton_backend.py extend_launch): extend_config's tile
    (4 warps when split over keys), and up to SHORT_TILES_MAX_HEAD_DIM the short chunks' tiles (64 rows, or 256)."""
    import triton

    from longserve.attention import triton_backend as tb
    from longserve.kernels.extend_attention import extend_config

    split = rec["constexprs"]["SPLIT"]
    base = _on_bf16(rec, ("q_ptr", "k_cache_ptr", "v_cache_ptr") + (() if split else ("o_ptr", "lse_ptr")))
    for head_dim, group in head_shapes():
        shape = {"HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim), "GROUP": group}
        plain = extend_config(head_dim, torch.bfloat16)
        tiles = [plain]
        if head_dim <= tb.SHORT_TILES_MAX_HEAD_DIM:
            short = [tb.short_chunk_config(plain, wide) for wide in (False, True)]
            tiles = short + [{**plain, "num_warps": tb.KEY_SPLIT_WARPS} if split else plain]
        for cfg in tiles:
            yield _with_tile(base, f"extend {json.dumps(cfg)}", shape, cfg)


_TILES: dict[tuple[str, str], Callable[[dict[str, Any]], Iterator[dict[str, Any]]]] = {
    _DECODE: _decode_tiles,
    _EXTEND: _extend_tiles,
}


def _features(rec: dict[str, Any]) -> set[records.Feature]:
    """As the compile check's, but the tile sizes count: head_dim (BLOCK_D) and the head group (BLOCK_H) aside,
    each tile is its own code, and so is each labelled tile."""
    return records.features(rec, lambda name: name in ("BLOCK_D", "BLOCK_H"))


def gpu_variants(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GPU's launches of the recorded attention kernels (each with its "tile"), covering every switch value,
    head shape and tile among them."""
    out = []
    for key, tiles in _TILES.items():
        variants = [v for rec in recs if (rec["module"], rec["name"]) == key for v in tiles(rec)]
        out += records.covering(variants, _features)
    return out
