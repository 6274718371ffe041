"""The experts of a mixture-of-experts block (`FusedMoE`) and the MoE methods that compute them.

FusedMoE holds every expert's weights stacked, as transformers 5 stores `experts.gate_up_proj` [E, 2I, H]
(gate rows first, then up) and `experts.down_proj` [E, H, I], routes each token to its top-k experts and
hands the expert computation to its MoE method, chosen from the checkpoint's quantization_config like the
linear layers'. Under tensor parallelism each rank holds a 1/tp slice of every expert's intermediate dim
and the outputs are all-reduced, as the dense MLP's. Under expert parallelism (ep_size > 1, see
moe_layout.py) a rank holds whole experts, 1/ep of them: it computes, for every token (the tokens are
on every rank anyway, attention being tensor-parallel), only the (token, expert) pairs routed to its own
experts, and the same one all-reduce adds the ranks' parts. No all-to-all is needed: each rank already has
every token, and the all-reduce of [T, H] costs what the tensor-parallel one does; the compute per rank is
its experts' share of the pairs instead of a 1/tp slice of all of them (better for decode, where a slice of
every touched expert means reading more, smaller weight tiles; uneven when the routing is).

Checkpoints hold experts either stacked (transformers 5 in memory: `experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]) or one 2D tensor per expert and projection (what transformers 5's
save_pretrained writes, and most published checkpoints: `experts.{e}.gate_proj.weight` [I, H], ...); the
weight loader copies each into the preallocated stacked parameter as it is read (shard ids "gate:e",
"up:e", "down:e"), reading only this rank's experts and slices. Quantized experts (models/quant/) load the
same way, each tensor of an expert (qweight, scales, weight_scale_inv, ...) along the dims its layout names.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from torch import nn

from longserve.distributed import get_ep_size, get_tp_rank, get_tp_size, tp_all_reduce
from longserve.kernels.moe_reference import fused_moe_ref, route_topk
from longserve.models.layers import TensorLike, as_tensor
from longserve.models.moe_layout import expert_placement
from longserve.models.quant.layout import (
    PLAIN,
    WeightLayout,
    check_dtype,
    entries,
    layout_of,
    packed_region,
    tensor_name,
)
from longserve.models.quantization import UNQUANTIZED, QuantizeMethod, method_for, quantization_method
from longserve.platform import use_triton

EXPERT_SHARDS = ("gate", "up", "down")  # per-expert checkpoint tensors: shard id f"{kind}:{expert}"
# the profiler range around routing + experts: `bench latency --profile` files the ops inside it (on the CPU,
# the reference's matmuls) under its own "moe" category (bench/profile.py); entered only while profiling
PROFILE_RANGE = "longserve::moe"
# Routing of at most this many tokens on CUDA runs as the one-launch Triton top-k (kernels/moe_routing.py)
# instead of route_topk's 5-7 torch launches: same ids (but for ties), weights equal to fp32 rounding. Measured
# on an H200 (2026-12-02, a4e6031): the router alone 0.0026-0.0029 ms against 0.017-0.026 ms at 1-512 tokens
# (`python3 -m longserve.bench.kernels.moe`, route_ms, CUDA-graph replay); the Qwen3-30B-A3B shape's decode
# 6.23 -> 5.14 ms/step at batch 1 and 27.48 -> 26.53 ms at batch 64 (4K contexts; `scripts/probes/
# with_constants.py longserve.models.moe.MOE_TRITON_ROUTING_MAX_TOKENS=64 -- longserve.bench.latency ...`).
# Past 512 tokens (unmeasured; prefill chunks, where routing is small next to the GEMMs) the torch ops.
MOE_TRITON_ROUTING_MAX_TOKENS = 512


class MoEMethod(QuantizeMethod):
    """Creates the experts' parameters and computes sum_k w_k * expert_k(x), as vLLM's FusedMoEMethodBase."""

    @abstractmethod
    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate: int) -> None:
        """Register the parameters of `num_experts` experts of this rank's `intermediate` size on `layer`,
        each with `weight_loader` = layer.weight_loader."""

    @abstractmethod
    def experts(self, layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(w13, w2, MoEQuant or None): the experts' weights as `fused_moe` takes them."""

    def apply(
        self,
        layer: FusedMoE,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        addend: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """hidden [T, H], routing weights and expert ids [T, k] -> this rank's sum over the k experts [T, H]
        (plus sigmoid(gate) * shared of `addend`: a shared expert's, added in the sum's own launch): the Triton
        `fused_moe` on CUDA, its torch reference `fused_moe_ref` elsewhere (same signature and rounding)."""
        w13, w2, quant = self.experts(layer)
        kw = dict(quant=quant, expert_map=layer.expert_map, addend=addend)
        if use_triton(hidden):
            from longserve.kernels.fused_moe import fused_moe  # imports triton

            return fused_moe(hidden, w13, w2, topk_weights, topk_ids, **kw)  # [T, H]
        return fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids, **kw)  # [T, H]


