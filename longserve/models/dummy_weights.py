"""`--load-format dummy`: random weights of a built model, the same model whatever the tensor-parallel size (each
rank keeps its part of a whole drawn tensor, through the checkpoint loaders), quantized parameters drawn in their
format (models/quant/dummy.py). The benchmarks' models (`bench latency --load-format dummy`)."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from longserve.models.layers import MergedLinear, RMSNorm, RowParallelLinear, VocabParallelEmbedding
from longserve.models.moe import FusedMoE
from longserve.models.quant.dummy import fill_dummy, is_quantized_param

__all__ = ["init_dummy_weights"]


@torch.no_grad()
def init_dummy_weights(model: nn.Module, std: float, seed: int) -> None:
    """Random weights: normal(0, std), RMSNorm weights = 1 (a zero-centered one's offset 0); deterministic per
    seed, device and parameter name, and the same model whatever the tensor-parallel size: a sharded parameter draws its whole
    (unsharded) tensor and keeps its rank's part through the checkpoint loaders, as if read from a file.
    Quantized parameters are drawn in their format (models/quant/dummy.py)."""
    owners = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    for name, param in model.named_parameters():
        owner = owners[id(param)]
        if isinstance(owner, RMSNorm):
            param.fill_(0.0 if owner.zero_centered else 1.0)
            continue
        generator = torch.Generator(device=param.device).manual_seed(
            (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
        )
        if is_quantized_param(param):  # packed integers, fp8 values, scales: in the checkpoint's format
            fill_dummy(owner, param, std, generator)
            continue
        full = _unsharded_shape(owner, param)
        if full == tuple(param.shape):
            param.normal_(0.0, std, generator=generator)
            continue
        tensor = torch.empty(full, dtype=param.dtype, device=param.device).normal_(
            0.0, std, generator=generator
        )
        if isinstance(owner, MergedLinear):
            owner.weight_loader(param, tensor, None)
        else:
            param.weight_loader(param, tensor)  # type: ignore[attr-defined]


def _unsharded_shape(owner: nn.Module, param: nn.Parameter) -> tuple[int, ...]:
    """The shape of `param` in a tensor-parallel size 1 model (its checkpoint tensor)."""
    full = getattr(param, "full_shape", None)  # a parameter that says so (models/gated_delta_net.py)
    if full is not None:
        return tuple(full)
    if isinstance(owner, MergedLinear):
        return (sum(owner.full_shard_sizes.values()), *param.shape[1:])
    if isinstance(owner, RowParallelLinear) and param is owner.weight:
        return (owner.out_features, owner.in_features * owner.tp_size)
    if isinstance(owner, VocabParallelEmbedding):
        return (owner.num_embeddings, param.shape[1])
    if isinstance(owner, FusedMoE):
        return owner.full_shape(param)
    return tuple(param.shape)
