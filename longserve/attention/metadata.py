"""The per-step metadata every attention backend reads, and how a step's host lists become its device tensors.

Token layout of one step (T new tokens, B requests, flattened, no padding):

    request:          r0          r1     r2
    new tokens:   [ q q q q | q | q q q ]        query_start_loc = [0, 4, 5, 8]
    prefix_lens:      12        30    0          tokens already in the KV pool before this step
    seq_lens:         16        31    3          prefix_lens + new tokens (the KV length attended to)

Token i of request r sits at absolute position prefix_lens[r] + (i - query_start_loc[r]) and attends
causally to KV positions [0, that position]. `slot_mapping[t]` = page_id * page_size + offset is where
the new token t's K/V are written; `page_table[r, j]` is the page id holding positions
[j*page_size, (j+1)*page_size) of request r (padded with 0 past the request's pages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from longserve.platform import to_device_async

T = TypeVar("T")


@dataclass
class AttentionMetadata:
    page_size: int
    query_start_loc: torch.Tensor  # [B+1] int32, device
    seq_lens: torch.Tensor  # [B] int32, device
    prefix_lens: torch.Tensor  # [B] int32, device
    page_table: torch.Tensor  # [B, max_pages] int32, device
    slot_mapping: torch.Tensor  # [T] int64, device
    # host copies (python lists) so reference backends need no device->host sync
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    # the requests' page ids on the host (build_step_tensors' input, kept by reference: no copy), for paths
    # that decide on the host how to read the pages; empty where the metadata was built without them
    page_rows_cpu: Sequence[Sequence[int]] = ()
    # a hybrid model's step: each request's recurrent-state slot [B] int64, device (attention/recurrent_state.py);
    # a request whose prefix_lens is 0 starts from a zero state
    state_slots: torch.Tensor | None = None
    # (request, tokens, row): request r's state after its first `tokens` new tokens of this step (a multiple of
    # the chunked kernels' 64) also goes to state row `row`, a prefix-cache checkpoint (cache/manager.py)
    state_mid_saves: Sequence[tuple[int, int, int]] = ()
    _contiguous: dict[tuple[int, int], int | None] = field(default_factory=dict, repr=False)
    _subsets: dict[tuple[int, ...], tuple[AttentionMetadata, torch.Tensor] | None] = field(
        default_factory=dict, repr=False
    )
    _per_step: dict[tuple, Any] = field(default_factory=dict, repr=False)

    @property
    def continues_every_request(self) -> bool:
        """Every request of the step has computed tokens before it (a hybrid model's one-token steps read each
        one's state: the decode kernels and graphs; a request starting afresh goes through the chunked ones)."""
        return min(self.prefix_lens_cpu, default=0) > 0

    def per_step(self, key: tuple, decide: Callable[[], T]) -> T:
        """decide() once per step and key, for the host-side decisions every layer would repeat (a backend's
        routing of the requests, its launch tiles): part of an eager layer's host time."""
        if key not in self._per_step:
            self._per_step[key] = decide()
        return self._per_step[key]

    def subset(self, requests: tuple[int, ...]) -> tuple[AttentionMetadata, torch.Tensor] | None:
        """The metadata of some of the step's requests as a batch of their own, and the device index of their
        new tokens' rows in the step ([T'] int64): one host-to-device copy, kept for the step (every layer
        asks). None when the metadata was built without the host page rows."""
        if requests not in self._subsets:
            sub = None
            if len(self.page_rows_cpu) == self.num_reqs:
                starts = np.cumsum([0, *self.query_lens_cpu])
                rows = np.concatenate([np.arange(starts[r], starts[r + 1]) for r in requests])
                meta, (index,) = build_step_tensors(
                    [self.prefix_lens_cpu[r] for r in requests], [self.query_lens_cpu[r] for r in requests],
                    [self.page_rows_cpu[r] for r in requests], self.page_size, self.slot_mapping.device,
                    extra=(rows,),
                )  # fmt: skip
                sub = (meta, index)
            self._subsets[requests] = sub
        return self._subsets[requests]

    def contiguous_pages(self, r: int, num_pages: int) -> int | None:
        """The first page id when request r's first `num_pages` pages are consecutive ids (a lone prompt's
        usually are: the pool hands out the lowest free ids first), else None. Every layer asks: the answer
        is kept for the step."""
        key = (r, num_pages)
        if key not in self._contiguous:
            first = None
            if r < len(self.page_rows_cpu) and num_pages > 0:
                rows = np.asarray(self.page_rows_cpu[r][:num_pages])
                start = int(rows[0])
                span = np.arange(start, start + num_pages)
                if int(rows[-1]) - start == num_pages - 1 and np.array_equal(rows, span):
                    first = start
            self._contiguous[key] = first
        return self._contiguous[key]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)