class UnquantizedMoEMethod(MoEMethod):
    """w13 [E, 2I, H] and w2 [E, H, I] in the model's dtype; the Triton `fused_moe` on CUDA, its torch
    reference `fused_moe_ref` elsewhere (same signature and rounding)."""

    name = UNQUANTIZED

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate: int) -> None:
        for name, shape in (
            ("w13", (num_experts, 2 * intermediate, hidden_size)),
            ("w2", (num_experts, hidden_size, intermediate)),
        ):
            layer.register_parameter(name, expert_param(layer, torch.empty(shape), name))

    def experts(self, layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor, Any]:
        return layer.w13, layer.w2, None


class PendingMoEMethod(MoEMethod):
    """Quantized experts before they know their method (as linear_method.PendingLinearMethod): records the
    shape; models/quant/bind.py gives the layer its method by its checkpoint name."""

    name = "pending"

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate: int) -> None:
        layer.pending_weights = (num_experts, hidden_size, intermediate)

    def experts(self, layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor, Any]:
        raise RuntimeError(
            "quantized experts get their method from longserve.models.load_model (quant/bind.py)"
        )


# whole-model methods; quantized formats pick per layer (PendingMoEMethod)
MOE_METHODS: dict[str, type[MoEMethod]] = {UNQUANTIZED: UnquantizedMoEMethod}


def get_moe_method(hf_config: Any) -> MoEMethod:
    """The MoE method of the checkpoint's weight format: a whole-model one of MOE_METHODS, else pending."""
    if quantization_method(hf_config) in MOE_METHODS:
        return method_for(MOE_METHODS, hf_config, "MoE experts")
    return PendingMoEMethod()


def expert_param(
    layer: FusedMoE, data: torch.Tensor, proj: str, layout: WeightLayout = PLAIN, **attrs
) -> nn.Parameter:
    """A stacked expert parameter [E_local, ...] of projection `proj` ("w13": gate|up, "w2": down) whose
    per-expert checkpoint tensor has `layout` (models/quant/layout.py); loaded by `layer.weight_loader`."""
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
    param.moe_proj, param.weight_layout = proj, layout  # type: ignore[attr-defined]
    for key, value in attrs.items():
        setattr(param, key, value)
    return param


