"""Building blocks shared by the decoder models: RMSNorm, fused (stacked) linears, SiLU-and-mul.

Fused linears hold several HF projections stacked along the output dim (q|k|v, gate|up). The one table
`STACKED_PARAMS` says which HF tensor goes into which shard, so a tensor-parallel loader can later slice
each shard per rank in `MergedLinear.weight_loader` without touching the models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# (fused param module name, HF module name, shard id) -- the single source of the fused-weight mapping.
STACKED_PARAMS: tuple[tuple[str, str, str], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, exactly like HF's LlamaRMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        h = x.to(torch.float32)  # [..., H]
        variance = h.pow(2).mean(-1, keepdim=True)  # [..., 1]
        h = h * torch.rsqrt(variance + self.eps)  # [..., H]
        return self.weight * h.to(in_dtype)


class MergedLinear(nn.Module):
    """A linear layer whose output is several named shards stacked in order (e.g. q|k|v).

    `weight_loader(param, loaded, shard_id)` copies one HF tensor into its slice of the fused parameter.
    `shard_id=None` loads the whole fused tensor (a checkpoint already saved fused).
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in self.shard_sizes.items():
            self.shard_offsets[name] = offset
            offset += size
        self.out_features = offset
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features))
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        for p in self.parameters():
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None) -> None:
        if shard_id is None:
            target = param.data
        else:
            target = param.data.narrow(0, self.shard_offsets[shard_id], self.shard_sizes[shard_id])
        if target.shape != loaded.shape:
            raise ValueError(
                f"shape mismatch for shard {shard_id!r}: checkpoint {tuple(loaded.shape)}, "
                f"model expects {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # [T, out_features]

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split a fused output [T, out_features] back into its shards, in order."""
        return y.split(list(self.shard_sizes.values()), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = gate|up [T, 2I] -> silu(gate) * up [T, I]."""
    gate, up = x.chunk(2, dim=-1)  # [T, I] each
    return F.silu(gate) * up


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)}, model {tuple(param.shape)}")
    param.data.copy_(loaded)
