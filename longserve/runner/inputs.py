"""Turn a SchedulerOutput into the flat tensors one forward pass needs.

Two stages: `build_step` reads the Request objects (rank 0 only) into a small picklable `StepInputs` of
plain lists, which tensor-parallel workers receive; `to_model_inputs` makes the tensors on any rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longserve.attention.base import AttentionMetadata, build_step_tensors
from longserve.outputs import SchedulerOutput
from longserve.runner.prompt_logprobs import PromptLogprobRows


@dataclass
class StepInputs:
    """One step's plain data, identical on every tp rank (page ids are global: one allocator, on rank 0)."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    prefix_lens: list[int]  # [B]
    query_lens: list[int]  # [B]
    page_tables: list[list[int]]  # [B][pages]
    logits_indices: list[int]  # [N] rows that sample (last token of each sampling request)
    prompt_logprobs: PromptLogprobRows | None = None  # rows whose prompt logprobs are asked for


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64: rows of the hidden states that sample (last token of each)
    num_tokens: int


def build_step(out: SchedulerOutput) -> StepInputs:
    step = StepInputs([], [], [], [], [], [])
    for s in out.scheduled:
        req = s.request
        start = req.num_computed_tokens
        end = start + s.num_new_tokens
        if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
            step.prompt_logprobs = step.prompt_logprobs or PromptLogprobRows()
            step.prompt_logprobs.add(req, start, end, first_row=len(step.input_ids))
        if end <= req.num_prompt_tokens:
            step.input_ids.extend(req.prompt_token_ids[start:end])
        else:
            step.input_ids.extend(req.token_at(p) for p in range(start, end))
        step.positions.extend(range(start, end))
        step.prefix_lens.append(start)
        step.query_lens.append(s.num_new_tokens)
        step.page_tables.append(list(req.page_ids))
        if s.samples:
            step.logits_indices.append(len(step.input_ids) - 1)
    return step


def split_step(step: StepInputs, at: int) -> tuple[StepInputs, StepInputs]:
    """The first `at` tokens of a step and the rest, as two steps run one after the other within each
    layer: a request cut in two continues in the second with the first part as more prefix. Neither part
    samples (the caller keeps the whole step's logits_indices)."""
    first, second = StepInputs([], [], [], [], [], []), StepInputs([], [], [], [], [], [])
    first.input_ids, second.input_ids = step.input_ids[:at], step.input_ids[at:]
    first.positions, second.positions = step.positions[:at], step.positions[at:]
    start = 0
    for prefix_len, query_len, pages in zip(step.prefix_lens, step.query_lens, step.page_tables):
        end = start + query_len
        cut = min(max(at - start, 0), query_len)  # this request's tokens in the first part
        if cut:
            first.prefix_lens.append(prefix_len)
            first.query_lens.append(cut)
            first.page_tables.append(pages)
        if query_len - cut:
            second.prefix_lens.append(prefix_len + cut)
            second.query_lens.append(query_len - cut)
            second.page_tables.append(pages)
        start = end
    return first, second


def to_model_inputs(step: StepInputs, page_size: int, device: torch.device) -> ModelInputs:
    meta, (input_ids, positions, logits_indices) = build_step_tensors(
        step.prefix_lens, step.query_lens, step.page_tables, page_size, device,
        extra=(step.input_ids, step.positions, step.logits_indices),
    )  # fmt: skip
    return ModelInputs(
        input_ids=input_ids,
        positions=positions,
        meta=meta,
        logits_indices=logits_indices,
        num_tokens=len(step.input_ids),
    )
