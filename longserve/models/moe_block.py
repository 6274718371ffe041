"""The sparse MLP of an MoE layer: router, experts (FusedMoE) and Qwen2-MoE's gated shared expert, with one
all-reduce under tensor or expert parallelism; and the mapping of checkpoint expert names onto it.

    x ─ router (replicated [E, H]) ─ top-k ─ experts (this rank's) ─┐
      └ shared expert (tp-sliced MLP) * sigmoid(shared_expert_gate x) ┴ + ─ all-reduce ─ out

Rounding follows transformers 5 at tp=1: router logits in the model dtype, softmax in fp32 (moe_reference),
the shared expert's output times the sigmoid of its gate in the model dtype, added to the experts' sum.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from longserve.distributed import get_tp_size, tp_all_reduce
from longserve.kernels.activation_reference import sigmoid_gated_add_ref
from longserve.models.decoder import MLP, ArchOptions, dense_mlp
from longserve.models.layers import default_weight_loader
from longserve.models.linear_method import (
    LinearMethod,
    StacksInputs,
    is_plain,
    plain_linear,
    stack_plain_weights,
)
from longserve.models.moe import FusedMoE, get_moe_method
from longserve.models.moe_layout import MoESpec, moe_spec

# Up to this many tokens a step, a block whose router, shared-expert gate and shared expert's gate|up all read x
# as plain weights at tp = 1 runs them as one GEMM over their weights stacked [2I + E + 1, H] (after loading:
# `linear_method.stack_inputs`): a decode step of the seed's GPTQ-int4 35B-A3B ran 110 cuBLAS GEMVs of the smallest tile, 5.4 us
# each (H100, RESULTS.md forty-eighth session), the router's and the shared gate's among them, and two of three
# such launches a layer go. Measured (H100, `gpu_check.sh seed-decode`, RESULTS.md forty-ninth session): decode b1@32K
# 3.98 -> 3.58 ms, b64@4K 15.37 -> 15.48 ms; so on for small batches only (8: b2-b8 unmeasured). Read at each call.
STACKED_INPUTS_MAX_TOKENS = 8
# The shared expert scaled by its gate and added to the routed experts' sum inside the experts' k-sum launch
# (kernels/moe_sum.py's addend; activation.sigmoid_gated_add after paths that end otherwise) where torch launched
# three ops: 120 launches fewer a decode step of the seed's 40 MoE layers. As one kernel after the sum (80 fewer) it
# was measured with gated_delta_net.FUSED_DECODE_GATING (its comment); in the sum, not yet measured.
FUSED_SHARED_GATE = True


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole weight [out, in] on every rank (the router, the shared expert's gate): small,
    and every rank needs all of its outputs. Plain weights whatever the checkpoint's format, as vLLM's
    routers."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: str | None = None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return plain_linear(x, self.weight)  # [T, out]


class SparseMoeBlock(nn.Module, StacksInputs):
    """Router + experts (+ Qwen2-MoE's shared expert); parameter names as transformers 5's
    (`gate.weight`, `experts.*`, `shared_expert.*`, `shared_expert_gate.weight`)."""

    def __init__(self, hf_config: Any, spec: MoESpec, opts: ArchOptions, linear: LinearMethod) -> None:
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; supported: silu")
        hidden = hf_config.hidden_size
        self.gate = ReplicatedLinear(hidden, spec.num_experts)
        self.experts = FusedMoE(
            spec.num_experts,
            spec.top_k,
            hidden,
            spec.intermediate_size,
            renormalize=spec.renormalize,
            round_routing_weights=spec.round_routing_weights,
            quant_method=get_moe_method(hf_config),
        )
        self.shared_expert: MLP | None = None
        if spec.shared_intermediate_size:
            self.shared_expert = MLP(hf_config, opts, linear, spec.shared_intermediate_size)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1)
        self.tp_size = self.experts.tp_size
        # gate_up | router | shared gate stacked [2I + E + 1, H] (stack_inputs), the three weights views of it
        self.stacked_inputs: torch.Tensor | None = None

    def stack_inputs(self) -> bool:
        """After loading: the router, the shared expert's gate and gate|up weights as views of one stacked
        tensor, where all three are plain weights on one rank (see STACKED_INPUTS_MAX_TOKENS); False: not so."""
        shared = self.shared_expert
        if shared is None or get_tp_size() != 1 or not is_plain(shared.gate_up_proj):
            return False
        parts = [shared.gate_up_proj.weight, self.gate.weight, self.shared_expert_gate.weight]
        self.stacked_inputs = stack_plain_weights(parts)  # [2I + E + 1, H]
        return self.stacked_inputs is not None

    def _stacked(self, x: torch.Tensor) -> torch.Tensor:
        """`partial` through the stacked input GEMM: [T, H]."""
        y = plain_linear(x, self.stacked_inputs)  # [T, 2I + E + 1]: gate|up, router logits, shared gate
        two_i, num_experts = self.shared_expert.gate_up_proj.weight.shape[0], self.gate.weight.shape[0]
        shared = self.shared_expert.down_proj.partial(y[:, :two_i], gated=True)  # [T, H]
        return self._experts_plus(x, y[:, two_i : two_i + num_experts], y[:, -1:], shared)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the block's output [T, H], before the all-reduce (the whole at tp=1)."""
        if self.stacked_inputs is not None and x.shape[0] <= STACKED_INPUTS_MAX_TOKENS:
            return self._stacked(x)
        if self.shared_expert is None:
            return self.experts.partial(x, self.gate(x))  # [T, H]
        shared = self.shared_expert.partial(x)  # [T, H] this rank's slice's sum, no bias
        # the gate scales every rank's partial sum alike: sigmoid(g) * sum_r s_r = sum_r sigmoid(g) * s_r
        return self._experts_plus(x, self.gate(x), self.shared_expert_gate(x), shared)

    def _experts_plus(
        self, x: torch.Tensor, logits: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' sum [T, H] + sigmoid(gate [T, 1]) * shared [T, H]: added in the experts' own k-sum
        (MoEMethod.apply's addend: no launch of its own where the path ends in moe_sum) with FUSED_SHARED_GATE,
        else by torch's three ops after it."""
        if FUSED_SHARED_GATE:
            return self.experts.partial(x, logits, addend=(gate, shared))
        return sigmoid_gated_add_ref(self.experts.partial(x, logits), gate, shared)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        return y  # no bias: the all-reduced sum is the output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.partial(x)
        return out if self.tp_size == 1 else tp_all_reduce(out)  # [T, H]


def make_moe_mlp(hf_config: Any, opts: ArchOptions, layer_id: int, linear: LinearMethod) -> nn.Module:
    """Layer `layer_id`'s MLP: sparse where the config says (decoder_sparse_step, mlp_only_layers), else
    the dense MLP of intermediate_size."""
    spec = moe_spec(hf_config)
    if spec is None or not spec.is_sparse(layer_id):
        return dense_mlp(hf_config, opts, layer_id, linear)
    return SparseMoeBlock(hf_config, spec, opts, linear)


# checkpoint expert names: per expert (Qwen: gate/up/down_proj; Mixtral: w1 = gate, w3 = up, w2 = down) or
# stacked (transformers 5: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<suffix>\w+)$"
)
_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_KIND = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def map_expert_name(name: str) -> tuple[str, str | None] | None:
    """A checkpoint expert tensor's name (after `block_sparse_moe.` -> `mlp.`) -> (our parameter name,
    shard id), or None if it is not an expert tensor. `experts.3.gate_proj.weight` -> `experts.w13`, "gate:3";
    a quantized one's other tensors keep their suffix: `experts.3.down_proj.qzeros` -> `experts.w2_qzeros`."""
    m = _PER_EXPERT.match(name)
    if m is not None:
        kind = _KIND[m["proj"]]
        proj = "w2" if kind == "down" else "w13"
        # a quantized expert's tensors (qweight, scales, weight_scale_inv, ...) are `w13_qweight` etc.
        suffix = "" if m["suffix"] == "weight" else "_" + m["suffix"]
        return f"{m['prefix']}.{proj}{suffix}", f"{kind}:{int(m['e'])}"
    m = _STACKED.match(name)
    if m is not None:
        return f"{m['prefix']}.{'w13' if m['proj'] == 'gate_up_proj' else 'w2'}", None
    return None
