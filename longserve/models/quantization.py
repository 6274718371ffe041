"""How a checkpoint's weights are stored (config.json `quantization_config`), and the method base class that
linear layers and MoE experts delegate to: the seam where quantized kernels plug in.

A layer kind keeps a registry name -> method class of whole-model methods (linear_method.LINEAR_METHODS,
moe.MOE_METHODS: "unquantized" without a quantization_config). The quantized formats (models/quant/: gptq,
awq, compressed-tensors, fp8) decide per module, by its checkpoint name: their layers are built with a
pending method and given theirs once the model is built, before any weight is read (models/quant/bind.py).
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from torch import nn

UNQUANTIZED = "unquantized"


class QuantizeMethod(ABC):
    """What a layer delegates to for its weights (as vLLM's QuantizeMethodBase): the subclasses create the
    parameters and compute with them; a layer stores its method as `quant_method`."""

    name: ClassVar[str]
    # its prefill writes the weights out in the activations' dtype once a step (the integer formats' dequantize,
    # then GEMM, path at prefill sizes): fewer, larger steps do that fewer times (runner/step_tokens.py)
    dequantizes_each_step: ClassVar[bool] = False

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 (optional hook)
        """Called once after every weight is loaded (from a checkpoint or dummy): where a quantized method
        repacks weights into its kernel's layout. Plain weights need nothing."""


def process_weights_after_loading(model: nn.Module) -> None:
    """Run each layer's method hook (the loader calls this after filling the weights)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethod):
            method.process_weights_after_loading(module)


def dequantizes_each_step(model: nn.Module) -> bool:
    """Whether some layer's method writes its weights out once a step at prefill sizes."""
    methods = (getattr(m, "quant_method", None) for m in model.modules())
    return any(isinstance(q, QuantizeMethod) and q.dequantizes_each_step for q in methods)


def quantization_method(hf_config: Any) -> str:
    """The checkpoint's weight format: its `quantization_config.quant_method` in lower case, or
    "unquantized" when config.json has no quantization_config."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return UNQUANTIZED
    method = qc.get("quant_method") if isinstance(qc, Mapping) else getattr(qc, "quant_method", None)
    if not method:
        raise ValueError(
            "config.json has a quantization_config without a quant_method: cannot tell its format"
        )
    return str(getattr(method, "value", method)).lower()


M = TypeVar("M", bound=QuantizeMethod)


def method_for(registry: Mapping[str, type[M]], hf_config: Any, layers: str) -> M:
    """A new method of the checkpoint's format from `registry`; ValueError naming the supported formats."""
    name = quantization_method(hf_config)
    if name not in registry:
        raise ValueError(
            f"the checkpoint's weights are quantized as {name!r} (config.json quantization_config), which "
            f"{layers} do not support; supported: {', '.join(sorted(registry))}"
        )
    return registry[name]()
