"""The bytes a model's weights will take, from its config.json before anything is loaded: `bench latency` sizes its
KV pool against them (latency_plan.py). A quantized checkpoint's layers hold their format's bytes (an int4 weight
with its group scales ~0.52 of a byte, FP8 / int8 one), the embeddings and LM head stay at the model's dtype; the
decoder's dense part (attention, linear attention, shared experts, dense MLPs) counts at the dtype wherever the
format keeps one of those module kinds in float (the official Qwen3.5 GPTQ-Int4 checkpoints keep attention, linear
attention and the shared experts in bf16, their routed experts int4). An estimate for a memory plan: a few percent
low at most (norms, g_idx and routers are not counted: tests/unit/test_weight_bytes.py), high where a dense part is
partly float (it counts whole)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

from longserve.models.quant.config import QuantFormat, apply_quantization, parse_quant_format
from longserve.models.quant.schemes import IntScheme, Scheme

_LAYER = "model.layers.0."


def quant_format(cfg: dict[str, Any], quantization: str | None, load_format: str) -> QuantFormat | None:
    """The format the engine will load `cfg` in (config.json's quantization_config, or --quantization's: FP8 on a
    float checkpoint, a format's defaults for dummy weights), checked as the engine checks it."""
    hf = SimpleNamespace(**cfg)
    # its notes ("dummy weights in gptq format") are the engine's to give
    log = logging.getLogger("longserve.models.quant")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        return parse_quant_format(apply_quantization(hf, quantization, load_format))
    finally:
        log.setLevel(level)


def scheme_bytes(scheme: Scheme | None, itemsize: float) -> float:
    """Bytes a weight takes: the packed integers, their scale (fp16) and zero point a group of `group_size`;
    a byte for FP8 / int8 (their scales a channel or block: negligible); itemsize unquantized."""
    if scheme is None:
        return itemsize
    if isinstance(scheme, IntScheme):
        per_group = 2 + scheme.bits / 8  # an fp16 scale and a packed zero point
        return scheme.bits / 8 + (per_group / scheme.group_size if scheme.group_size > 0 else 0.0)
    return 1.0


def layer_bytes_per_param(
    fmt: QuantFormat | None, itemsize: float, *, hybrid: bool, moe: bool, shared: bool, dense_mlp: bool
) -> tuple[float, float]:
    """(dense part, routed experts) bytes a decoder-layer parameter under `fmt`; the dense part at the largest of
    its module kinds' (those the model has)."""
    if fmt is None:
        return itemsize, itemsize
    names = ["self_attn.q_proj", "self_attn.o_proj"]
    names += ["linear_attn.in_proj_qkv", "linear_attn.out_proj"] if hybrid else []
    names += ["mlp.shared_expert.gate_proj"] if shared else []
    names += ["mlp.gate_proj", "mlp.down_proj"] if dense_mlp or not moe else []
    dense = max(scheme_bytes(fmt.scheme(_LAYER + n), itemsize) for n in names)
    experts = (
        scheme_bytes(fmt.expert_scheme(_LAYER + "mlp.experts.0.gate_proj"), itemsize) if moe else itemsize
    )
    return dense, experts
