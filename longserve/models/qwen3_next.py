"""Qwen3-Next (`Qwen3NextForCausalLM`): Qwen3.5-MoE's hybrid decoder (models/hybrid.py) with its linear layers'
input projections fused per key head in the checkpoint. transformers' `fix_query_key_value_ordering` reads them:

    in_proj_qkvz [Hk * (2K + 2 (Hv/Hk) V), H]: for each key head, its q (K rows), k (K), its Hv/Hk value heads' v
                                               ((Hv/Hk) V) and z ((Hv/Hk) V)
    in_proj_ba   [Hk * 2 (Hv/Hk), H]:         for each key head, its value heads' b (Hv/Hk), then a (Hv/Hk)

The loader regroups them into Qwen3.5's tensors (`in_proj_qkv` = all q | all k | all v, `in_proj_z`, `in_proj_b`,
`in_proj_a`), which the layer's fused projections load as usual (each rank its heads); a quantized fused tensor is
refused by name (its packing would have to be regrouped as well).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from longserve.models.hybrid import Qwen3_5MoeForCausalLM
from longserve.models.layers import as_tensor

_FUSED = (".linear_attn.in_proj_qkvz.", ".linear_attn.in_proj_ba.")


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(self._regrouped(weights))

    def _regrouped(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        cfg = self.config
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        k_dim, v_dim, per = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
        for name, tensor in weights:
            fused = next((f for f in _FUSED if f in name), None)
            if fused is None:
                yield name, tensor
                continue
            if not name.endswith(".weight"):
                raise ValueError(
                    f"checkpoint tensor {name!r}: a quantized fused Qwen3-Next projection is not supported "
                    "(only float in_proj_qkvz / in_proj_ba)"
                )
            w = as_tensor(tensor)  # [rows, H]
            prefix = name[: name.index(fused)] + ".linear_attn."
            if fused.endswith("qkvz."):
                groups = w.view(hk, 2 * k_dim + 2 * per * v_dim, -1)  # [Hk, rows a key head, H]
                q, k, v, z = groups.split([k_dim, k_dim, per * v_dim, per * v_dim], dim=1)
                qkv = torch.cat([t.reshape(-1, w.shape[1]) for t in (q, k, v)])  # q | k | v, heads in order
                yield prefix + "in_proj_qkv.weight", qkv
                yield prefix + "in_proj_z.weight", z.reshape(-1, w.shape[1])
            else:
                b, a = w.view(hk, 2 * per, -1).split([per, per], dim=1)  # [Hk, Hv/Hk, H] each
                yield prefix + "in_proj_b.weight", b.reshape(-1, w.shape[1])
                yield prefix + "in_proj_a.weight", a.reshape(-1, w.shape[1])
