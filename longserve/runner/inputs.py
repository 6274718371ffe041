"""Turn a SchedulerOutput into the flat tensors one forward pass needs.

Two stages: `build_step` reads the Request objects (rank 0 only) into a small picklable `StepInputs` of
plain lists, which tensor-parallel workers receive; `to_model_inputs` makes the tensors on any rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from longserve.attention.metadata import AttentionMetadata, build_step_tensors
from longserve.outputs import SchedulerOutput
from longserve.request import Request
from longserve.runner.prompt_logprobs import PromptLogprobRows


@dataclass
class StepInputs:
    """One step's plain data, identical on every tp rank (page ids are global: one allocator, on rank 0)."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    prefix_lens: list[int]  # [B]
    query_lens: list[int]  # [B]
    page_tables: list[np.ndarray] | list[list[int]]  # [B][pages]: build_step's are int64 arrays
    logits_indices: list[int]  # [N] rows that sample (last token of each sampling request)
    prompt_logprobs: PromptLogprobRows | None = None  # rows whose prompt logprobs are asked for
    # inputs whose token is still pending (the overlapped schedule): input_ids[pending_dst[j]] (a 0 here)
    # is the previous step's sampled id of row pending_src[j], gathered on the device
    pending_dst: list[int] = field(default_factory=list)
    pending_src: list[int] = field(default_factory=list)
    num_prev_rows: int = 0  # the previous step's sampled ids (what ranks other than 0 receive them into)
    # [B] a hybrid model's recurrent-state slots (attention/recurrent_state.py), else []
    state_slots: list[int] = field(default_factory=list)
    # (from, to) state rows copied before the forward pass (a prefix hit's checkpoint into its slot) and after
    # it (a slot into a checkpoint: cache/state_radix_tree.py)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # (request, tokens, row): a state saved inside the step, after the request's first `tokens` new tokens
    # (AttentionMetadata.state_mid_saves)
    state_mid_saves: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64: rows of the hidden states that sample (last token of each)
    num_tokens: int


class PageRow:
    """A request's page ids as an int64 array that follows `req.page_ids` across steps by taking only the
    pages appended since the last step, rather than converting the whole list every step (a 4K context is
    256 pages: at batch 64, build_step + build_step_tensors took 1.6 ms cumulative under cProfile, 0.4 ms
    with rows; scripts/dev/host_time.py on the CI CPU).

    The list only grows while it is the same object (the KV manager assigns a new one when it attaches a
    prefix or releases the pages), except that `cache_computed` may swap entries for the prefix cache's
    copies in a step that computed prompt tokens; so a row taken in such a step is rebuilt next time, and
    one taken in a step past the prompt (`settled`) is only extended from then on."""

    __slots__ = ("source", "array", "length", "settled")

    def __init__(self, pages: list[int], settled: bool) -> None:
        self.source = pages  # held, so that an `is` test cannot match a new list at a reused address
        self.array = np.array(pages, dtype=np.int64)
        self.length = len(pages)
        self.settled = settled

    def sync(self, pages: list[int]) -> np.ndarray:
        n = len(pages)
        if n > self.length:
            if n > len(self.array):
                grown = np.empty(max(n, 2 * len(self.array)), dtype=np.int64)
                grown[: self.length] = self.array[: self.length]
                self.array = grown
            self.array[self.length : n] = pages[self.length : n]
            self.length = n
        return self.array[:n]


def page_row(req: Request, settled: bool) -> np.ndarray:
    """req.page_ids as an int64 array (a view: valid until the request's next step)."""
    pages, row = req.page_ids, req.page_row
    if row is None or row.source is not pages or not row.settled or len(pages) < row.length:
        row = req.page_row = PageRow(pages, settled)
        return row.array
    return row.sync(pages)


