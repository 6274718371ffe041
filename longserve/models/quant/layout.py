"""Where a parameter's checkpoint tensor keeps its output and input features, so one weight loader serves
plain and quantized parameters alike (vLLM's parameter classes, as one small record).

A quantized module's tensors differ in layout: GPTQ's qweight is [K / 8, N] (input features packed 8 to an
int32 along dim 0, outputs on dim 1), its scales [K / group, N], AWQ's qweight [K, N / 8], a block-FP8
weight_scale_inv [N / 128, K / 128], compressed-tensors' weight_packed [N, K / 8]. Tensor parallelism slices
output rows (column-parallel layers, each fused shard apart) or input columns (row-parallel layers), and a
fused layer stacks its shards along the outputs; `WeightLayout` (a parameter's `weight_layout` attribute;
plain [out, in] without one) says which dim holds which, and how many
features one entry covers (`out_pack`, `in_pack`: a packing factor, a group or a block), so that the loader
narrows every tensor of a module consistently. A region must start on an entry boundary: a shard or a rank
whose features begin inside a packed word, group or block cannot be sliced (the error says so).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WeightLayout:
    """out_dim / in_dim: the dim of the output / input features (None: the tensor has none, e.g. g_idx has
    no output dim and is the same for every shard of a fused layer; a per-channel scale has no input dim and
    is whole on every row-parallel rank). per_shard: one entry per fused shard (per-tensor scales)."""

    out_dim: int | None = 0
    in_dim: int | None = 1
    out_pack: int = 1
    in_pack: int = 1
    per_shard: bool = False


PLAIN = WeightLayout()  # [out, in] (a 1-d bias: out only; `in_dim` past its dims is ignored)


def layout_of(param: torch.Tensor) -> WeightLayout:
    return getattr(param, "weight_layout", PLAIN)


def packed_region(start: int, size: int, pack: int, full: int, what: str) -> tuple[int, int]:
    """The entries [first, first + count) that hold features [start, start + size) of `full` when an entry
    covers `pack` features (the last entry may be partial: ceil). ValueError when a region boundary falls
    inside an entry."""
    if pack == 1:
        return start, size
    end = start + size
    if start % pack or (end % pack and end != full):
        raise ValueError(
            f"{what}: features [{start}, {end}) of {full} do not start and end on a boundary of the "
            f"checkpoint's {pack}-feature packing/groups/blocks; choose a tensor-parallel size that keeps "
            "every rank's share (and every fused shard) a multiple of it"
        )
    return start // pack, -(-end // pack) - start // pack


def entries(features: int, pack: int) -> int:
    return -(-features // pack)


def tensor_name(loaded) -> str:
    """A checkpoint tensor's name for messages (`CheckpointSlice.name`), or a generic phrase."""
    name = getattr(loaded, "name", None)
    return f"checkpoint tensor {name!r}" if name else "a checkpoint tensor"


def check_dtype(param: torch.Tensor, loaded) -> None:
    """Refuse a checkpoint tensor whose dtype does not fit the parameter (never an upcast of quantized
    values into a float weight): `param.ckpt_dtypes` lists the allowed dtypes of a quantized parameter; a
    plain float parameter takes any float of at least 16 bits (fp8 weights need their format's scales)."""
    dtype = getattr(loaded, "dtype", None)
    allowed = getattr(param, "ckpt_dtypes", None)
    if allowed is not None:
        if dtype not in allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            raise ValueError(
                f"{tensor_name(loaded)} is {str(dtype).removeprefix('torch.')}, but the checkpoint's "
                f"quantization format stores it as {names}"
            )
        return
    if not param.is_floating_point():
        return
    if dtype is None or not dtype.is_floating_point or dtype.itemsize < 2:
        raise ValueError(
            f"{tensor_name(loaded)} is {str(dtype).removeprefix('torch.')}: quantized values, but config.json "
            "declares no quantization for this layer (its quantization_config is missing, or leaves the layer "
            "unquantized); loading them as plain weights would compute garbage. Use the checkpoint's own "
            "config.json, or --quantization naming its format"
        )
