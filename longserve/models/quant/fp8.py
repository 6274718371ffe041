"""FP8 (e4m3) weights and activations, for linear layers and MoE experts:

    block     the `fp8` format of the official Qwen3 / DeepSeek FP8 checkpoints (weight + weight_scale_inv
              per 128x128 block) and compressed-tensors' FP8 block (weight + weight_scale): activations per
              token-group of the block's k, at run time
    channel   compressed-tensors FP8 (weight_scale [N, 1]) and a float checkpoint quantized per channel while
              loading (`--quantization fp8`, as vLLM); activations per token, or static (input_scale)
    tensor    one weight_scale per checkpoint module (per fused shard), expanded to channels after loading

A fused layer's shards keep their own scales (per-tensor: expanded to their rows; blocks: stacked, every
shard starting on a block); a static input_scale is one per layer: the largest of its shards' (vLLM's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from longserve.kernels.moe_reference import MoEQuant
from longserve.kernels.quant_reference import (
    FP8_DTYPE,
    FP8_MAX,
    fp8_block_gemm_ref,
    per_token_group_quant_fp8_ref,
    scaled_gemm_ref,
)
from longserve.models.layers import MergedLinear, RowParallelLinear
from longserve.models.linear_method import LinearMethod
from longserve.models.moe import FusedMoE, MoEMethod, expert_param
from longserve.models.quant.config import Fp8Scheme
from longserve.models.quant.layout import WeightLayout, entries
from longserve.platform import triton_available, use_triton

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_PER_SHARD = WeightLayout(per_shard=True)


def _param(
    data: torch.Tensor, loader, layout: WeightLayout, allowed, dummy: str, div: float = 1.0
) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader, param.weight_layout = loader, layout  # type: ignore[attr-defined]
    param.ckpt_dtypes, param.dummy_kind, param.dummy_div = allowed, dummy, div  # type: ignore[attr-defined]
    return param


def scale_name(scheme: Fp8Scheme) -> str:
    """The checkpoint's name of the weight scale: DeepSeek/Qwen3 blocks call it weight_scale_inv."""
    return "weight_scale_inv" if scheme.weight == "block" and scheme.checkpoint == "fp8" else "weight_scale"


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weights [..., N, K] -> (e4m3 [..., N, K], float32 scales [..., N]): amax of each row / 448."""
    scale = w.float().abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (w.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


class Fp8LinearMethod(LinearMethod):
    name = "fp8"

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, weight_loader: Callable[..., None]
    ) -> None:
        sc = self.scheme
        shards = len(layer.shard_sizes) if isinstance(layer, MergedLinear) else 1
        if sc.checkpoint == "online":  # float weights, quantized after loading
            weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
            weight.weight_loader = weight_loader  # type: ignore[attr-defined]
            layer.register_parameter("weight", weight)
            return
        weight = _param(torch.empty(out_features, in_features, dtype=FP8_DTYPE), weight_loader, WeightLayout(),
                        (FP8_DTYPE,), "fp8")  # fmt: skip
        layer.register_parameter("weight", weight)
        if sc.weight == "block":
            bn, bk = sc.block
            if isinstance(layer, RowParallelLinear) and layer.tp_size > 1 and in_features % bk:
                raise ValueError(
                    f"FP8 block size {bk} does not divide the {in_features} input features per rank of "
                    f"{type(layer).__name__}: choose a tensor-parallel size that keeps them whole blocks"
                )
            shape = (entries(out_features, bn), entries(in_features, bk))
            scale = _param(torch.empty(shape), weight_loader, WeightLayout(0, 1, bn, bk), _FLOATS, "scale")
        elif sc.weight == "channel":
            scale = _param(
                torch.empty(out_features, 1), weight_loader, WeightLayout(0, None), _FLOATS, "scale"
            )
        else:
            scale = _param(torch.empty(shards), weight_loader, _PER_SHARD, _FLOATS, "scale")
        layer.register_parameter(scale_name(sc), scale)
        if sc.activation == "static":
            layer.register_parameter(
                "input_scale", _param(torch.empty(shards), weight_loader, _PER_SHARD, _FLOATS, "act_scale")
            )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        sc = self.scheme
        if sc.checkpoint == "online":
            q, scale = quantize_per_channel(layer.weight.data)
            del layer.weight
            layer.register_parameter("weight", nn.Parameter(q, requires_grad=False))
            layer.register_parameter("fp8_scale", nn.Parameter(scale, requires_grad=False))
            layer.input_scale = None
            return
        name = scale_name(sc)
        scale = getattr(layer, name).data.float()
        delattr(layer, name)
        if sc.weight == "channel":
            scale = scale.view(-1)
        elif sc.weight == "tensor":  # each shard's one scale over its rows
            sizes = (
                list(layer.shard_sizes.values()) if isinstance(layer, MergedLinear) else [layer.out_features]
            )
            scale = torch.cat([s.expand(n) for s, n in zip(scale, sizes)])
        layer.register_parameter("fp8_scale", nn.Parameter(scale.contiguous(), requires_grad=False))
        if (
            sc.weight == "block"
            and tuple(sc.block) == (128, 128)
            and layer.weight.is_cuda
            and triton_available()
        ):
            from longserve.kernels.quant_fp8 import check_block_scaled_mm  # imports triton

            check_block_scaled_mm(layer.weight, layer.fp8_scale)  # once per device: cuBLAS or Triton
        if sc.activation == "static":
            input_scale = layer.input_scale.data.float().max().reshape(1)
            del layer.input_scale
            layer.register_parameter("fp8_input_scale", nn.Parameter(input_scale, requires_grad=False))
        else:
            layer.fp8_input_scale = None

    def apply_gated(
        self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        if self.scheme.weight != "block" or not use_triton(gate_up):
            return None
        from longserve.kernels.quant_fp8 import fp8_block_linear  # imports triton

        return fp8_block_linear(gate_up, layer.weight, layer.fp8_scale, self.scheme.block, bias, gated=True)

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
        if self.scheme.weight != "block" or x.shape[0] != 1 or not x.is_cuda or not use_triton(x):
            return None
        from longserve.kernels.gemv_fused import fp8_block_linear_then_norm  # imports triton

        w, scale, block = layer.weight, layer.fp8_scale, self.scheme.block
        return fp8_block_linear_then_norm(x, w, scale, block, bias, residual, norm_weight, eps, gated)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w, scale = layer.weight, layer.fp8_scale
        if self.scheme.weight == "block":
            if use_triton(x):
                from longserve.kernels.quant_fp8 import fp8_block_linear  # imports triton

                return fp8_block_linear(x, w, scale, self.scheme.block, bias)
            return fp8_block_gemm_ref(x, w, scale, self.scheme.block, bias)
        input_scale = getattr(layer, "fp8_input_scale", None)
        if use_triton(x):
            from longserve.kernels.quant_fp8 import fp8_scaled_linear  # imports triton

            return fp8_scaled_linear(x, w, scale, input_scale, bias)
        xq, xs = per_token_group_quant_fp8_ref(x, x.shape[1], input_scale)
        return scaled_gemm_ref(xq, xs, w, scale, x.dtype, bias)


class Fp8MoEMethod(MoEMethod):
    """FP8 experts (dynamic activations): the fused MoE kernel's fp8 path (block, or per channel with
    per-token activations)."""

    name = "fp8"

    def __init__(self, scheme: Fp8Scheme) -> None:
        if scheme.activation != "dynamic":
            raise ValueError(
                "FP8 experts with static activation scales are not supported; supported for MoE experts: "
                "dynamic activations (fp8 blocks, compressed-tensors FP8_DYNAMIC / FP8_BLOCK, online fp8)"
            )
        self.scheme = scheme

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate: int) -> None:
        sc = self.scheme
        shapes = {"w13": (2 * intermediate, hidden_size), "w2": (hidden_size, intermediate)}
        if sc.checkpoint == "online":
            for proj, shape in shapes.items():
                layer.register_parameter(proj, expert_param(layer, torch.empty(num_experts, *shape), proj))
            return
        if sc.weight == "block" and intermediate % sc.block[0]:
            raise ValueError(
                f"FP8 block size {sc.block[0]} does not divide the experts' {intermediate} intermediate "
                "features per rank (the gate/up boundary): choose a tensor-parallel (or expert-parallel) "
                "size that keeps them whole blocks"
            )
        for proj, (n, k) in shapes.items():
            w = expert_param(layer, torch.empty(num_experts, n, k, dtype=FP8_DTYPE), proj,
                             ckpt_dtypes=(FP8_DTYPE,), dummy_kind="fp8", dummy_div=1.0)  # fmt: skip
            layer.register_parameter(proj, w)
            if sc.weight == "block":
                bn, bk = sc.block
                data, layout = (
                    torch.empty(num_experts, entries(n, bn), entries(k, bk)),
                    WeightLayout(0, 1, bn, bk),
                )
            elif sc.weight == "channel":
                data, layout = torch.empty(num_experts, n, 1), WeightLayout(0, None)
            else:
                data, layout = torch.empty(num_experts, 2 if proj == "w13" else 1), _PER_SHARD
            scale = expert_param(
                layer, data, proj, layout, ckpt_dtypes=_FLOATS, dummy_kind="scale", dummy_div=1.0
            )
            layer.register_parameter(f"{proj}_{scale_name(sc)}", scale)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        sc = self.scheme
        for proj in ("w13", "w2"):
            if sc.checkpoint == "online":
                q, scale = quantize_per_channel(getattr(layer, proj).data)
                delattr(layer, proj)
                layer.register_parameter(proj, expert_param(layer, q, proj))
                scale = scale[..., None]  # [E, N, 1]
            else:
                name = f"{proj}_{scale_name(sc)}"
                scale = getattr(layer, name).data.float()
                delattr(layer, name)
                if sc.weight == "tensor":  # [E, shards] -> [E, N, 1]: gate rows, then up rows
                    rows = getattr(layer, proj).shape[1] // scale.shape[1]
                    scale = scale.repeat_interleave(rows, dim=1)[..., None]
            layer.register_parameter(f"{proj}_fp8_scale", expert_param(layer, scale.contiguous(), proj))

    def quant(self, layer: FusedMoE) -> MoEQuant:
        block = self.scheme.block if self.scheme.weight == "block" else None
        return MoEQuant(
            weight_dtype="fp8_e4m3",
            group_size=block[1] if block else 0,
            w13_scale=layer.w13_fp8_scale,
            w2_scale=layer.w2_fp8_scale,
            block_n=block[0] if block else 1,
        )

    def experts(self, layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor, MoEQuant]:
        return layer.w13, layer.w2, self.quant(layer)