def build_metadata(
    prefix_lens: list[int],
    query_lens: list[int],
    page_tables: list[list[int]],
    page_size: int,
    device: torch.device | str,
) -> AttentionMetadata:
    """Build one step's metadata from host lists (pure: no cache access, no device sync).

    `page_tables[r]` lists the page ids of request r in position order and must cover its
    `prefix_lens[r] + query_lens[r]` positions. Index math runs on the CPU; results are copied to `device`.
    """
    return build_step_tensors(prefix_lens, query_lens, page_tables, page_size, device)[0]


def build_step_tensors(
    prefix_lens: list[int],
    query_lens: list[int],
    page_tables: Sequence[Sequence[int]],  # lists, or int64 arrays (runner.inputs.page_row)
    page_size: int,
    device: torch.device | str,
    extra: Sequence[Sequence[int]] = (),
) -> tuple[AttentionMetadata, list[torch.Tensor]]:
    """build_metadata, plus each `extra` list (e.g. input ids) as an int64 tensor on `device`.

    The index math runs in numpy and everything reaches the device in two copies (one int32 buffer, one
    int64 buffer, each tensor 16-byte aligned in it) rather than one per tensor: a decode step's host time
    is on the critical path."""
    num_reqs = len(prefix_lens)
    if not (len(query_lens) == len(page_tables) == num_reqs):
        raise ValueError(
            f"build_metadata: got {num_reqs} prefix_lens, {len(query_lens)} query_lens and "
            f"{len(page_tables)} page_tables; they must have one entry per request"
        )
    query_lens_np = np.asarray(query_lens, dtype=np.int64).reshape(num_reqs)  # [B]
    prefix_np = np.asarray(prefix_lens, dtype=np.int64).reshape(num_reqs)  # [B]
    seq_lens_np = prefix_np + query_lens_np  # [B]
    num_pages = np.fromiter(map(len, page_tables), dtype=np.int64, count=num_reqs)  # [B]
    short = np.flatnonzero(num_pages * page_size < seq_lens_np)
    if len(short):
        r = int(short[0])
        raise ValueError(
            f"request {r} has seq_len {seq_lens_np[r]} but only {num_pages[r]} pages of {page_size} tokens"
        )
    max_pages = int(num_pages.max()) if num_reqs else 0
    page_table = np.zeros((num_reqs, max_pages), dtype=np.int64)  # [B, max_pages]
    for r, pages in enumerate(page_tables):  # build_step's rows are int64 arrays: a copy each, no conversion
        page_table[r, : len(pages)] = pages

    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)  # [B+1]
    np.cumsum(query_lens_np, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    if num_tokens == num_reqs and (num_reqs == 0 or query_lens_np.max() == 1):  # decode: one token each
        req_idx = np.arange(num_reqs)
        positions = prefix_np
    else:
        req_idx = np.repeat(np.arange(num_reqs), query_lens_np)  # [T]
        # absolute position of each new token: prefix_len + index within its request's query
        positions = prefix_np[req_idx] + np.arange(num_tokens) - query_start_loc[:-1][req_idx]  # [T]
    slot_mapping = page_table[req_idx, positions // page_size] * page_size + positions % page_size  # [T]

    ints = [query_start_loc, seq_lens_np, prefix_np, page_table.reshape(-1)]
    longs = [slot_mapping, *(np.asarray(x, dtype=np.int64).reshape(-1) for x in extra)]
    i32 = _packed([a.astype(np.int32) for a in ints], device)
    i64 = _packed(longs, device)
    meta = AttentionMetadata(
        page_size=page_size,
        query_start_loc=i32[0],  # [B+1]
        seq_lens=i32[1],  # [B]
        prefix_lens=i32[2],  # [B]
        page_table=i32[3].view(num_reqs, max_pages),  # [B, max_pages]
        slot_mapping=i64[0],  # [T] int64
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens_np.tolist(),
        prefix_lens_cpu=list(prefix_lens),
        page_rows_cpu=page_tables,
    )
    return meta, i64[1:]


def _to_device(a: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A host array on `device`, queued without waiting for the stream (platform.to_device_async)."""
    return to_device_async(torch.from_numpy(np.ascontiguousarray(a)), device)


ALIGN_BYTES = 16  # what Triton specializes a pointer on (divisible by 16 or not): every segment starts there


def _packed(arrays: list[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """The arrays (one dtype) on `device` in one copy, each starting 16-byte aligned.

    Unpadded, a segment's alignment followed the batch (the page table of B requests started at (3B + 1)
    int32s, aligned only when B % 4 == 1), and every kernel that reads it compiled one variant per
    alignment mix as batches varied: a second or more of stalled step each time, through HTTP."""
    if not arrays:
        return []
    unit = ALIGN_BYTES // arrays[0].itemsize
    starts, end = [], 0
    for a in arrays:
        starts.append(end)
        end += -(-len(a) // unit) * unit
    flat = np.zeros(end, dtype=arrays[0].dtype)
    for a, start in zip(arrays, starts):
        flat[start : start + len(a)] = a
    dev = _to_device(flat, device)
    # slices, one view each (torch.split and a slice of each took 3x the host time: 22 against 7 us for 4 segments)
    return [dev[start : start + len(a)] for a, start in zip(arrays, starts)]
