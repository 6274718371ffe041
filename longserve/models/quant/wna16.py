"""Integer weights with float activations (W4A16 / W8A16): GPTQ, AWQ and compressed-tensors pack-quantized,
for linear layers and MoE experts.

Loading keeps each checkpoint tensor in its own layout (so that tensor parallelism slices every tensor of a
module consistently, models/quant/layout.py); after loading, `process_weights_after_loading` repacks them into
the one layout the kernels read (kernels/quant_reference.py: uint8 [N, K * bits / 8] packed along K, scales
[N, G] in the checkpoint's float dtype, zero points uint8 [N, G] or none when symmetric, g_idx only when it
permutes the groups). What each format writes, and how it is read back (the unpacking mirrors each format's
own dequantization, quoted in tests/model/test_quantized_models.py):

    gptq    qweight int32 [K/pack, N] (along K, low bits first), qzeros int32 [G, N/pack] (v1: zero - 1),
            scales [G, N], g_idx int32 [K]                             AutoGPTQ / GPTQModel
    awq     qweight int32 [K, N/8] and qzeros [G, N/8] along N in the order 0 2 4 6 1 3 5 7, scales [G, N]
                                                                        AutoAWQ's GEMM
    ct      weight_packed int32 [N, K/pack] (offset by 2^(bits-1)), weight_scale [N, G],
            weight_zero_point int32 [N/pack, G] (asymmetric), weight_shape, weight_g_idx (actorder group)
                                                                        compressed-tensors

Under tensor parallelism a row-parallel layer (and the experts' down projection) splits K: each rank holds its
groups, except with act order (g_idx), where the groups of a rank's rows are anywhere, so every rank keeps all
of them (as vLLM does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from longserve.kernels.moe_reference import MoEQuant
from longserve.kernels.quant_reference import pack_int_k, wna16_gemm_ref
from longserve.models.layers import MergedLinear, RowParallelLinear
from longserve.models.linear_method import LinearMethod
from longserve.models.moe import FusedMoE, MoEMethod, expert_param
from longserve.models.quant.config import IntScheme
from longserve.models.quant.layout import WeightLayout
from longserve.platform import use_triton

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # AutoAWQ's packing_utils.AWQ_REVERSE_ORDER


def _spec(
    scheme: IntScheme, k_local: int, k_full: int, n_local: int, k_split: bool, what: str
) -> dict[str, Any]:
    """The checkpoint tensors of one module of this rank: name -> (shape, dtype, layout, allowed dtypes,
    dummy kind), and its grouping."""
    bits, pack = scheme.bits, 32 // scheme.bits
    group = scheme.group_size if scheme.group_size > 0 else k_full
    whole_groups = scheme.group_size <= 0 or (k_split and scheme.act_order)  # scales not split along K
    if not whole_groups and k_local % group:
        fix = (
            "choose a tensor-parallel size that keeps them whole groups"
            if k_split
            else "the format needs them"
        )
        raise ValueError(
            f"{what}: {k_local} input features{' per rank' if k_split else ''} are not a multiple of the "
            f"quantization group {group}; {fix}"
        )
    groups = -(-k_full // group) if whole_groups else k_local // group
    g_in = None if whole_groups else 0  # the input dim of [G, N] scales
    if k_local % pack:
        raise ValueError(
            f"{what}: {k_local} input features are not a multiple of the {bits}-bit packing ({pack})"
        )
    i32, grp = (torch.int32,), WeightLayout
    c = scheme.checkpoint
    if c in ("gptq", "gptq_v2"):
        if n_local % pack:
            raise ValueError(
                f"{what}: {n_local} output features are not a multiple of the zero-point packing {pack}"
            )
        tensors = {
            "qweight": ((k_local // pack, n_local), torch.int32, grp(1, 0, in_pack=pack), i32, "bits"),
            "qzeros": ((groups, n_local // pack), torch.int32, grp(1, g_in, out_pack=pack, in_pack=group), i32, "bits"),
            "scales": ((groups, n_local), torch.float32, grp(1, g_in, in_pack=group), _FLOATS, "scale"),
        }  # fmt: skip
        if scheme.g_idx_tensor:
            tensors["g_idx"] = ((k_local,), torch.int32, grp(None, 0), i32, "g_idx")
    elif c == "awq":
        if n_local % 8:
            raise ValueError(f"{what}: {n_local} output features are not a multiple of AWQ's packing (8)")
        tensors = {
            "qweight": ((k_local, n_local // 8), torch.int32, grp(1, 0, out_pack=8), i32, "bits"),
            "qzeros": ((groups, n_local // 8), torch.int32, grp(1, g_in, out_pack=8, in_pack=group), i32, "bits"),
            "scales": ((groups, n_local), torch.float32, grp(1, g_in, in_pack=group), _FLOATS, "scale"),
        }  # fmt: skip
    else:  # compressed-tensors pack-quantized
        s_in = None if whole_groups else 1
        tensors = {
            "weight_packed": ((n_local, k_local // pack), torch.int32, grp(0, 1, in_pack=pack), i32, "bits"),
            "weight_scale": ((n_local, groups), torch.float32, grp(0, s_in, in_pack=group), _FLOATS, "scale"),
        }  # fmt: skip
        if not scheme.sym:
            if n_local % pack:
                raise ValueError(
                    f"{what}: {n_local} output features are not a multiple of the zero-point packing"
                )
            tensors["weight_zero_point"] = (
                (n_local // pack, groups), torch.int32, grp(0, s_in, out_pack=pack, in_pack=group), i32, "bits",
            )  # fmt: skip
        if scheme.act_order and scheme.g_idx_tensor:
            tensors["weight_g_idx"] = ((k_local,), torch.int32, grp(None, 0), i32, "g_idx")
    # dummy weights: (q - zero) of random bits has a std of about 2^bits / 2.5; scales divide it out
    return {"tensors": tensors, "group": group, "groups": groups, "whole_groups": whole_groups,
            "dummy_div": (1 << bits) / 2.5}  # fmt: skip


def _register(module: nn.Module, spec: dict, make: Callable[[str, torch.Tensor, WeightLayout], nn.Parameter],
              lead: tuple[int, ...] = (), prefix: str = "") -> None:  # fmt: skip
    """Register the checkpoint tensors of `spec` (with leading dims `lead`: the experts) as parameters."""
    for name, (shape, dtype, layout, allowed, dummy) in spec["tensors"].items():
        param = make(name, torch.zeros(*lead, *shape, dtype=dtype), layout)
        param.ckpt_dtypes, param.dummy_kind = allowed, dummy  # type: ignore[attr-defined]
        param.dummy_div, param.dummy_group = spec["dummy_div"], spec["group"]  # type: ignore[attr-defined]
        module.register_parameter(prefix + name, param)


def _unpack(w: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words packed along `dim` (-1 or -2), low bits first -> the unsigned values, int16."""
    shifts = torch.arange(0, 32, bits, device=w.device, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == -1:
        v = (w.unsqueeze(-1) >> shifts) & mask  # [..., R, C, pack]
        return v.flatten(-2).to(torch.int16)
    v = (w.unsqueeze(-2) >> shifts[:, None]) & mask  # [..., R, pack, C]
    return v.flatten(-3, -2).to(torch.int16)


def _awq_order(v: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's reverse_awq_order: within each 8 columns, real column t is packed position REV[t]."""
    return v.unflatten(-1, (-1, 8))[..., _AWQ_REVERSE_ORDER].flatten(-2)


def _scales_dtype(param: nn.Parameter) -> torch.Tensor:
    return param.data.to(getattr(param, "ckpt_dtype", param.dtype))


def repack(module: nn.Module, scheme: IntScheme, info: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The checkpoint tensors `prefix + name` of `module` -> the kernels' layout (leading dims kept):
    qweight uint8 [..., N, K*bits/8], scales [..., N, G], zeros uint8 [..., N, G] or None, g_idx or None."""
    t = {name: getattr(module, prefix + name) for name in info["tensors"]}
    bits, c = scheme.bits, scheme.checkpoint
    if c in ("gptq", "gptq_v2"):
        q = _unpack(t["qweight"].data, bits, -2).transpose(-1, -2)  # [..., N, K]
        zeros = _unpack(t["qzeros"].data, bits, -1).transpose(-1, -2)  # [..., N, G]
        if c == "gptq":
            zeros = zeros + 1  # v1 checkpoints store zero - 1 (AutoGPTQ's dequantization adds it back)
        scales = _scales_dtype(t["scales"]).transpose(-1, -2)
        g_idx = t["g_idx"].data if "g_idx" in t else None
    elif c == "awq":
        q = _awq_order(_unpack(t["qweight"].data, bits, -1)).transpose(-1, -2)
        zeros = _awq_order(_unpack(t["qzeros"].data, bits, -1)).transpose(-1, -2)
        scales, g_idx = _scales_dtype(t["scales"]).transpose(-1, -2), None
    else:
        q = _unpack(t["weight_packed"].data, bits, -1)  # [..., N, K]
        zp = t.get("weight_zero_point")
        zeros = None if zp is None else _unpack(zp.data, bits, -2)  # [..., N, G]
        scales = _scales_dtype(t["weight_scale"])
        g_idx = t["weight_g_idx"].data if "weight_g_idx" in t else None
    if zeros is not None and bool((zeros == 1 << (bits - 1)).all()):
        zeros = None  # symmetric: the kernel's constant zero point
    g_idx, scales, zeros = _local_groups(g_idx, scales, zeros, info)
    for name in info["tensors"]:
        delattr(module, prefix + name)
    return {
        "qweight": pack_int_k(q, bits),
        "scales": scales.contiguous(),
        "zeros": None if zeros is None else zeros.to(torch.uint8).contiguous(),
        "g_idx": g_idx,
    }


def _local_groups(g_idx, scales, zeros, info):
    """Drop a g_idx that only restates k // group (the fast path); else make it index this rank's scales."""
    if g_idx is None:
        return None, scales, zeros
    group, k_start = info["group"], info["k_start"]
    k_local = g_idx.shape[-1]
    plain = (torch.arange(k_start, k_start + k_local, device=g_idx.device) // group).to(g_idx.dtype)
    if info["whole_groups"]:  # every group on every rank: g_idx indexes them as it is
        if bool((g_idx == plain).all()) and k_start % group == 0 and scales.shape[-1] > 1:
            first, count = k_start // group, -(-k_local // group)
            narrow = lambda x: x.narrow(-1, first, count).contiguous()  # noqa: E731
            return None, narrow(scales), None if zeros is None else narrow(zeros)
        return (None if scales.shape[-1] == 1 else g_idx.to(torch.int32).contiguous()), scales, zeros
    local = g_idx - k_start // group
    if bool(((local < 0) | (local >= scales.shape[-1])).any()):
        raise ValueError(
            "g_idx names groups outside this module's share of the input: a checkpoint that permutes its "
            "groups must say so (desc_act true / actorder group)"
        )
    if bool((g_idx == plain).all()):
        return None, scales, zeros
    return local.to(torch.int32).contiguous(), scales, zeros


class WNA16LinearMethod(LinearMethod):
    """A linear layer with integer weights; the Triton W4A16/W8A16 GEMM on CUDA, its reference elsewhere."""

    name = "wna16"
    # from WNA16_DEQUANT_MIN_TOKENS rows past the GEMV's (kernels/quant_gemm.py; the reference always)
    dequantizes_each_step = True

    def __init__(self, scheme: IntScheme) -> None:
        self.scheme = scheme

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, weight_loader: Callable[..., None]
    ) -> None:
        row = isinstance(layer, RowParallelLinear)
        tp = layer.tp_size if row else 1
        info = _spec(
            self.scheme, in_features, in_features * tp, out_features, row and tp > 1, type(layer).__name__
        )
        info["k_start"] = layer.tp_rank * in_features if row else 0
        layer.wna16_info = info

        def make(name: str, data: torch.Tensor, layout: WeightLayout) -> nn.Parameter:
            param = nn.Parameter(data, requires_grad=False)
            param.weight_loader, param.weight_layout = weight_loader, layout  # type: ignore[attr-defined]
            return param

        _register(layer, info, make)
        if (
            self.scheme.checkpoint == "ct"
        ):  # compressed-tensors' per-module original shape: checked, then dropped
            shards = len(layer.shard_sizes) if isinstance(layer, MergedLinear) else 1
            param = make(
                "weight_shape", torch.zeros(shards, 2, dtype=torch.int64), WeightLayout(per_shard=True)
            )
            param.ckpt_dtypes, param.dummy_kind = (torch.int64, torch.int32), "shape"  # type: ignore[attr-defined]
            layer.register_parameter("weight_shape", param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.scheme.checkpoint == "ct":
            check_weight_shape(layer)
        packed = repack(layer, self.scheme, layer.wna16_info)
        for name, value in packed.items():
            if value is None:
                setattr(layer, "int_" + name, None)
            else:
                layer.register_parameter("int_" + name, nn.Parameter(value, requires_grad=False))

    def apply_gated(
        self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        if not use_triton(gate_up):
            return None
        from longserve.kernels.gemv_fused import wna16_gated_gemv  # imports triton

        args = (layer.int_qweight, layer.int_scales, layer.int_zeros, layer.int_g_idx)
        return wna16_gated_gemv(gate_up, *args, self.scheme.bits, layer.wna16_info["group"], bias)

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
        if x.shape[0] != 1 or not x.is_cuda or not use_triton(x):
            return None
        from longserve.kernels.gemv_fused import wna16_gemv_then_norm  # imports triton

        args = (layer.int_qweight, layer.int_scales, layer.int_zeros, layer.int_g_idx)
        args += (self.scheme.bits, layer.wna16_info["group"], bias)
        return wna16_gemv_then_norm(x, *args, residual, norm_weight, eps, gated)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        args = (layer.int_qweight, layer.int_scales, layer.int_zeros, layer.int_g_idx)
        args += (self.scheme.bits, layer.wna16_info["group"])
        if use_triton(x):
            from longserve.kernels.quant_gemm import wna16_gemm  # imports triton

            return wna16_gemm(x, *args, bias=bias)  # [T, out]
        return wna16_gemm_ref(x, *args, bias=bias)  # [T, out]


def check_weight_shape(layer: nn.Module) -> None:
    """compressed-tensors' weight_shape [out, in] of each shard must be the module's full shape."""
    shapes = layer.weight_shape.data.tolist()
    if isinstance(layer, MergedLinear):
        k = layer.in_features
        expected = [[layer.full_shard_sizes[s], k] for s in layer.shard_sizes]
    else:
        expected = [[layer.out_features, layer.in_features * layer.tp_size]]
    if shapes != expected:
        raise ValueError(f"compressed-tensors weight_shape {shapes} does not match the model's {expected}")
    del layer.weight_shape


class WNA16MoEMethod(MoEMethod):
    """Experts with integer weights: the fused MoE kernel's int4/int8 path on CUDA, the reference elsewhere.
    Per expert, w13 stacks the gate and up projections along N, as the float experts do."""

    name = "wna16"
    # every expert at prefill sizes (kernels/moe_wna16.py: MOE_WNA16_PREFILL "dequant", the default measured
    # faster than the fused int path: RESULTS.md, thirty-seventh and thirty-eighth sessions)
    dequantizes_each_step = True

    def __init__(self, scheme: IntScheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate: int) -> None:
        split = layer.inter != layer.intermediate_size  # the down projection's K is split over the ranks
        infos = {
            "w13": _spec(self.scheme, hidden_size, hidden_size, 2 * intermediate, False, "experts' gate/up"),
            "w2": _spec(
                self.scheme, intermediate, layer.intermediate_size, hidden_size, split, "experts' down"
            ),
        }
        infos["w13"]["k_start"], infos["w2"]["k_start"] = 0, layer.inter_start
        layer.wna16_info = infos
        for proj, info in infos.items():
            # expert tensors are registered as "w13_qweight" etc.: the checkpoint suffix after the projection
            _register(layer, info, lambda n, data, layout, p=proj: expert_param(layer, data, p, layout),
                      (num_experts,), prefix=f"{proj}_")  # fmt: skip
            if self.scheme.checkpoint == "ct":
                shards = 2 if proj == "w13" else 1
                param = expert_param(layer, torch.zeros(num_experts, shards, 2, dtype=torch.int64), proj,
                                     WeightLayout(per_shard=True))  # fmt: skip
                param.ckpt_dtypes, param.dummy_kind = (torch.int64, torch.int32), "shape"  # type: ignore[attr-defined]
                layer.register_parameter(f"{proj}_weight_shape", param)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        if self.scheme.checkpoint == "ct":
            full_i, h = layer.intermediate_size, layer.hidden_size
            for proj, expected in (("w13", [[full_i, h], [full_i, h]]), ("w2", [[h, full_i]])):
                shapes = getattr(layer, f"{proj}_weight_shape").data.tolist()
                if any(s != expected for s in shapes):
                    raise ValueError(
                        f"compressed-tensors weight_shape of the experts: {shapes[0]}, expected {expected}"
                    )
                delattr(layer, f"{proj}_weight_shape")
        for proj in ("w13", "w2"):
            packed = repack(layer, self.scheme, layer.wna16_info[proj], prefix=f"{proj}_")
            for name, value in packed.items():
                if value is None:
                    setattr(layer, f"{proj}_int_{name}", None)
                else:
                    layer.register_parameter(f"{proj}_int_{name}", expert_param(layer, value, proj))

    def quant(self, layer: FusedMoE) -> MoEQuant:
        return MoEQuant(
            weight_dtype=f"int{self.scheme.bits}",
            group_size=0 if self.scheme.group_size <= 0 else self.scheme.group_size,
            w13_scale=layer.w13_int_scales,
            w2_scale=layer.w2_int_scales,
            w13_zero=layer.w13_int_zeros,
            w2_zero=layer.w2_int_zeros,
            w13_g_idx=layer.w13_int_g_idx,
            w2_g_idx=layer.w2_int_g_idx,
        )

    def experts(self, layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor, MoEQuant]:
        return layer.w13_int_qweight, layer.w2_int_qweight, self.quant(layer)
