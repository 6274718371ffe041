"""Rotary position embedding with the HF rope types default, linear, llama3 and yarn.

Numerics follow HF: inverse frequencies and cos/sin are computed in float32, then cast to the activation
dtype; the rotation uses HF's rotate_half convention (the two halves of the rotated dims, not interleaved pairs).
On the CPU each step computes cos/sin [T, R] from its positions (HF-exact); on CUDA with triton the fused
kernel (longserve/kernels/rope.py) gathers rows of a float32 cos|sin cache [max_positions, R] instead.
R is the rotary dim: head_dim D, or int(D * partial_rotary_factor) (Qwen3.5, Qwen3-Next: 64 of 256), where only
each head's first R dims rotate and the other D - R pass through (HF's apply_rotary_pos_emb).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from longserve.kernels.rope_reference import apply_rotary
from longserve.platform import use_triton

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# the rotary kernel also stores each layer's new K/V into the cache (kernels/rope.py; an fp8 cache quantized
# there too since 07a708b: the A3B decode with an fp8 cache took 5.87 ms at b1@32K and 24.76 at b64@4K before
# (35fd681), 5.15 and 23.90 after (c2dd2fd; H200, two calls of 2026-12-02, RESULTS.md seventh and eighth
# sessions)), instead of the attention backend's two index_copy
# launches, ~8 for fp8 (in the H200 profile of decode b1 at 32K, 2026-12-02, 73be6a4,
# the pair took 0.145 ms of a 5.81 ms step, plus the gaps between launches); and it applies Qwen3's per-head
# q/k RMSNorm (two launches a layer fewer). Both on against both off, Qwen3-30B-A3B shape on an H200
# (2026-12-02, 3672e1d, RESULTS.md): decode b1@4K 4.45 -> 4.15 ms, b1@32K 5.30 -> 5.01 ms, b64@4K 25.43 ->
# 24.80 ms. Each alone is not measured (`gpu_check.sh fusions`, `fusions-a3b` are the A/Bs).
FUSE_KV_STORE = True
FUSE_QK_NORM = True


def rope_parameters_from_config(hf_config: Any) -> dict[str, Any]:
    """Normalize transformers 5 `rope_parameters` and older `rope_theta` + `rope_scaling` into one dict."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope parameters are not supported")
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    if params["rope_type"] in ("llama3", "yarn") and params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = getattr(
            hf_config, "original_max_position_embeddings", None
        ) or getattr(hf_config, "max_position_embeddings", None)
    # transformers 5 moves a top-level partial_rotary_factor into rope_parameters; older configs keep it outside
    factor = (
        params.pop("partial_rotary_factor", None) or getattr(hf_config, "partial_rotary_factor", None) or 1.0
    )
    if factor != 1.0:
        if not 0.0 < factor < 1.0:
            raise ValueError(f"partial_rotary_factor={factor} is not supported; it must be in (0, 1]")
        params["partial_rotary_factor"] = float(factor)
    # Qwen3.5's text rotary is "mrope" (Qwen3_5MoeTextRotaryEmbedding): each frequency slot takes the temporal,
    # height or width position id by mrope_section (interleaved or in sections). Text-only inputs (all longserve
    # serves) give a token three equal ids, so every slot takes the same position: plain rope over the rotary dim
    # (tests/unit/test_partial_rotary.py checks it against transformers' class)
    params.pop("mrope_section", None)
    params.pop("mrope_interleaved", None)
    return params


def rotary_dim(head_dim: int, params: dict[str, Any]) -> int:
    """The dims of each head that rotate: head_dim, or int(head_dim * partial_rotary_factor) as HF computes it."""
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if dim <= 0 or dim % 2:
        raise ValueError(f"the rotary dim {dim} of head_dim {head_dim} must be even and positive")
    return dim


def _default_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [D/2]


