"""The MoE block alignment in one Triton launch: from the routed expert ids [T, k] (and the expert map of
expert parallelism) to exactly what the grouped GEMMs of kernels/moe_gemm.py read, bit for bit what the
torch reference `moe_align_ref` (kernels/moe_reference.py, about 15 small launches, 20 with an expert map)
writes.

Design (one program, one CTA, for up to MAX_PAIRS pairs; decode and short chunks):

1. Each lane loads one (token, k) pair's expert id e (through the expert map when there is one: another
   rank's expert becomes E, one extra expert after the local ones; lanes past the T*k pairs become E + 1)
   and forms the key e * BLOCK_P + pair: unique, so `tl.sort` (a bitonic network in registers and shared
   memory) orders the pairs by expert and, within an expert, by pair index (token order): the order the
   reference's stable sort gives. Deterministic by construction, no atomics.
2. A segmented inclusive scan over the sorted keys (`tl.associative_scan` on (expert << 16 | count), the
   count restarting where the expert changes) gives each pair its rank r inside its expert.
3. A pair with r % BLOCK_M == 0 opens a block; the inclusive cumsum of those flags minus one is the pair's
   block, its row is block * BLOCK_M + r % BLOCK_M. The blocks are numbered in expert order, so experts
   with no pair get no block, and an expert's run is padded up to whole blocks, as in the reference.
4. Stores: the padding id T*k into every row of sorted_token_ids, a CTA barrier, then each pair's id into
   its row (rows never clash: one pair per row); each block's expert from the pair that opened it, the
   reference's fill value (E, or E + 1 with a map) into the blocks past the end; num_tokens_post_padded =
   BLOCK_M * (blocks of local experts) (a map's remote pairs sort last: their blocks come after the length).

vLLM's CUDA `moe_align_block_size` counts per thread in shared memory and places pairs with atomics (the
order inside an expert is then whatever the atomics give); SGLang's Triton variant is four launches over a
[E + 1, E] count table. Sorting packed keys instead keeps the whole thing one launch whose register and
shared memory needs grow with T*k, not with E*E, and whose output does not depend on timing. The GEMMs do
not depend on the order anyway (each (token, k) row is computed alone and written to its own row).

Sizes: keys are int32 and the scan packs a count in 16 bits: T*k <= 8192 and E + 2 <= 8192. Larger
prefill chunks keep the torch path (their alignment is small next to their GEMMs); kernels/fused_moe.py
`align_routed_pairs` (what kernels/fused_moe.py calls) chooses by MOE_TRITON_ALIGN_MAX_PAIRS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels.launch import fast_launch, pdl_prologue, use_pdl
from longserve.kernels.moe_reference import moe_align_ref, padded_size_bound

__all__ = [
    "MAX_PAIRS",
    "MOE_TRITON_ALIGN_MAX_PAIRS",
    "align_launch_config",
    "align_routed_pairs",
    "moe_align",
]

# < 2^15 for the scan's 16-bit count; sm90 (Triton 3.9, 16 warps): 74 registers and no spill at 4096 pairs,
# 128 and a 32-byte spill at 8192 (scripts/dev/compile_moe_align.py)
MAX_PAIRS = 1 << 13
FILL_MAX = 4096  # rows per store in the padding loops

# The alignment of at most this many (token, k) pairs runs as the one-launch Triton kernel of
# this module instead of the chain of ~15 torch ops of `moe_align_ref` (both give the same tensors).
# Measured on an H200 (2026-12-02, d7b54d5, `python3 -m longserve.bench.kernels.moe --tokens 1,8,64,512
# --align both --no-torch`, CUDA-graph replay): the Triton alignment wins at every size, e.g. Qwen3-30B-A3B at
# 1 token 0.0019 against 0.044 ms (the whole MoE block 0.036 against 0.085 ms), at 512 tokens 0.047 against
# 0.084 ms; Mixtral at 512 tokens 0.010 against 0.078 ms. So it serves up to its own limit (MAX_PAIRS).
MOE_TRITON_ALIGN_MAX_PAIRS = MAX_PAIRS


@triton.jit
def _run_count(a, b):
    """Segmented add of packed (expert << 16 | count): b's count grows by a's while the expert is the same.
    Associative on sorted experts (a run is contiguous: if a's expert equals b's, every element between
    them has it too)."""
    return tl.where((a >> 16) == (b >> 16), b + (a & 0xFFFF), b)


@fast_launch
@triton.jit
def _moe_align_kernel(
    topk_ids_ptr,  # [P] int32/int64 expert ids (global ones with HAS_MAP)
    expert_map_ptr,  # [E_global] int32: global id -> local expert, or -1 (HAS_MAP; else unread)
    sorted_ids_ptr,  # [num_rows] int32 out
    expert_ids_ptr,  # [num_rows / BLOCK_M] int32 out
    num_post_ptr,  # [1] int32 out
    num_pairs,  # P = T*k
    num_rows,  # S: padded_size_bound(P, E (+1 with a map), BLOCK_M)
    num_experts,  # E: local experts (rows of w13/w2)
    HAS_MAP: tl.constexpr,
    BLOCK_P: tl.constexpr,  # power of two >= P
    BLOCK_M: tl.constexpr,
    FILL: tl.constexpr,  # rows per padding store (power of two)
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    pdl_prologue(USE_PDL)
    offs = tl.arange(0, BLOCK_P)
    valid = offs < num_pairs
    expert = tl.load(topk_ids_ptr + offs, mask=valid, other=0).to(tl.int32)  # [BLOCK_P]
    if HAS_MAP:
        expert = tl.load(expert_map_ptr + expert, mask=valid, other=0).to(tl.int32)
        expert = tl.where(expert < 0, num_experts, expert)  # another rank's expert: E, aligned after ours
    expert = tl.where(valid, expert, num_experts + 1)  # lanes past the pairs sort after every real one
    key = tl.sort(expert * BLOCK_P + offs)  # [BLOCK_P] by expert, then by pair index (token order)
    s_expert = key // BLOCK_P
    s_pair = key % BLOCK_P
    real = s_expert <= num_experts  # a routed pair (E with a map: remote, still laid out)
    run = tl.associative_scan((s_expert << 16) | 1, 0, _run_count)  # [BLOCK_P] packed
    rank = (run & 0xFFFF) - 1  # position of the pair inside its expert
    opens = real & (rank % BLOCK_M == 0)  # the first pair of each block
    block = tl.cumsum(opens.to(tl.int32), 0) - 1  # [BLOCK_P] the pair's block, in expert order
    row = block * BLOCK_M + rank % BLOCK_M
    num_blocks = tl.sum(opens.to(tl.int32), 0)  # every block laid out (remote ones too)
    if HAS_MAP:
        num_local = tl.sum((opens & (s_expert < num_experts)).to(tl.int32), 0)
        fill_expert = num_experts + 1
    else:
        num_local = num_blocks
        fill_expert = num_experts

    pad = tl.full([FILL], 0, tl.int32) + num_pairs
    for start in range(0, num_rows, FILL):  # the padding id everywhere first ...
        rows = start + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + rows, pad, mask=rows < num_rows)
    tl.debug_barrier()  # ... (bar.sync: the CTA's global stores above are visible and ordered) ...
    tl.store(sorted_ids_ptr + row, s_pair, mask=real)  # ... then every pair into its own row
    tl.store(expert_ids_ptr + block, s_expert, mask=opens)
    fill = tl.full([FILL], 0, tl.int32) + fill_expert
    num_block_rows = num_rows // BLOCK_M
    for start in range(0, num_block_rows, FILL):  # blocks past the end: disjoint from the stores above
        blocks = start + tl.arange(0, FILL)
        tl.store(expert_ids_ptr + blocks, fill, mask=(blocks >= num_blocks) & (blocks < num_block_rows))
    tl.store(num_post_ptr, num_local * BLOCK_M)


def align_launch_config(num_pairs: int, num_rows: int) -> dict[str, int]:
    """BLOCK_P, FILL and num_warps for `num_pairs` pairs: one warp up to 256 pairs (the sort stays in
    registers and shuffles), then a warp more per 256 pairs up to 16 (4096 pairs and beyond); the padding
    stores at most 16 rows per thread at a time."""
    block_p = max(16, triton.next_power_of_2(num_pairs))
    num_warps = max(1, min(16, block_p // 256))
    fill = min(FILL_MAX, 512 * num_warps, max(32, triton.next_power_of_2(num_rows)))  # <= 16 rows a thread
    return {"BLOCK_P": block_p, "FILL": fill, "num_warps": num_warps}


def moe_align(
    topk_ids: torch.Tensor,  # [T, k] int expert ids (global ones with expert_map)
    num_experts: int,  # experts this rank holds (rows of w13/w2)
    block_m: int,
    expert_map: torch.Tensor | None = None,  # [E_global] int32: global id -> local row, or -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align_ref` in one launch: (sorted_token_ids [S], expert_ids [S / block_m],
    num_tokens_post_padded [1]), int32, equal to the reference's element for element. No host sync."""
    num_pairs = topk_ids.numel()
    if not 0 < num_pairs <= MAX_PAIRS or num_experts + 2 > MAX_PAIRS:
        raise ValueError(f"moe_align: {num_pairs} pairs, {num_experts} experts (at most {MAX_PAIRS} each)")
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    dev = flat.device
    num_rows = padded_size_bound(num_pairs, num_experts + (expert_map is not None), block_m)
    sorted_ids = torch.empty(num_rows, dtype=torch.int32, device=dev)  # [S]
    expert_ids = torch.empty(num_rows // block_m, dtype=torch.int32, device=dev)  # [S / block_m]
    num_post = torch.empty(1, dtype=torch.int32, device=dev)  # [1]
    emap = flat if expert_map is None else expert_map
    cfg = align_launch_config(num_pairs, num_rows)
    pdl = use_pdl(flat)
    _moe_align_kernel[(1,)](
        flat, emap, sorted_ids, expert_ids, num_post, num_pairs, num_rows, num_experts,
        HAS_MAP=expert_map is not None, BLOCK_P=cfg["BLOCK_P"], BLOCK_M=block_m, FILL=cfg["FILL"],
        USE_PDL=pdl, num_warps=cfg["num_warps"], launch_pdl=pdl,
    )  # fmt: skip
    return sorted_ids, expert_ids, num_post


def align_routed_pairs(
    topk_ids: torch.Tensor,  # [T, k] int
    num_experts: int,  # rows of w13/w2 (this rank's experts)
    block_m: int,
    expert_map: torch.Tensor | None = None,  # [E_global] int32: global expert id -> local row, or -1
    triton_max_pairs: int | None = None,  # default: MOE_TRITON_ALIGN_MAX_PAIRS (read at call time)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids [S], expert_ids [S / block_m], num_tokens_post_padded [1]) as `moe_align_ref`
    defines them: the Triton kernel for up to `triton_max_pairs` pairs, the torch ops beyond."""
    limit = MOE_TRITON_ALIGN_MAX_PAIRS if triton_max_pairs is None else triton_max_pairs
    if 0 < topk_ids.numel() <= min(limit, MAX_PAIRS):
        return moe_align(topk_ids, num_experts, block_m, expert_map)
    return moe_align_ref(topk_ids, num_experts, block_m, expert_map)
