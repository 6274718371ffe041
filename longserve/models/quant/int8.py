"""INT8 W8A8 (compressed-tensors int-quantized, llm-compressor's W8A8 preset): symmetric int8 weights with a
scale per output channel (or per checkpoint module, expanded to its rows), int8 activations quantized per
token at run time (scale = amax / 127) or with the checkpoint's static per-tensor input_scale. The product
accumulates in int32 (torch._int_mm on CUDA, exact on the CPU) and is scaled once in float32."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from longserve.kernels.quant_reference import per_token_quant_int8_ref, scaled_gemm_ref
from longserve.models.layers import MergedLinear
from longserve.models.linear_method import LinearMethod
from longserve.models.quant.config import Int8Scheme
from longserve.models.quant.layout import WeightLayout
from longserve.platform import use_triton

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INT8_STD = 73.6  # std of integers uniform in [-127, 127]: dummy scales give weights of the initializer's std


def _param(
    data: torch.Tensor, loader, layout: WeightLayout, allowed, dummy: str, div: float = 1.0
) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader, param.weight_layout = loader, layout  # type: ignore[attr-defined]
    param.ckpt_dtypes, param.dummy_kind, param.dummy_div = allowed, dummy, div  # type: ignore[attr-defined]
    return param


class Int8LinearMethod(LinearMethod):
    name = "int8"

    def __init__(self, scheme: Int8Scheme) -> None:
        self.scheme = scheme

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, weight_loader: Callable[..., None]
    ) -> None:
        shards = len(layer.shard_sizes) if isinstance(layer, MergedLinear) else 1
        per_shard = WeightLayout(per_shard=True)
        layer.register_parameter("weight", _param(
            torch.empty(out_features, in_features, dtype=torch.int8), weight_loader, WeightLayout(), (torch.int8,),
            "int8",
        ))  # fmt: skip
        if self.scheme.weight == "channel":
            scale = _param(torch.empty(out_features, 1), weight_loader, WeightLayout(0, None), _FLOATS, "scale",
                           _INT8_STD)  # fmt: skip
        else:
            scale = _param(torch.empty(shards), weight_loader, per_shard, _FLOATS, "scale", _INT8_STD)
        layer.register_parameter("weight_scale", scale)
        if self.scheme.activation == "static":
            layer.register_parameter(
                "input_scale",
                _param(torch.empty(shards), weight_loader, per_shard, _FLOATS, "act_scale", 127.0),
            )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scale = layer.weight_scale.data.float()
        del layer.weight_scale
        if self.scheme.weight == "channel":
            scale = scale.view(-1)
        else:
            sizes = (
                list(layer.shard_sizes.values()) if isinstance(layer, MergedLinear) else [layer.out_features]
            )
            scale = torch.cat([s.expand(n) for s, n in zip(scale, sizes)])
        layer.register_parameter("int8_scale", nn.Parameter(scale.contiguous(), requires_grad=False))
        if self.scheme.activation == "static":
            input_scale = layer.input_scale.data.float().max().reshape(1)
            del layer.input_scale
            layer.register_parameter("int8_input_scale", nn.Parameter(input_scale, requires_grad=False))
        else:
            layer.int8_input_scale = None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if use_triton(x):
            from longserve.kernels.int8_linear import int8_scaled_linear  # imports triton

            return int8_scaled_linear(x, layer.weight, layer.int8_scale, layer.int8_input_scale, bias)
        xq, xs = per_token_quant_int8_ref(x, layer.int8_input_scale)
        return scaled_gemm_ref(xq, xs, layer.weight, layer.int8_scale, x.dtype, bias)