def build_step(out: SchedulerOutput) -> StepInputs:
    step = StepInputs([], [], [], [], [], [])
    input_ids, positions, logits_indices = step.input_ids, step.positions, step.logits_indices
    for s in out.scheduled:
        req, n = s.request, s.num_new_tokens
        start = req.num_computed_tokens
        end = start + n
        num_prompt = len(req.prompt_token_ids)
        if req.sampling_params.prompt_logprobs is not None and start < num_prompt - 1:
            step.prompt_logprobs = step.prompt_logprobs or PromptLogprobRows()
            step.prompt_logprobs.add(req, start, end, first_row=len(input_ids))
        if n == 1:  # a decode
            if start < num_prompt + len(req.output_token_ids):
                input_ids.append(req.token_at(start))
            else:  # its token is the previous step's, not read yet: taken on the device
                step.pending_dst.append(len(input_ids))
                step.pending_src.append(req.pending_row)
                input_ids.append(0)
            positions.append(start)
        else:
            input_ids.extend(req.token_slice(start, end))
            positions.extend(range(start, end))
        step.prefix_lens.append(start)
        step.query_lens.append(n)
        step.page_tables.append(page_row(req, settled=end > num_prompt))
        if req.state_slot is not None:
            step.state_slots.append(req.state_slot)
            if req.state_restore is not None:
                step.state_copies.append((req.state_restore, req.state_slot))
            if s.state_save is not None and s.state_save_at is not None:
                step.state_mid_saves.append((len(step.query_lens) - 1, s.state_save_at, s.state_save))
            elif s.state_save is not None:
                step.state_saves.append((req.state_slot, s.state_save))
        if s.samples:
            logits_indices.append(len(input_ids) - 1)
    return step


def split_step(step: StepInputs, at: int) -> tuple[StepInputs, StepInputs]:
    """The first `at` tokens of a step and the rest, as two steps run one after the other within each
    layer: a request cut in two continues in the second with the first part as more prefix. Neither part
    samples (the caller keeps the whole step's logits_indices). Not for a step that saves a state inside itself
    (its chunk boundaries would move)."""
    assert not step.state_mid_saves, "split_step of a step with states saved inside it"
    first, second = StepInputs([], [], [], [], [], []), StepInputs([], [], [], [], [], [])
    first.input_ids, second.input_ids = step.input_ids[:at], step.input_ids[at:]
    first.positions, second.positions = step.positions[:at], step.positions[at:]
    start = 0
    slots = step.state_slots or [None] * len(step.query_lens)
    for prefix_len, query_len, pages, slot in zip(step.prefix_lens, step.query_lens, step.page_tables, slots):
        end = start + query_len
        cut = min(max(at - start, 0), query_len)  # this request's tokens in the first part
        for part, prefix, n in ((first, prefix_len, cut), (second, prefix_len + cut, query_len - cut)):
            if n:
                part.prefix_lens.append(prefix)
                part.query_lens.append(n)
                part.page_tables.append(pages)
                if slot is not None:  # the second part continues from the state the first leaves
                    part.state_slots.append(slot)
        start = end
    return first, second


def to_model_inputs(
    step: StepInputs, page_size: int, device: torch.device, prev_tokens: torch.Tensor | None = None
) -> ModelInputs:
    """The step's tensors on `device`; its pending inputs gathered from prev_tokens (the previous step's
    sampled ids, still on the device) without waiting for them."""
    meta, (input_ids, positions, logits_indices, dst, src, *slots) = build_step_tensors(
        step.prefix_lens, step.query_lens, step.page_tables, page_size, device,
        extra=(step.input_ids, step.positions, step.logits_indices, step.pending_dst, step.pending_src)
        + ((step.state_slots,) if step.state_slots else ()),
    )  # fmt: skip
    if slots:
        meta.state_slots = slots[0]  # [B]
        meta.state_mid_saves = step.state_mid_saves
    if step.pending_dst:
        assert prev_tokens is not None, "a step with pending inputs needs the previous step's sampled ids"
        input_ids[dst] = prev_tokens[src]
    return ModelInputs(
        input_ids=input_ids,
        positions=positions,
        meta=meta,
        logits_indices=logits_indices,
        num_tokens=len(step.input_ids),
    )
