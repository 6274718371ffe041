"""Linear-layer methods: how a linear layer (models/layers.py) holds its weight and multiplies by it.

The layer owns the shapes and the tensor-parallel slicing (its weight_loader); the method owns the
parameters' format and the product. "unquantized" is a plain [out, in] weight and `F.linear`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from longserve.models.quantization import UNQUANTIZED, QuantizeMethod, method_for


class LinearMethod(QuantizeMethod):
    """Creates a linear layer's weight parameters and computes y = x W^T (+ bias), as vLLM's LinearMethodBase."""

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, weight_loader: Callable[..., None]
    ) -> None:
        """Register the parameters of an [out_features, in_features] product (this rank's share) on `layer`,
        each with `weight_loader` (the layer's, which slices checkpoint tensors to the rank's part)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, in] -> [T, out] (+ bias when given)."""


class UnquantizedLinearMethod(LinearMethod):
    """A weight [out, in] in the model's dtype, named `weight` as in HF checkpoints."""

    name = UNQUANTIZED

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, weight_loader: Callable[..., None]
    ) -> None:
        weight = nn.Parameter(torch.empty(out_features, in_features))
        weight.weight_loader = weight_loader  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


LINEAR_METHODS: dict[str, type[LinearMethod]] = {UNQUANTIZED: UnquantizedLinearMethod}


def get_linear_method(hf_config: Any) -> LinearMethod:
    """The linear method of the checkpoint's weight format (refused, naming the supported ones, if unknown)."""
    return method_for(LINEAR_METHODS, hf_config, "linear layers")
