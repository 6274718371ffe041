"""How a decoder's attention heads split over tensor-parallel ranks, and what each layer attends to: head
dimensions, each rank's q/kv heads, the check that a model splits `tp` ways, sliding windows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from longserve.models.layers import tp_shard_range
from longserve.models.moe_layout import moe_spec, validate_moe_parallel


def get_head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


@dataclass(frozen=True)
class HeadLayout:
    """One rank's attention heads: q heads [q_start, q_start + num_q), kv heads [kv_start, kv_start + num_kv)."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def head_layout(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadLayout:
    """Split the heads over tp ranks. When tp exceeds the kv heads, each kv head is replicated on
    tp / num_kv_heads consecutive ranks (the ranks whose q heads use it), so every rank holds one.

        4 q heads, 2 kv heads, tp=4:   rank   0    1    2    3
                                       q      0    1    2    3
                                       kv     0    0    1    1
    """
    if num_heads % tp_size:
        raise ValueError(
            f"tp_size={tp_size} does not divide the model's {num_heads} attention heads; "
            f"choose a tp size that divides {num_heads}"
        )
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(
            f"tp_size={tp_size} and the model's {num_kv_heads} kv heads: one must divide the other "
            "(kv heads are split across ranks, or replicated when tp exceeds them)"
        )
    num_q = num_heads // tp_size
    if tp_size <= num_kv_heads:
        num_kv = num_kv_heads // tp_size
        return HeadLayout(tp_rank * num_q, num_q, tp_rank * num_kv, num_kv)
    return HeadLayout(tp_rank * num_q, num_q, tp_rank // (tp_size // num_kv_heads), 1)


def validate_tp_size(hf_config: Any, tp_size: int, ep_size: int = 1) -> None:
    """Raise a clear ValueError when the model cannot be split `tp_size` ways (MoE models: with `ep_size`
    expert-parallel groups, see moe_layout.py)."""
    num_heads = hf_config.num_attention_heads
    head_layout(num_heads, getattr(hf_config, "num_key_value_heads", None) or num_heads, tp_size, 0)
    spec = moe_spec(hf_config)
    if spec is None:
        tp_shard_range(hf_config.intermediate_size, tp_size, 0, "intermediate_size")
    else:
        validate_moe_parallel(spec, tp_size, ep_size)
    if "linear_attention" in (
        getattr(hf_config, "layer_types", None) or ()
    ):  # a hybrid model's linear layers
        tp_shard_range(hf_config.linear_num_key_heads, tp_size, 0, "linear_num_key_heads")
        tp_shard_range(hf_config.linear_num_value_heads, tp_size, 0, "linear_num_value_heads")


def layer_sliding_window(hf_config: Any, layer_id: int) -> int | None:
    """HF semantics: `layer_types` picks sliding layers (Qwen2/3); without it the window applies to all (Mistral)."""
    window = getattr(hf_config, "sliding_window", None)
    if window is None or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_id] == "sliding_attention" else None
    return window
