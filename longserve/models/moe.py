"""The experts of a mixture-of-experts block (`FusedMoE`) and the MoE methods that compute them.

FusedMoE holds every expert's weights stacked, as transformers 5 stores `experts.gate_up_proj` [E, 2I, H]
(gate rows first, then up) and `experts.down_proj` [E, H, I], routes each token to its top-k experts and
hands the expert computation to its MoE method, chosen from the checkpoint's quantization_config like the
linear layers'. Under tensor parallelism each rank holds a 1/tp slice of every expert's intermediate dim
and the outputs are all-reduced, as the dense MLP's.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from torch import nn

from longserve.distributed import get_tp_rank, get_tp_size, tp_all_reduce
from longserve.kernels.moe_reference import fused_moe_ref, route_topk
from longserve.models.layers import TensorLike, as_tensor, tp_shard_range, use_triton
from longserve.models.quantization import UNQUANTIZED, QuantizeMethod, method_for


class MoEMethod(QuantizeMethod):
    """Creates the experts' parameters and computes sum_k w_k * expert_k(x), as vLLM's FusedMoEMethodBase."""

    @abstractmethod
    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate: int) -> None:
        """Register the parameters of `num_experts` experts of this rank's `intermediate` size on `layer`,
        each with `weight_loader` = layer.weight_loader."""

    @abstractmethod
    def apply(
        self, layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """hidden [T, H], routing weights and expert ids [T, k] -> this rank's sum over the k experts [T, H]."""


class UnquantizedMoEMethod(MoEMethod):
    """w13 [E, 2I, H] and w2 [E, H, I] in the model's dtype; the Triton `fused_moe` on CUDA, its torch
    reference `fused_moe_ref` elsewhere (same signature and rounding)."""

    name = UNQUANTIZED

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate: int) -> None:
        for name, shape in (
            ("w13", (num_experts, 2 * intermediate, hidden_size)),
            ("w2", (num_experts, hidden_size, intermediate)),
        ):
            param = nn.Parameter(torch.empty(shape))
            param.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
            layer.register_parameter(name, param)

    def apply(
        self, layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if use_triton(hidden):
            from longserve.kernels.fused_moe import fused_moe  # imports triton

            return fused_moe(hidden, layer.w13, layer.w2, topk_weights, topk_ids)  # [T, H]
        return fused_moe_ref(hidden, layer.w13, layer.w2, topk_weights, topk_ids)  # [T, H]


MOE_METHODS: dict[str, type[MoEMethod]] = {UNQUANTIZED: UnquantizedMoEMethod}


def get_moe_method(hf_config: Any) -> MoEMethod:
    """The MoE method of the checkpoint's weight format (refused, naming the supported ones, if unknown)."""
    return method_for(MOE_METHODS, hf_config, "MoE experts")


class FusedMoE(nn.Module):
    """`num_experts` SiLU-gated experts of `intermediate_size`, top-k routed from router logits [T, E].

    renormalize: the k routing weights are divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob).
    round_routing_weights: the weights are rounded to the logits' dtype before use (HF's Qwen2/Qwen3-MoE
    routers do; Mixtral keeps them float32). `weight_loader(param, loaded)` takes a whole stacked tensor of
    the checkpoint (w13 [E, 2I, H] or w2 [E, H, I]) and keeps this rank's intermediate slice of it.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        scoring: str = "softmax",
        round_routing_weights: bool = False,
        quant_method: MoEMethod | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.renormalize, self.scoring = renormalize, scoring
        self.round_routing_weights = round_routing_weights
        self.tp_size = get_tp_size()
        self.inter_start, self.inter = tp_shard_range(
            intermediate_size, self.tp_size, get_tp_rank(), "moe_intermediate_size"
        )
        self.quant_method = quant_method or UnquantizedMoEMethod()
        self.quant_method.create_weights(self, num_experts, hidden_size, self.inter)

    def weight_loader(self, param: nn.Parameter, loaded: TensorLike, shard_id: str | None = None) -> None:
        """Copy this rank's part of a full stacked expert tensor: the gate and up rows [start, start + I/tp)
        of w13 (each half narrowed on its own), the columns [start, start + I/tp) of w2."""
        full, start, size = self.intermediate_size, self.inter_start, self.inter
        w13 = param is self.w13
        expected = (
            (self.num_experts, 2 * full, self.hidden_size)
            if w13
            else (self.num_experts, self.hidden_size, full)
        )
        if tuple(loaded.shape) != expected:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)}, experts expect {expected}")
        if w13:  # gate rows [0, I) then up rows [I, 2I): this rank's slice of each
            param.data[:, :size].copy_(as_tensor(loaded.narrow(1, start, size)))
            param.data[:, size:].copy_(as_tensor(loaded.narrow(1, full + start, size)))
        else:
            param.data.copy_(as_tensor(loaded.narrow(2, start, size)))

    def full_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        """The shape of `param` in the checkpoint (all ranks' intermediate slices)."""
        if param is self.w13:
            return (self.num_experts, 2 * self.intermediate_size, self.hidden_size)
        return (self.num_experts, self.hidden_size, self.intermediate_size)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] -> (routing weights [T, k], expert ids [T, k] int32)."""
        weights, ids = route_topk(router_logits, self.top_k, self.renormalize, self.scoring)
        if self.round_routing_weights:
            weights = weights.to(router_logits.dtype)
        return weights, ids

    def partial(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """This rank's share of the experts' output [T, H], before the all-reduce (all of it at tp=1)."""
        topk_weights, topk_ids = self.route(router_logits)
        return self.quant_method.apply(self, hidden, topk_weights, topk_ids)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], router logits [T, E] -> sum_k w_k * expert_k(hidden) [T, H]."""
        out = self.partial(hidden, router_logits)
        return out if self.tp_size == 1 else tp_all_reduce(out)
