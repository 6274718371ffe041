"""Give each layer of a built model the method of its weight format, by the layer's checkpoint name.

A quantized checkpoint decides per module (GPTQ's `dynamic` rules, compressed-tensors' `ignore`, ...), by the
HF module name, which the model's layers only know once the model is built: they are built with a pending
method (linear_method.PendingLinearMethod, moe.PendingMoEMethod) that registers nothing. `bind_quant_methods`
then walks the model, maps each layer's name back to the checkpoint's names (a fused qkv_proj is q_proj,
k_proj and v_proj, whose decisions must agree; experts are every expert's gate/up/down projections) and
creates its parameters with the chosen method, before any weight is read (load_model calls it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from longserve.models.layers import STACKED_PARAMS
from longserve.models.linear_method import LinearMethod, PendingLinearMethod, UnquantizedLinearMethod
from longserve.models.moe import FusedMoE, MoEMethod, PendingMoEMethod, UnquantizedMoEMethod
from longserve.models.quant.config import Fp8Scheme, Int8Scheme, IntScheme, QuantFormat, Scheme
from longserve.models.quant.fp8 import Fp8LinearMethod, Fp8MoEMethod
from longserve.models.quant.int8 import Int8LinearMethod
from longserve.models.quant.wna16 import WNA16LinearMethod, WNA16MoEMethod

_FUSED = {fused: [hf for f, hf, _ in STACKED_PARAMS if f == fused] for fused, _, _ in STACKED_PARAMS}
# a hybrid model's linear attention (models/gated_delta_net.py): z, b and a in one product
_FUSED["in_proj_zba"] = ["in_proj_z", "in_proj_b", "in_proj_a"]
# experts' checkpoint names per architecture: (the block's name, gate, up, down)
_EXPERT_NAMES = {"MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2")}
_DEFAULT_EXPERT_NAMES = ("mlp", "gate_proj", "up_proj", "down_proj")


def linear_method(scheme: Scheme | None) -> LinearMethod:
    if scheme is None:
        return UnquantizedLinearMethod()
    if isinstance(scheme, IntScheme):
        return WNA16LinearMethod(scheme)
    if isinstance(scheme, Fp8Scheme):
        return Fp8LinearMethod(scheme)
    return Int8LinearMethod(scheme)


def moe_method(scheme: Scheme | None) -> MoEMethod:
    if scheme is None:
        return UnquantizedMoEMethod()
    if isinstance(scheme, IntScheme):
        return WNA16MoEMethod(scheme)
    if isinstance(scheme, Int8Scheme):
        raise ValueError(
            "INT8 W8A8 experts are not supported; supported for MoE experts: GPTQ / AWQ / compressed-tensors "
            "W4A16 and W8A16, FP8 (blocks, per channel, online)"
        )
    return Fp8MoEMethod(scheme)


def linear_names(name: str) -> list[str]:
    """Our linear layer's name -> the checkpoint modules it holds (a fused layer: each of its shards)."""
    prefix, _, last = name.rpartition(".")
    return [f"{prefix}.{hf}" if prefix else hf for hf in _FUSED[last]] if last in _FUSED else [name]


def expert_names(name: str, module: FusedMoE, arch: str) -> list[str]:
    """Our experts' name (`model.layers.0.mlp.experts`) -> every expert's projections in the checkpoint."""
    block, *projs = _EXPERT_NAMES.get(arch, _DEFAULT_EXPERT_NAMES)
    base = name.replace(".mlp.experts", f".{block}.experts") if name.endswith(".mlp.experts") else name
    return [f"{base}.{e}.{p}" for e in range(module.num_experts) for p in projs]


def _one_scheme(
    fmt: QuantFormat, names: list[str], layer: str, experts: bool, tensors: set[str] | None
) -> Scheme | None:
    decide = fmt.expert_scheme if experts else fmt.scheme
    schemes = {n: _with_checkpoint(decide(n), n, tensors) for n in names}
    distinct = set(schemes.values())
    if len(distinct) > 1:
        shown = ", ".join(f"{n}: {s}" for n, s in list(schemes.items())[:4])
        raise ValueError(
            f"quantization_config ({fmt.name}) stores the modules of {layer} differently ({shown}, ...); "
            "longserve computes them as one layer and needs one format for all of them"
        )
    return distinct.pop()


def _with_checkpoint(scheme: Scheme | None, name: str, tensors: set[str] | None) -> Scheme | None:
    """A scheme adjusted to what the checkpoint holds for module `name` (its tensor names, when known):
    whether it stores a g_idx."""
    if isinstance(scheme, IntScheme) and tensors is not None:
        suffix = "weight_g_idx" if scheme.checkpoint == "ct" else "g_idx"
        present = f"{name}.{suffix}" in tensors
        if present != scheme.g_idx_tensor:
            return dataclasses.replace(scheme, g_idx_tensor=present)
    return scheme


def bind_quant_methods(
    model: nn.Module, fmt: QuantFormat | None, arch: str | None = None, tensors: set[str] | None = None
) -> dict[str, Any]:
    """Give every pending layer of `model` its method and parameters (call within the model's device and
    dtype context). `tensors`: the checkpoint's tensor names (from the files' headers, read before any
    weight), for the companions a format stores or not (g_idx). Returns a count of layers per method name."""
    arch = arch or type(model).__name__
    # our module names as the checkpoint spells them (a vision-language checkpoint's text model: models/hybrid.py)
    spelled = getattr(model, "checkpoint_module_name", None) or (lambda n, tensors: n)
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        pending = getattr(module, "pending_weights", None)
        if pending is None:
            continue
        if fmt is None:
            raise ValueError(f"{name} waits for a quantization format, but the checkpoint declares none")
        if isinstance(module.quant_method, PendingLinearMethod):
            names = [spelled(n, tensors) for n in linear_names(name)]
            method: Any = linear_method(_one_scheme(fmt, names, name, False, tensors))
        elif isinstance(module.quant_method, PendingMoEMethod):
            names = [spelled(n, tensors) for n in expert_names(name, module, arch)]
            method = moe_method(_one_scheme(fmt, names, name, True, tensors))
        else:
            continue
        del module.pending_weights
        module.quant_method = method
        method.create_weights(module, *pending)
        kind = f"{type(method).__name__}{'/experts' if isinstance(module, FusedMoE) else ''}"
        counts[kind] = counts.get(kind, 0) + 1
    return counts
