"""Random weights in a quantized format (`--load-format dummy` with a quantization_config or
`--quantization`): random packed integers, e4m3 or int8 values, scales sized so that the dequantized weights
have about the initializer's std, the plain group index, the real shapes. Each checkpoint tensor of a module
is drawn whole (every fused shard, every expert) from the parameter's generator and handed to its weight
loader, as a file's would be, so that every tensor-parallel rank keeps its part of the same model."""

from __future__ import annotations

import torch
from torch import nn

from longserve.kernels.quant_reference import FP8_DTYPE, FP8_MAX
from longserve.models.layers import MergedLinear, RowParallelLinear
from longserve.models.moe import FusedMoE
from longserve.models.quant.layout import entries, layout_of


def is_quantized_param(param: nn.Parameter) -> bool:
    return getattr(param, "dummy_kind", None) is not None


def _pieces(
    owner: nn.Module, param: nn.Parameter
) -> list[tuple[str | None, tuple[int, ...], tuple[int, int]]]:
    """(shard id, the checkpoint tensor's full shape, its module's full [out, in]) of each tensor feeding
    `param`: one per fused shard, one per expert and projection, or one."""
    layout = layout_of(param)
    shape = list(param.shape)
    if isinstance(owner, MergedLinear):
        pieces = []
        for shard, full in owner.full_shard_sizes.items():
            if layout.per_shard:
                piece = shape[1:]
            elif layout.out_dim is None or layout.out_dim >= len(shape):
                piece = shape
            else:
                piece = list(shape)
                piece[layout.out_dim] = entries(full, layout.out_pack)
            pieces.append((shard, tuple(piece), (full, owner.in_features)))
        return pieces
    if isinstance(owner, RowParallelLinear):
        full_in = owner.in_features * owner.tp_size
        piece = shape[1:] if layout.per_shard else list(shape)
        if not layout.per_shard and layout.in_dim is not None and layout.in_dim < len(piece):
            piece[layout.in_dim] = entries(full_in, layout.in_pack)
        return [(None, tuple(piece), (owner.out_features, full_in))]
    if isinstance(owner, FusedMoE):
        kinds = ("gate", "up") if param.moe_proj == "w13" else ("down",)  # type: ignore[attr-defined]
        row = shape[1:]
        full_i, h = owner.intermediate_size, owner.hidden_size
        pieces = []
        for e in range(owner.num_experts):
            for kind in kinds:
                piece = list(row[1:] if layout.per_shard else row)
                if layout.per_shard:
                    pass
                elif kind == "down":  # the intermediate dim is the input: this rank's slice of it
                    if layout.in_dim is not None and layout.in_dim < len(piece):
                        piece[layout.in_dim] = entries(full_i, layout.in_pack)
                elif layout.out_dim is not None and layout.out_dim < len(piece):
                    piece[layout.out_dim] = entries(full_i, layout.out_pack)
                pieces.append((f"{kind}:{e}", tuple(piece), (h, full_i) if kind == "down" else (full_i, h)))
        return pieces
    return [(None, tuple(shape), (0, 0))]


def _draw(param: nn.Parameter, shape: tuple[int, ...], full: tuple[int, int], std: float, g: torch.Generator):
    kind = param.dummy_kind  # type: ignore[attr-defined]
    div = getattr(param, "dummy_div", 1.0)
    dev = param.device
    if kind == "bits":
        return torch.randint(-(2**31), 2**31, shape, generator=g, device=dev, dtype=torch.int64).to(
            torch.int32
        )
    if kind == "scale":  # one a group or block, each its own as in a real checkpoint
        # One scale for the whole tensor left a 4-bit weight 16 distinct values: the 8B's int4 cold 128K ran its
        # SM clock at ~1,730 MHz where bf16's ran at ~1,470, both at the 700 W limit (RESULTS.md forty-second
        # session), likely a tensor-core GEMM's data-dependent power, which real weights would not get.
        base = std / div
        scales = base * (0.5 + torch.rand(shape, generator=g, device=dev))  # mean: the initializer's std
        return scales.to(torch.float16 if base > 1e-4 else torch.float32)
    if kind == "act_scale":  # a static activation scale: activations of magnitude ~4
        return torch.full(shape, 4.0 / div, dtype=torch.float32, device=dev)
    if kind == "g_idx":
        group = param.dummy_group  # type: ignore[attr-defined]
        return (torch.arange(shape[-1], device=dev) // group).to(torch.int32).expand(shape).contiguous()
    if kind == "shape":
        return torch.tensor(full, dtype=torch.int64, device=dev).expand(shape).contiguous()
    if kind == "fp8":
        w = torch.empty(shape, device=dev).normal_(0.0, 1.0, generator=g)
        return w.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    if kind == "int8":
        return torch.randint(-127, 128, shape, generator=g, device=dev, dtype=torch.int64).to(torch.int8)
    raise ValueError(f"no dummy weights for a quantized parameter of kind {kind!r}")


@torch.no_grad()
def fill_dummy(owner: nn.Module, param: nn.Parameter, std: float, generator: torch.Generator) -> None:
    """Draw every checkpoint tensor of `param` and load it through its weight loader."""
    loader = param.weight_loader  # type: ignore[attr-defined]
    for shard, shape, full in _pieces(owner, param):
        tensor = _draw(param, shape, full, std, generator)
        if isinstance(owner, RowParallelLinear) or shard is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard)
