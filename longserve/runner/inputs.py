"""Turn a SchedulerOutput into the flat tensors one forward pass needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longserve.attention.base import AttentionMetadata, build_metadata
from longserve.outputs import SchedulerOutput


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64: rows of the hidden states that sample (last token of each)
    num_tokens: int


def prepare_inputs(out: SchedulerOutput, page_size: int, device: torch.device) -> ModelInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    prefix_lens: list[int] = []
    query_lens: list[int] = []
    page_tables: list[list[int]] = []
    logits_indices: list[int] = []
    for s in out.scheduled:
        req = s.request
        start = req.num_computed_tokens
        end = start + s.num_new_tokens
        num_prompt = req.num_prompt_tokens
        if end <= num_prompt:
            input_ids.extend(req.prompt_token_ids[start:end])
        else:
            input_ids.extend(req.token_at(p) for p in range(start, end))
        positions.extend(range(start, end))
        prefix_lens.append(start)
        query_lens.append(s.num_new_tokens)
        page_tables.append(req.page_ids)
        if s.samples:
            logits_indices.append(len(input_ids) - 1)
    meta = build_metadata(prefix_lens, query_lens, page_tables, page_size, device)
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=meta,
        logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
        num_tokens=len(input_ids),
    )
