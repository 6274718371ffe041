"""The recurrent states of a hybrid model's linear-attention layers (Gated DeltaNet): the KV cache's sibling.

A full-attention layer keeps every past token's K/V in pages; a Gated DeltaNet layer folds its past into a
fixed-size state a request: the last W-1 inputs of its causal conv (`conv[layer]`: [slots, W-1, conv_dim], the
model's dtype) and the delta rule's matrix (`ssm[layer]`: [slots, value heads, key dim, value dim]). Slot s of
every layer belongs to the request holding slot s (cache/state_slots.py hands them out); a slot's old contents
are never read by a request starting afresh (the kernels zero-start where the step's prefix length is 0), so
nothing is cleared between holders.

The state's dtype: the model's by default (`--mamba-ssm-cache-dtype auto`, as vLLM keeps a Qwen3.5's); float32
as SGLang and transformers keep it (the delta rule's state accumulates every token: rounding it to bf16 at each
step drifts), at twice the memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longserve.platform import host_to_device


@dataclass(frozen=True)
class RecurrentStateSpec:
    """One linear-attention layer's state on this rank (every such layer has the same)."""

    conv_dim: int  # channels of the causal conv: q, k and v of this rank's heads
    conv_width: int  # W: the conv keeps W-1 past inputs
    num_v_heads: int  # this rank's value heads
    k_dim: int  # key head dim
    v_dim: int  # value head dim

    @classmethod
    def for_heads(
        cls, num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int, conv_width: int
    ) -> RecurrentStateSpec:
        """The state of a Gated DeltaNet layer with this rank's key and value heads: the conv runs over q | k | v."""
        return cls(2 * num_k_heads * k_dim + num_v_heads * v_dim, conv_width, num_v_heads, k_dim, v_dim)

    def bytes_per_slot(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
        conv = (self.conv_width - 1) * self.conv_dim * conv_dtype.itemsize
        ssm = self.num_v_heads * self.k_dim * self.v_dim * ssm_dtype.itemsize
        return conv + ssm


class RecurrentStates:
    """`conv[i]`, `ssm[i]`: the states of the model's i-th linear-attention layer: `num_slots` rows for running
    requests, then `num_checkpoints` rows the prefix cache keeps states in (cache/state_radix_tree.py)."""

    def __init__(
        self,
        num_layers: int,
        spec: RecurrentStateSpec,
        num_slots: int,
        conv_dtype: torch.dtype,
        ssm_dtype: torch.dtype,
        device: torch.device | str,
        num_checkpoints: int = 0,
    ) -> None:
        self.spec = spec
        self.num_slots = num_slots
        self.num_checkpoints = num_checkpoints
        rows = num_slots + num_checkpoints
        # every layer's rows in one tensor a kind ([layers, rows, ...]), each layer's a contiguous view of it: a
        # copy of some rows is two launches a kind, where a tensor a layer took two a layer (120 for Qwen3.5's 30
        # linear-attention layers; two rows of 30 tiny layers on the CI CPU: 259-271 -> 54-70 us,
        # scripts/dev/state_copy_time.py, RESULTS.md forty-eighth session). Prefix-cache saves and restores, and
        # decode checkpoints, each pay one.
        self._conv = torch.zeros(
            (num_layers, rows, spec.conv_width - 1, spec.conv_dim), dtype=conv_dtype, device=device
        )
        self._ssm = torch.zeros(
            (num_layers, rows, spec.num_v_heads, spec.k_dim, spec.v_dim), dtype=ssm_dtype, device=device
        )
        self.conv, self.ssm = list(self._conv.unbind(0)), list(self._ssm.unbind(0))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._conv, self._ssm))

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Row `to` of every layer's states <- row `from`, for each (from, to) (no `to` repeats, no row both read
        and written: a restore reads a checkpoint into a slot, a save a slot into a checkpoint)."""
        if not pairs:
            return
        src, dst = (
            host_to_device(list(rows), dtype=torch.int64, device=self._conv.device) for rows in zip(*pairs)
        )
        for t in (self._conv, self._ssm):
            t.index_copy_(1, dst, t.index_select(1, src))
