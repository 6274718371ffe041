"""`CausalLM`: the decoder plus LM head, the runner-facing model API, and HF-name weight loading.

Runner contract: `model(input_ids [T], positions [T], ctx) -> hidden [T, hidden_size]` over the flattened
new tokens of every request; `compute_logits(hidden [N, hidden_size]) -> [N, vocab] float32`. Under tensor
parallelism every rank runs both (they hold collectives); `num_heads`/`num_kv_heads` are the rank's own.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Generator, Iterable
from typing import Any

import torch
from torch import nn

from longserve.attention.base import ForwardContext
from longserve.attention.kv_quant import kv_scale_name, read_kv_scale
from longserve.attention.recurrent_state import RecurrentStateSpec
from longserve.distributed import get_tp_rank, get_tp_size
from longserve.models.decoder import (
    ArchOptions,
    AttentionCall,
    DecoderModel,
    MakeMLP,
    dense_mlp,
    get_head_dim,
    head_layout,
)
from longserve.models.layers import (
    STACKED_PARAMS,
    MergedLinear,
    ParallelLMHead,
    default_weight_loader,
    parallel_logits,
)

# checkpoint tensors that are derived, not learned
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class CausalLM(nn.Module):
    """Base of every supported architecture; subclasses override `arch_options`, and MoE models `make_mlp`
    (their layers' MLPs) and `map_weight_name` (their expert tensors' names)."""

    make_mlp: MakeMLP = staticmethod(dense_mlp)
    decoder_class: type[nn.Module] = DecoderModel  # the layers (a hybrid model's: models/hybrid.py)

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.config = hf_config
        self.model = self.decoder_class(hf_config, self.arch_options(hf_config), self.make_mlp)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.num_layers: int = self.model.num_kv_layers  # the layers with K/V in the cache
        total_heads = hf_config.num_attention_heads
        layout = head_layout(
            total_heads,
            getattr(hf_config, "num_key_value_heads", None) or total_heads,
            get_tp_size(),
            get_tp_rank(),
        )
        self.num_heads: int = layout.num_q  # this rank's heads (all of them at tp=1)
        self.num_kv_heads: int = layout.num_kv
        self.head_dim: int = get_head_dim(hf_config)
        self.hidden_size: int = hf_config.hidden_size
        self.vocab_size: int = hf_config.vocab_size
        # the checkpoint's calibrated fp8 KV scales by (layer, "k" | "v" | "kv"), if any (attention/kv_quant.py)
        self.kv_scales: dict[tuple[int, str], float] = {}

    @classmethod
    def arch_options(cls, hf_config: Any) -> ArchOptions:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)  # [T, hidden]

    def pieces(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> Generator[AttentionCall, torch.Tensor, torch.Tensor]:
        """`forward` with each layer's attention left to the caller (DecoderModel.pieces)."""
        return self.model.pieces(input_ids, positions, ctx)

    def forward_overlapped(
        self, batches: list[tuple[torch.Tensor, torch.Tensor, ForwardContext]]
    ) -> list[torch.Tensor]:
        """Micro-batches of one step with their all-reduces overlapped (DecoderModel.forward_overlapped)."""
        return self.model.forward_overlapped(batches)  # [T_i, hidden] each

    def recurrent_states(self) -> tuple[int, RecurrentStateSpec] | None:
        """A hybrid model's linear-attention layers and their state (attention/recurrent_state.py); None here."""
        return None

    def reserve_positions(self, num_positions: int) -> None:
        """Serve positions up to `num_positions` (a context length past max_position_embeddings)."""
        self.model.rotary_emb.reserve(num_positions)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32; under tp each rank's vocab slice, all-gathered."""
        return parallel_logits(hidden, self.lm_head_weight, self.vocab_size)  # [N, V] float32

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters; raise if a tensor is unknown or a parameter unloaded."""
        params = dict(self.named_parameters())
        required: dict[str, set[str | None]] = {name: {None} for name in params}
        for mod_name, mod in self.named_modules():
            if isinstance(mod, MergedLinear):
                for pname, _ in mod.named_parameters(prefix=mod_name):
                    required[pname] = set(mod.shard_sizes)
            elif hasattr(mod, "required_shards"):  # stacked experts: each expert's tensors, or one stack
                for pname, param in mod.named_parameters(prefix=mod_name, recurse=False):
                    required[pname] = mod.required_shards(param)
        loaded: dict[str, set[str | None]] = defaultdict(set)

        for name, tensor in weights:
            if name.endswith(_SKIPPED_SUFFIXES) or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            kv_scale = kv_scale_name(name)  # a calibrated fp8 KV scale: the KV cache's, not a parameter
            if kv_scale is not None:
                self.kv_scales[kv_scale] = read_kv_scale(tensor, name)
                continue
            pname, shard_id = self.map_weight_name(name)
            if pname not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}"
                    f" (looked for {pname!r})"
                )
            param = params[pname]
            loader = getattr(param, "weight_loader", None)
            with torch.no_grad():
                if loader is not None:
                    loader(param, tensor, shard_id)
                else:
                    default_weight_loader(param, tensor)
            if shard_id is None:
                loaded[pname] |= required[pname]
            else:
                loaded[pname].add(shard_id)

        missing = sorted(n for n, req in required.items() if not req <= loaded[n])
        if missing:
            shown = ", ".join(missing[:10]) + (f", ... ({len(missing)} in all)" if len(missing) > 10 else "")
            raise ValueError(f"checkpoint is missing weights for parameters: {shown}")

    def map_weight_name(self, name: str) -> tuple[str, str | None]:
        """HF tensor name -> (our parameter name, shard id within a fused parameter or None)."""
        return _map_name(name)


def _map_name(name: str) -> tuple[str, str | None]:
    """HF tensor name -> (our parameter name, shard id within a fused parameter or None)."""
    for fused, hf, shard_id in STACKED_PARAMS:
        if f".{hf}." in name:
            return name.replace(f".{hf}.", f".{fused}."), shard_id
    return name, None
