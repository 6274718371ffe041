"""Building blocks shared by the decoder models: RMSNorm, fused (stacked) linears, SiLU-and-mul.

Fused linears hold several HF projections stacked along the output dim (q|k|v, gate|up). The one table
`STACKED_PARAMS` says which HF tensor goes into which shard, so a tensor-parallel loader can later slice
each shard per rank in `MergedLinear.weight_loader` without touching the models.
The `*_ref` functions are the torch references of the Triton kernels in longserve/kernels (same
signatures); layers run the kernel on CUDA tensors when triton imports (`use_triton`), else the reference.
"""

from __future__ import annotations

import functools

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


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    """Whether the fused Triton kernels serve `x`: CUDA tensors when triton imports; never on the CPU."""
    return x.is_cuda and triton_available()


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> y [..., H]: normalized in float32, cast back, then scaled (HF's way)."""
    in_dtype = x.dtype
    h = x.to(torch.float32)  # [..., H]
    variance = h.pow(2).mean(-1, keepdim=True)  # [..., 1]
    h = h * torch.rsqrt(variance + eps)  # [..., H]
    return weight * h.to(in_dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [..., H], residual [..., H]) -> (rms_norm(x + residual) [..., H], x + residual [..., H]).

    The sum is taken in float32 and stored in x's dtype (what torch does for a half-precision add), and
    the norm reads that stored sum, so the output equals `norm(residual + x)` of the unfused layer.
    """
    new_residual = (x.float() + residual.float()).to(x.dtype)  # [..., H]
    return rms_norm_ref(new_residual, weight, eps), new_residual


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, exactly like HF's LlamaRMSNorm.

    `norm(x)` -> y; `norm(x, residual)` -> (y, new_residual) with new_residual = x + residual, y its norm
    (vLLM style: the residual add of the previous sub-layer is fused into this norm).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if use_triton(x):
            from longserve.kernels.norm import fused_add_rms_norm, rms_norm  # imports triton

            if residual is None:
                return rms_norm(x, self.weight, self.eps)  # [..., H]
            return fused_add_rms_norm(x, residual, self.weight, self.eps)  # ([..., H], [..., H])
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps)  # [..., H]
        return fused_add_rms_norm_ref(x, residual, self.weight, self.eps)  # ([..., H], [..., H])


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


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x = gate|up [T, 2I] (gate first, as gate_up_proj stacks them) -> silu(gate) * up [T, I]."""
    gate, up = x.chunk(2, dim=-1)  # [T, I] each
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = gate|up [T, 2I] -> silu(gate) * up [T, I]; the Triton kernel on CUDA, else the reference."""
    if use_triton(x):
        from longserve.kernels.activation import silu_and_mul as silu_and_mul_triton  # imports triton

        return silu_and_mul_triton(x)  # [T, I]
    return silu_and_mul_ref(x)  # [T, I]


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)}, model {tuple(param.shape)}")
    param.data.copy_(loaded)
