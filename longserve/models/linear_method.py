"""Linear-layer methods: how a linear layer (models/layers.py) holds its weight and multiplies by it.

The layer owns the shapes and the tensor-parallel slicing (its weight_loader); the method owns the
parameters' format and the product. "unquantized" is a plain [out, in] weight and `F.linear`; the quantized
formats' methods live in models/quant/ and are given to each layer by name once the model is built.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from longserve.models.quantization import UNQUANTIZED, QuantizeMethod, method_for, quantization_method
from longserve.platform import use_triton

DENSE_GEMM_MAX_ROWS = 128  # kernels/dense_gemm.DENSE_GEMM_MAX_BLOCK_M: the most rows it ever takes


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) of a plain 16/32-bit weight [out, in], every unquantized product of a model (the linear
    layers' and the MoE block's router and shared gate): a decode batch kernels/dense_gemm.py serves (by rows
    and outputs: none by default) runs there in Triton, the rest through F.linear. Larger steps skip the check
    on one comparison (the import and the range cost ~0.65 us a call on the CI machine; an eager 8B step makes
    128 such calls)."""
    if x.shape[0] <= DENSE_GEMM_MAX_ROWS and use_triton(x):
        from longserve.kernels import dense_gemm  # imports triton

        plan = dense_gemm.dense_gemm_plan(x, weight)
        if plan is not None:
            return dense_gemm.dense_gemm(x, weight, bias, config=plan)
    return F.linear(x, weight, bias)


def stack_plain_weights(weights: list[nn.Parameter]) -> torch.Tensor | None:
    """After loading, plain weights [out_i, in] of products over one input as row views of one stacked tensor
    [sum out_i, in] (no copy kept), so that one GEMM makes all their outputs; None (nothing changed) unless
    they share a dtype."""
    if len({w.dtype for w in weights}) != 1:
        return None
    stacked = torch.cat([w.data for w in weights])
    start = 0
    for w in weights:
        w.data = stacked[start : start + w.shape[0]]
        start += w.shape[0]
    return stacked


class StacksInputs:
    """A module some of whose products read one input and may run as one GEMM over their stacked weights once
    loaded (`stack_plain_weights`): the MoE block's router and shared expert's inputs, a linear-attention layer's
    two projections."""

    def stack_inputs(self) -> bool:
        """After loading: stack what can be (plain weights); whether it did."""
        raise NotImplementedError


def stack_inputs(model: nn.Module) -> int:
    """After loading, every StacksInputs module's products over one input stacked where their weights are
    plain: how many modules stacked."""
    return sum(m.stack_inputs() for m in model.modules() if isinstance(m, StacksInputs))


def is_plain(layer: nn.Module) -> bool:
    """A linear layer holding a plain weight and no bias (a quantized one has no `weight`)."""
    return type(layer.quant_method) is UnquantizedLinearMethod and layer.bias is None


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

    def apply_gated(
        self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The product of silu(gate) * up of gate_up [T, 2 * in] (an MLP's down projection) where this method
        makes that input in its own pass over gate_up (block FP8: in the activations' quantization); None: the
        layer computes silu_and_mul, then `apply`."""
        return None

    def apply_swiglu(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """silu(gate) * up [T, I] of a gate|up layer's product [T, 2I] where this method makes it in the product's
        own kernel (kernels/swiglu_gemm.py); None: the layer's product, then silu_and_mul or `apply_gated`."""
        return None

    def apply_then_norm(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        gated: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(normed, new residual) of the product (gated: of silu(gate) * up, as apply_gated) added into `residual`
        and RMS-normed by `norm_weight` (kernels/norm.py's fused_add_rms_norm) where this method does that in the
        product's own kernel (kernels/gemv_fused.py: one row); None: the layer runs the product, then the norm."""
        return None


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
        return plain_linear(x, layer.weight, bias)

    def apply_gated(
        self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        # a decode batch in the range kernels/dense_gemm.py's gated path is switched on for (none by default)
        if gate_up.shape[0] <= DENSE_GEMM_MAX_ROWS and use_triton(gate_up):
            from longserve.kernels import dense_gemm  # imports triton

            plan = dense_gemm.dense_gemm_plan(gate_up, layer.weight, gated=True)
            if plan is not None:
                return dense_gemm.dense_gemm(gate_up, layer.weight, bias, config=plan, gated=True)
        return None

    def apply_swiglu(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        # prefill-sized steps only: a decode batch (<= DENSE_GEMM_MAX_ROWS rows) skips the check on one comparison
        if bias is None and x.shape[0] > DENSE_GEMM_MAX_ROWS and use_triton(x):
            from longserve.kernels import swiglu_gemm  # imports triton

            if swiglu_gemm.swiglu_gemm_serves(x, layer.weight):
                return swiglu_gemm.swiglu_gemm(x, layer.weight)  # [T, I]
        return None


class PendingLinearMethod(LinearMethod):
    """A quantized checkpoint's layer before it knows its method: formats decide per module (GPTQ's
    `dynamic` rules, compressed-tensors' `ignore` list, ...), by the module's checkpoint name, which a layer
    learns only once the model is built. It records the layer's shape and registers nothing;
    models/quant/bind.py then gives the layer its method (and its parameters) before any weight is read."""

    name = "pending"

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, weight_loader: Callable[..., None]
    ) -> None:
        layer.pending_weights = (in_features, out_features, weight_loader)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise RuntimeError(
            f"{type(layer).__name__} has no weight format yet: a quantized model is built by "
            "longserve.models.load_model, which gives every layer its method (models/quant/bind.py)"
        )


# whole-model methods (every layer alike); quantized formats are per module (PendingLinearMethod)
LINEAR_METHODS: dict[str, type[LinearMethod]] = {UNQUANTIZED: UnquantizedLinearMethod}


def get_linear_method(hf_config: Any) -> LinearMethod:
    """The linear method of the checkpoint's weight format: a whole-model method of LINEAR_METHODS, or for a
    quantized format a PendingLinearMethod (the format, already checked by models/quant/config.py before
    the model is built, then picks each layer's)."""
    if quantization_method(hf_config) in LINEAR_METHODS:
        return method_for(LINEAR_METHODS, hf_config, "linear layers")
    return PendingLinearMethod()
