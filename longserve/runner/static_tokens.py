"""The token rows a captured step reads: ids, positions and K/V slots in static [n] int64 buffers that the decode
and chunk graphs (runner/cuda_graph.py) and the piecewise graphs (runner/piecewise_graph.py) were captured over.
A replay copies its step's tokens into the first rows; the rest are padding: token 0 with its K/V into slot 0
(page 0, reserved), at position 0 or at the step's last position."""

from __future__ import annotations

import torch


class StaticTokens:
    def __init__(self, n: int, device: torch.device | str) -> None:
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=device)

    def load(
        self,
        input_ids: torch.Tensor,  # [n]
        positions: torch.Tensor,  # [n]
        slot_mapping: torch.Tensor,  # [n]
        rows: int,
        pad_at_last_position: bool = False,
    ) -> None:
        """A step's n tokens into rows [0, n), rows [n, rows) padding (an earlier step's slots must go: a padding
        row stores its K/V where its slot says)."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        if rows > n:
            self.input_ids[n:rows].zero_()
            if pad_at_last_position:
                self.positions[n:rows].copy_(positions[n - 1 :].expand(rows - n))
            else:
                self.positions[n:rows].zero_()
            self.slot_mapping[n:rows].zero_()