def _llama3_inv_freq(dim: int, p: dict[str, Any]) -> torch.Tensor:
    inv_freq = _default_inv_freq(dim, p["rope_theta"])  # [D/2]
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, p: dict[str, Any], max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    base = p["rope_theta"]
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position_embeddings / orig

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)  # [D/2]
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def compute_inv_freq(
    head_dim: int, params: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [R/2] float32, attention_scaling) for a normalized rope parameter dict; R = `rotary_dim`
    (every HF rope type computes its frequencies over the rotary dim, not head_dim)."""
    rope_type, dim = params["rope_type"], rotary_dim(head_dim, params)
    if rope_type == "default":
        return _default_inv_freq(dim, params["rope_theta"]), 1.0
    if rope_type == "linear":
        return _default_inv_freq(dim, params["rope_theta"]) / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(dim, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, params, max_position_embeddings)
    raise ValueError(
        f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(nn.Module):
    """Computes cos/sin [T, R] for absolute positions [T] (R = rotary_dim, head_dim unless partial rotary);
    apply with `apply_rotary`, which rotates the first R dims of each head."""

    def __init__(self, head_dim: int, params: dict[str, Any], max_position_embeddings: int) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = compute_inv_freq(head_dim, params, max_position_embeddings)
        # float32 whatever the default dtype; derived from the config, never loaded from a checkpoint
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim(head_dim, params)  # the width of cos/sin: how much of each head rotates
        self.max_positions = max_position_embeddings  # rows of the fused path's cache; see `reserve`
        self._cos_sin_cache: torch.Tensor | None = None  # built on first fused use, not a buffer

    def reserve(self, num_positions: int) -> None:
        """Make the fused path's cache cover positions [0, num_positions). Call it with the context length
        when that exceeds max_position_embeddings, before CUDA graph capture: the kernel does not
        bound-check positions."""
        if num_positions > self.max_positions:
            self.max_positions = num_positions
            self._cos_sin_cache = None

    def cos_sin_cache(self) -> torch.Tensor:
        """[max_positions, R] float32 on inv_freq's device: row p = cos(p * inv_freq) | sin(p * inv_freq),
        both times attention_scaling. Built on first use (before CUDA graph capture, in warm-up)."""
        cache = self._cos_sin_cache
        if cache is None or cache.device != self.inv_freq.device:
            pos = torch.arange(self.max_positions, dtype=torch.float32, device=self.inv_freq.device)  # [P]
            freqs = pos[:, None] * self.inv_freq.float()  # [P, R/2]
            cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
            cache = self._cos_sin_cache = torch.cat((cos, sin), dim=-1)  # [P, R]
        return cache

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryStep:
        """The rotary inputs of one step, shared by every layer: fused kernel inputs on CUDA, else cos/sin."""
        if use_triton(positions):
            return RotaryStep(positions, cos_sin_cache=self.cos_sin_cache())
        cos, sin = self(positions, dtype)  # [T, R] each
        return RotaryStep(positions, cos=cos, sin=sin)

    @classmethod
    def from_config(cls, hf_config: Any, head_dim: int) -> RotaryEmbedding:
        return cls(head_dim, rope_parameters_from_config(hf_config), hf_config.max_position_embeddings)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.float()  # [T, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, R]
        cos = emb.cos() * self.attention_scaling  # [T, R]
        sin = emb.sin() * self.attention_scaling  # [T, R]
        return cos.to(dtype), sin.to(dtype)


class Rotated(NamedTuple):
    """What `RotaryStep.apply_and_store` hands back: q and k rotated, whether the new K/V are in the cache, and
    whether the rotated q went to the `q_dst` asked for as well."""

    q: torch.Tensor
    k: torch.Tensor
    kv_stored: bool
    q_placed: bool


@dataclass(frozen=True)
class RotaryStep:
    """Rotary inputs of one step: cos/sin [T, R] (torch path) or cos_sin_cache [P, R] (Triton path); R <= D, the
    rotated dims of each head (partial rotary: the rest pass through)."""

    positions: torch.Tensor  # [T]
    cos: torch.Tensor | None = None  # [T, R] in the activation dtype
    sin: torch.Tensor | None = None  # [T, R]
    cos_sin_cache: torch.Tensor | None = None  # [P, R] float32

    def apply_and_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: Any,
        layer_id: int,
        slots: torch.Tensor,
        qk_norm: tuple[Any, Any] | None = None,
        q_dst: torch.Tensor | None = None,
    ) -> Rotated:
        """`apply`, after the heads' RMSNorm (`qk_norm`: Qwen3's q_norm and k_norm modules, zero-centered for
        Qwen3.5) if given. On the fused path one launch does it all: the norms (weights in q's dtype, their
        `zero_centered` carried into the kernel), the rotation, the store of the rotated keys and the values into
        their slots (quantized for an fp8 cache), and with `q_dst` (an attention backend's `q_destination`) the
        rotated q into it too. The torch path leaves the store and q's copy to the attention backend."""
        if self.cos_sin_cache is None:
            if qk_norm is not None:
                q, k = qk_norm[0](q), qk_norm[1](k)
            q, k = self.apply(q, k)
            return Rotated(q, k, False, False)
        from longserve.kernels.rope import rotary_embedding  # imports triton

        norm_args = None
        if qk_norm is not None:
            q_norm, k_norm = qk_norm
            if (
                FUSE_QK_NORM
                and q_norm.weight.dtype == k_norm.weight.dtype == q.dtype
                and q_norm.eps == k_norm.eps
                and q_norm.zero_centered == k_norm.zero_centered
            ):
                norm_args = (q_norm.weight, k_norm.weight, q_norm.eps, q_norm.zero_centered)
            else:
                q, k = q_norm(q), k_norm(k)
        store = None
        if FUSE_KV_STORE:  # an fp8 cache quantized in the same launch, with the layer's scales
            k_slots, v_slots = kv_cache.slots(layer_id)
            store = (v, slots, k_slots, v_slots, kv_cache.k_scales[layer_id], kv_cache.v_scales[layer_id])
        q, k = rotary_embedding(
            self.positions, q, k, self.cos_sin_cache, store=store, qk_norm=norm_args, q_dst=q_dst
        )
        return Rotated(q, k, store is not None, q_dst is not None)

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] -> rotated (q, k) (their first R dims); the fused path rotates in place."""
        if self.cos_sin_cache is not None:
            from longserve.kernels.rope import rotary_embedding  # imports triton

            return rotary_embedding(self.positions, q, k, self.cos_sin_cache)
        assert self.cos is not None and self.sin is not None
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)
