"""The attention and fused-MoE kernels' launches as the GPU makes them, from the interpreter's records, for CI's
sm90 compile check.

The interpreted tests launch the decode and extend attention kernels (mostly float32) at the interpreter's 16-wide
tiles (decode_config and extend_config answer so under TRITON_INTERPRET), so the check compiled variants no GPU runs:
the decode kernel's 64-key tiles and the extend kernel's 128x64 wgmma tiles on bf16 went unchecked until a GPU call.
`gpu_variants(records)` gives, for each recorded launch of these kernels, the same launch (its switches kept) on
bf16 tensors at each tile the GPU's config functions and the Triton backend's short-chunk tiles choose for the head
shapes of `bench latency`'s built-in models. The fused MoE GEMM likewise (16x16x16 tiles, one stage, interpreted):
at default_moe_config's tiles in each of its regimes and every shipped table's (moe_configs/), for the record's
expert weights. Greedily, only the variants needed to cover every switch value, head shape and tile seen (as
load_records covers the records; records.covering).
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


# the fused MoE GEMM's variants: Qwen3-30B-A3B's shape (E=128, I=768, H=2048, top 8), the tables' shape; token
# counts in each of default_moe_config's regimes (T*k/E <= 16, <= 96, more); a real checkpoint's 128-wide groups
_MOE_SHAPE = {"num_experts": 128, "inter": 768, "hidden": 2048, "top_k": 8}
_MOE_TOKENS = (64, 1024, 8192)
_QUANT_GROUP = 128
_MOE_ACT = {"*bf16": torch.bfloat16, "*fp16": torch.float16, "*fp32": torch.float32}


def _moe_tiles(rec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """fused_moe's launches of the GEMM on a GPU: default_moe_config's tiles in each regime and every shipped
    table's (any GPU's) for the record's weights (16-bit: its activations' dtype; int4/int8; fp8_e4m3), the
    down GEMM's own where a config has them, BLOCK_K fit to the group (fused_moe.fit_block_k), and the constexprs
    that follow from the tile set by moe_gemm's own tile_switches."""
    from longserve.kernels import moe_gemm
    from longserve.kernels.fused_moe import fit_block_k
    from longserve.kernels.moe_config import CONFIG_DIR, default_moe_config, load_table

    c = rec["constexprs"]
    quant = c["WEIGHT_QUANT"]
    # the activations' dtype: before their quantization (fp8 experts: ACT_KIND), else the input's
    kinds = {kind: dtype for dtype, kind in moe_gemm._ACT_KIND.items()}
    act = kinds[c["ACT_KIND"]] if c["ACT_KIND"] else _MOE_ACT[rec["signature"]["a_ptr"]]
    weights = {0: str(act).removeprefix("torch."), 1: f"int{c['BITS']}", 2: "fp8_e4m3"}[quant]
    configs = [default_moe_config(**_MOE_SHAPE, dtype=act, num_tokens=t) for t in _MOE_TOKENS]
    for path in sorted(CONFIG_DIR.glob(f"*dtype={weights}.json")):
        configs += (load_table(str(path)) or {}).values()
    down = c["MUL_ROUTED_WEIGHT"] and not c["SILU_AND_MUL"]
    # the GEMM's [N, K]: gate+up's N counts the output columns (the intermediate size), down's K does
    hidden, inter = _MOE_SHAPE["hidden"], _MOE_SHAPE["inter"]
    out_cols, depth = (hidden, inter) if down else (inter, hidden)
    per_group = quant == 1 and not c["HAS_GIDX"] or quant == 2 and c["GROUP_BLOCKS"] < 1 << 30
    group = _QUANT_GROUP if per_group else depth  # act order / per channel: one group over K
    base = copy.deepcopy(rec)
    if quant == 2 and c["BLOCK_N_SCALE"] > 1:  # block FP8: 128 x 128 scale blocks
        base["constexprs"]["BLOCK_N_SCALE"] = _QUANT_GROUP
    for cfg in configs:
        cfg = {**cfg, **cfg.get("down", {}), "BLOCK_M": cfg["BLOCK_M"]} if down else cfg
        tile = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")}
        if per_group:
            tile["BLOCK_K"] = fit_block_k(tile["BLOCK_K"], group)
        switches = moe_gemm.tile_switches(
            quant, group, depth, out_cols, base["constexprs"]["BLOCK_N_SCALE"], tile
        )
        label = f"moe {weights} {json.dumps({k: v for k, v in tile.items() if k != 'GROUP_M'})}"
        yield _with_tile(base, label, {"GROUP_M": tile["GROUP_M"], **switches}, tile)


_TILES: dict[tuple[str, str], Callable[[dict[str, Any]], Iterator[dict[str, Any]]]] = {
    _DECODE: _decode_tiles,
    _EXTEND: _extend_tiles,
    ("longserve.kernels.moe_gemm", "_moe_gemm_kernel"): _moe_tiles,
}


def _features(rec: dict[str, Any]) -> set[records.Feature]:
    """As the compile check's, but the tile sizes count: head_dim (BLOCK_D) and the head group (BLOCK_H) aside,
    each tile is its own code, and so is each labelled tile."""
    return records.features(rec, lambda name: name in ("BLOCK_D", "BLOCK_H"))


def gpu_variants(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GPU's launches of the recorded attention and fused MoE kernels (each with its "tile"), covering every
    switch value, head shape and tile among them."""
    out = []
    for key, tiles in _TILES.items():
        variants = [v for rec in recs if (rec["module"], rec["name"]) == key for v in tiles(rec)]
        out += records.covering(variants, _features)
    return out
