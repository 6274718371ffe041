"""A quantized module's scheme: plain data of how a checkpoint stores its weights (and, for W8A8, how its
activations are quantized), one frozen dataclass per family. models/quant/config.py's formats decide a
module's scheme from its checkpoint name; models/quant/bind.py turns schemes into methods."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IntScheme:
    """Integer weights, float activations (W4A16 / W8A16); `checkpoint` names the tensors' layout."""

    bits: int
    group_size: int  # -1: one group per output channel
    sym: bool
    act_order: bool  # g_idx may permute the groups (GPTQ desc_act, compressed-tensors actorder "group")
    checkpoint: str  # "gptq" (v1 zeros, stored minus one), "gptq_v2", "awq", "ct"
    # whether the checkpoint stores g_idx: GPTQ writers always do; compressed-tensors wrote weight_g_idx for
    # actorder "group" until 0.20 stopped (bind.py looks at the checkpoint's tensor names)
    g_idx_tensor: bool = True


@dataclass(frozen=True)
class Fp8Scheme:
    """e4m3 weights and activations. weight: "block" (scales per block of `block` [n, k]), "channel" or
    "tensor"; activation: "dynamic" (per token, or per token-group of block[1]) or "static" (per tensor);
    checkpoint: "fp8" (weight_scale_inv for blocks, weight_scale per tensor), "ct", "online" (a float
    checkpoint quantized per channel while loading)."""

    weight: str
    activation: str
    checkpoint: str
    block: tuple[int, int] | None = None


@dataclass(frozen=True)
class Int8Scheme:
    """int8 weights (symmetric, per channel or tensor) and int8 activations (per token, or static)."""

    weight: str
    activation: str


Scheme = IntScheme | Fp8Scheme | Int8Scheme
