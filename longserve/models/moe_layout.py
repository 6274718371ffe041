"""What a mixture-of-experts config asks for, read from an HF config object or its config.json dict (pure
Python: the benchmarks size memory and floors from it without torch), and where each rank's experts lie.

Qwen2-MoE and Qwen3-MoE make layer i sparse when i is not in `mlp_only_layers` and (i + 1) is a multiple
of `decoder_sparse_step`; the other layers keep a dense MLP of `intermediate_size`. Mixtral's every layer is
sparse and its experts are `intermediate_size` wide. Qwen2-MoE and Qwen3.5-MoE have a shared expert (with its
sigmoid `shared_expert_gate`), as has Qwen3-Next (Qwen2-MoE's sparse layers); Qwen3.5-MoE's every layer is
sparse.

Placement over the tensor-parallel ranks: `ep_size` (1 <= ep_size, dividing tp_size) groups of
tp_size / ep_size consecutive ranks; group g holds experts [g E/ep, (g+1) E/ep) whole along the expert axis,
each of its ranks a 1/(tp/ep) slice of their intermediate dim. ep_size = 1 is plain tensor parallelism
(every rank holds every expert, a 1/tp slice of each), ep_size = tp_size is vLLM's --enable-expert-parallel
(whole experts, E/tp per rank). Every layout sums to the whole over all ranks, so one all-reduce combines.

    E=8, tp=4:   ep=1: every rank experts 0-7, intermediate quarter r
                 ep=2: ranks 0,1 experts 0-3 (intermediate halves), ranks 2,3 experts 4-7
                 ep=4: rank r experts 2r, 2r+1 whole
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MIXTRAL, QWEN2_MOE, QWEN3_MOE = "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"
QWEN3_5_MOE, QWEN3_NEXT = "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"
_MODEL_TYPES = {"mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE, "qwen3_5_moe": QWEN3_5_MOE,
                "qwen3_5_moe_text": QWEN3_5_MOE, "qwen3_next": QWEN3_NEXT}  # fmt: skip
_ARCHITECTURES = {MIXTRAL: MIXTRAL, QWEN2_MOE: QWEN2_MOE, QWEN3_MOE: QWEN3_MOE, QWEN3_5_MOE: QWEN3_5_MOE,
                  "Qwen3_5MoeForConditionalGeneration": QWEN3_5_MOE, QWEN3_NEXT: QWEN3_NEXT}  # fmt: skip
# with a gated shared expert beside the routed ones; Qwen3.5's router always renormalizes (no norm_topk_prob)
_SHARED_EXPERT = (QWEN2_MOE, QWEN3_5_MOE, QWEN3_NEXT)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    value = cfg.get(key, default) if isinstance(cfg, Mapping) else getattr(cfg, key, default)
    return default if value is None else value


@dataclass(frozen=True)
class MoESpec:
    """The experts of an MoE config (the same in every sparse layer)."""

    architecture: str
    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's
    renormalize: bool  # divide the k routing weights by their sum (Mixtral; Qwen's norm_topk_prob)
    round_routing_weights: bool  # Qwen's routers round the weights to the model dtype, Mixtral's not
    shared_intermediate_size: int  # Qwen2-MoE's shared expert (0: none)
    sparse_layers: frozenset[int]  # the layers with experts; the others have a dense MLP
    dense_intermediate_size: int  # the dense layers' MLP (unused when every layer is sparse)
    num_layers: int

    def is_sparse(self, layer_id: int) -> bool:
        return layer_id in self.sparse_layers

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - len(self.sparse_layers)


def moe_architecture(cfg: Any) -> str | None:
    """The MoE architecture of a config (its `architectures`, else its `model_type`), or None."""
    for arch in _get(cfg, "architectures", None) or []:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    return _MODEL_TYPES.get(_get(cfg, "model_type", ""))


def moe_spec(cfg: Any) -> MoESpec | None:
    """The experts of `cfg` (an HF config or a config.json dict), None for a dense model. Defaults are
    transformers' config classes' own (norm_topk_prob False for both Qwen-MoE, decoder_sparse_step 1)."""
    arch = moe_architecture(cfg)
    if arch is None:
        return None
    num_layers = int(_get(cfg, "num_hidden_layers"))
    if arch == MIXTRAL:
        return MoESpec(
            architecture=arch,
            num_experts=int(_get(cfg, "num_local_experts", 8)),
            top_k=int(_get(cfg, "num_experts_per_tok", 2)),
            intermediate_size=int(_get(cfg, "intermediate_size")),
            renormalize=True,
            round_routing_weights=False,
            shared_intermediate_size=0,
            sparse_layers=frozenset(range(num_layers)),
            dense_intermediate_size=int(_get(cfg, "intermediate_size")),
            num_layers=num_layers,
        )
    # config.json as transformers 5 writes a Qwen-MoE config names them num_local_experts (its config classes read
    # either); the released checkpoints' (transformers 4) num_experts
    num_experts = int(_get(cfg, "num_experts", None) or _get(cfg, "num_local_experts", 0))
    step = int(_get(cfg, "decoder_sparse_step", 1))
    dense_only = set(_get(cfg, "mlp_only_layers", None) or [])
    sparse = frozenset(
        i for i in range(num_layers) if i not in dense_only and num_experts > 0 and (i + 1) % step == 0
    )
    return MoESpec(
        architecture=arch,
        num_experts=num_experts,
        top_k=int(_get(cfg, "num_experts_per_tok", 1)),
        intermediate_size=int(_get(cfg, "moe_intermediate_size")),
        renormalize=bool(_get(cfg, "norm_topk_prob", arch == QWEN3_5_MOE)),
        round_routing_weights=True,
        shared_intermediate_size=int(_get(cfg, "shared_expert_intermediate_size", 0))
        if arch in _SHARED_EXPERT
        else 0,
        sparse_layers=sparse,
        dense_intermediate_size=int(_get(cfg, "intermediate_size", 0)),
        num_layers=num_layers,
    )


@dataclass(frozen=True)
class ExpertPlacement:
    """One rank's experts: [expert_start, expert_start + num_local) of num_experts, intermediate rows
    [inter_start, inter_start + inter_size) of each (see the module docstring)."""

    num_experts: int
    expert_start: int
    num_local: int
    intermediate_size: int
    inter_start: int
    inter_size: int
    ep_size: int
    ep_rank: int

    def is_local(self, expert: int) -> bool:
        return self.expert_start <= expert < self.expert_start + self.num_local


def expert_placement(
    num_experts: int, intermediate_size: int, tp_size: int, tp_rank: int, ep_size: int
) -> ExpertPlacement:
    """Rank `tp_rank`'s experts and intermediate slice; ValueError naming the setting that cannot split."""
    if ep_size < 1 or tp_size % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide tp_size={tp_size}")
    if num_experts % ep_size:
        raise ValueError(
            f"ep_size={ep_size} does not divide the model's {num_experts} experts; choose an expert-parallel "
            f"size that divides {num_experts}"
        )
    moe_tp = tp_size // ep_size
    if intermediate_size % moe_tp:
        split, fix = (
            (f"tp_size={tp_size}", "choose a tp size that divides it, or place whole experts (ep_size)")
            if ep_size == 1
            else (f"tp_size / ep_size = {moe_tp}", "raise ep_size or lower tp_size")
        )
        raise ValueError(
            f"the experts' intermediate size {intermediate_size} is not divisible by {split}; {fix}"
        )
    ep_rank, moe_tp_rank = divmod(tp_rank, moe_tp)
    num_local, inter_size = num_experts // ep_size, intermediate_size // moe_tp
    return ExpertPlacement(
        num_experts=num_experts,
        expert_start=ep_rank * num_local,
        num_local=num_local,
        intermediate_size=intermediate_size,
        inter_start=moe_tp_rank * inter_size,
        inter_size=inter_size,
        ep_size=ep_size,
        ep_rank=ep_rank,
    )


def validate_moe_parallel(spec: MoESpec, tp_size: int, ep_size: int) -> None:
    """Raise a clear ValueError when the MoE parts of a model cannot be split over tp_size ranks with
    ep_size expert groups (the attention heads are checked by decoder.validate_tp_size)."""
    expert_placement(spec.num_experts, spec.intermediate_size, tp_size, 0, ep_size)
    if spec.shared_intermediate_size % tp_size:
        raise ValueError(
            f"shared_expert_intermediate_size={spec.shared_intermediate_size} is not divisible by "
            f"tp_size={tp_size}"
        )
    if spec.num_dense_layers and spec.dense_intermediate_size % tp_size:
        raise ValueError(
            f"intermediate_size={spec.dense_intermediate_size} (the dense layers' MLP) is not divisible by "
            f"tp_size={tp_size}"
        )


def expected_distinct_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Experts a step of `num_tokens` tokens touches on average when each token picks top_k distinct experts
    uniformly: E (1 - (1 - k/E)^T). One token touches k; an 8K-token chunk touches all of them."""
    if num_tokens <= 0 or num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)