class FusedMoE(nn.Module):
    """`num_experts` SiLU-gated experts of `intermediate_size`, top-k routed from router logits [T, E].

    renormalize: the k routing weights are divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob).
    round_routing_weights: the weights are rounded to the logits' dtype before use (HF's Qwen2/Qwen3-MoE
    routers do; Mixtral keeps them float32). `weight_loader(param, loaded, shard_id)` takes a whole stacked
    tensor of the checkpoint (w13 [E, 2I, H] or w2 [E, H, I], shard_id None) or one expert's projection
    (shard_id "gate:e" / "up:e" [I, H], "down:e" [H, I]) and keeps this rank's experts and slices of it.
    ep_size: expert-parallel groups (default: the process group's, distributed.get_ep_size()).
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
        ep_size: int | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.renormalize, self.scoring = renormalize, scoring
        self.round_routing_weights = round_routing_weights
        self.tp_size = get_tp_size()
        self.placement = expert_placement(
            num_experts, intermediate_size, self.tp_size, get_tp_rank(), ep_size or get_ep_size()
        )
        self.expert_start, self.num_local_experts = self.placement.expert_start, self.placement.num_local
        self.inter_start, self.inter = self.placement.inter_start, self.placement.inter_size
        emap = None  # ep > 1: [E] int32, global expert id -> row of w13/w2 on this rank, or -1
        if self.num_local_experts != num_experts:
            emap = torch.full((num_experts,), -1, dtype=torch.int32)
            emap[self.expert_start : self.expert_start + self.num_local_experts] = torch.arange(
                self.num_local_experts, dtype=torch.int32
            )
        self.register_buffer("expert_map", emap, persistent=False)
        self.quant_method = quant_method or UnquantizedMoEMethod()
        self.quant_method.create_weights(self, self.num_local_experts, hidden_size, self.inter)

    def required_shards(self, param: nn.Parameter) -> set[str]:
        """The per-expert shard ids a checkpoint must supply for `param` (this rank's experts); a stacked
        tensor (shard id None) supplies them all at once."""
        kinds = ("gate", "up") if param.moe_proj == "w13" else ("down",)  # type: ignore[attr-defined]
        first = self.expert_start
        return {f"{k}:{e}" for k in kinds for e in range(first, first + self.num_local_experts)}

    def weight_loader(self, param: nn.Parameter, loaded: TensorLike, shard_id: str | None = None) -> None:
        """Copy this rank's part of an expert tensor: its experts [start, start + E/ep) of a stacked one, and
        of each the gate and up rows [start, start + I/moe_tp) of w13 (each half narrowed on its own), the
        columns [start, start + I/moe_tp) of w2. Only that region is read from a lazy checkpoint tensor."""
        check_dtype(param, loaded)
        if shard_id is not None:
            self._load_expert(param, loaded, shard_id)
            return
        if layout_of(param) != PLAIN:
            raise ValueError(f"{tensor_name(loaded)}: quantized experts load one expert's tensor at a time")
        full, start, size = self.intermediate_size, self.inter_start, self.inter
        w13 = param.moe_proj == "w13"  # type: ignore[attr-defined]
        expected = self.full_shape(param)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)}, experts expect {expected}")
        if self.num_local_experts != self.num_experts:  # expert parallel: this rank's experts only
            loaded = loaded.narrow(0, self.expert_start, self.num_local_experts)
        if w13:  # gate rows [0, I) then up rows [I, 2I): this rank's slice of each
            param.data[:, :size].copy_(as_tensor(loaded.narrow(1, start, size)))
            param.data[:, size:].copy_(as_tensor(loaded.narrow(1, full + start, size)))
        else:
            param.data.copy_(as_tensor(loaded.narrow(2, start, size)))

    def _load_expert(self, param: nn.Parameter, loaded: TensorLike, shard_id: str) -> None:
        """One expert's gate [I, H], up [I, H] or down [H, I] projection, copied straight into its place in
        the stacked parameter (no stacked copy of the checkpoint's tensors is ever built)."""
        kind, _, index = shard_id.partition(":")
        expert = int(index)
        if kind not in EXPERT_SHARDS or not 0 <= expert < self.num_experts:
            raise ValueError(
                f"expert tensor {shard_id!r} does not fit a layer of {self.num_experts} experts "
                f"(kinds {', '.join(EXPERT_SHARDS)})"
            )
        if (kind == "down") != (param.moe_proj == "w2"):  # type: ignore[attr-defined]
            raise ValueError(f"expert tensor {shard_id!r} does not belong in this parameter")
        layout = layout_of(param)
        full, start, size = self.intermediate_size, self.inter_start, self.inter
        expected = (self.hidden_size, full) if kind == "down" else (full, self.hidden_size)
        if layout == PLAIN and tuple(loaded.shape) != expected:
            raise ValueError(
                f"shape mismatch for expert {expert}'s {kind} projection: checkpoint {tuple(loaded.shape)}, "
                f"expected {expected}"
            )
        if not self.placement.is_local(expert):
            return  # another rank's expert: nothing is read
        row = param.data[expert - self.expert_start]  # this expert's [2I/tp, H] / [H, I/tp] (or its layout's)
        what = f"{tensor_name(loaded)} (expert {expert}'s {kind} projection)"
        if layout.per_shard:  # one entry per projection (a per-tensor scale, weight_shape)
            target = row[1 if kind == "up" else 0]
            if loaded.numel() != target.numel():
                raise ValueError(f"{what}: expected {target.numel()} value(s); got {tuple(loaded.shape)}")
            target.copy_(as_tensor(loaded).reshape(target.shape))
            return
        if kind == "down":
            d, pack = layout.in_dim, layout.in_pack
            if d is not None and d < loaded.dim() and size != full and loaded.shape[d] == entries(full, pack):
                first, count = packed_region(start, size, pack, full, what)
                loaded = loaded.narrow(d, first, count)
            target = row
        elif layout.out_dim is None or layout.out_dim >= row.dim():  # gate and up alike (act-order g_idx)
            tensor = as_tensor(loaded)
            seen: set[tuple[int, str]] = param.__dict__.setdefault("shards_loaded", set())
            other = (expert, "up" if kind == "gate" else "gate")
            if other in seen and tensor.shape == row.shape and not torch.equal(row, tensor.to(row.dtype)):
                raise ValueError(
                    f"{what} differs from the {other[1]} projection's: longserve needs them equal"
                )
            seen.add((expert, kind))
            loaded, target = tensor, row
        else:
            d, pack = layout.out_dim, layout.out_pack
            first, count = packed_region(0 if kind == "gate" else size, size, pack, 2 * size, what)
            if size != full and loaded.shape[d] == entries(full, pack):
                c_first, c_count = packed_region(start, size, pack, full, what)
                loaded = loaded.narrow(d, c_first, c_count)
            target = row.narrow(d, first, count)
        if target.shape != loaded.shape:
            raise ValueError(
                f"shape mismatch for expert {expert}'s {kind} projection: checkpoint {tuple(loaded.shape)}, "
                f"expected {tuple(target.shape)} on this rank"
            )
        target.copy_(as_tensor(loaded))

    def full_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        """The shape of `param` in the checkpoint (every expert, all ranks' intermediate slices)."""
        if param.moe_proj == "w13":  # type: ignore[attr-defined]
            return (self.num_experts, 2 * self.intermediate_size, self.hidden_size)
        return (self.num_experts, self.hidden_size, self.intermediate_size)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] -> (routing weights [T, k], expert ids [T, k] int32)."""
        if 0 < router_logits.shape[0] <= MOE_TRITON_ROUTING_MAX_TOKENS and use_triton(router_logits):
            from longserve.kernels.moe_routing import route_topk_fused  # imports triton

            dtype = router_logits.dtype if self.round_routing_weights else torch.float32
            return route_topk_fused(router_logits, self.top_k, self.renormalize, self.scoring, dtype)
        weights, ids = route_topk(router_logits, self.top_k, self.renormalize, self.scoring)
        if self.round_routing_weights:
            weights = weights.to(router_logits.dtype)
        return weights, ids

    def partial(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor,
        addend: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """This rank's share of the experts' output [T, H], before the all-reduce (all of it at tp=1); with
        `addend` (gate [T, 1], shared [T, H]) plus sigmoid(gate) * shared (MoEMethod.apply)."""
        if torch._C._autograd._profiler_enabled():
            with torch.profiler.record_function(PROFILE_RANGE):
                return self._compute(hidden, router_logits, addend)
        return self._compute(hidden, router_logits, addend)

    def _compute(self, hidden: torch.Tensor, router_logits: torch.Tensor, addend: Any) -> torch.Tensor:
        topk_weights, topk_ids = self.route(router_logits)
        return self.quant_method.apply(self, hidden, topk_weights, topk_ids, addend)  # [T, H]

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], router logits [T, E] -> sum_k w_k * expert_k(hidden) [T, H]."""
        out = self.partial(hidden, router_logits)
        return out if self.tp_size == 1 else tp_all_reduce(out)


def expert_weight_summary(model: nn.Module) -> dict[str, int]:
    """The experts' share of a model's weights on this rank: bytes of every FusedMoE parameter, the number of
    MoE layers, experts per layer and those held here (all of them but under expert parallelism)."""
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    return dict(
        expert_weight_bytes=sum(p.numel() * p.element_size() for m in layers for p in m.parameters()),
        moe_layers=len(layers),
        num_experts=layers[0].num_experts if layers else 0,
        local_experts=layers[0].num_local_experts if layers else 0,
    )
