"""The split-K outputs of the decode GEMVs (quant_gemv.py, int4_gemv.py, fp8_gemv.py, int4_mma_gemv.py,
fp8_wgmma_gemv.py, dense_gemm.py) and their sums: how many splits a GEMV takes (`splits_for`), the buffers it writes
(`split_k_outputs`: the output itself with one split, else fp32 partials [splits, M, N] summed after the launch by
`splitk_reduce` or, SPLIT_K_SERIAL_REDUCE, by the kernel's last program of each column tile into a result with a
counter a tile: quant_tiles.store_gemv_out, gluon_gemv.store_sums). Deterministic either way: the partials are added
in split order, no atomics on the values."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from longserve.kernels.extend_attention import interpreting
from longserve.kernels.launch import pdl_prologue, use_pdl, zeroed_counters
from longserve.kernels.quant_tiles import rounded

__all__ = [
    "SERIAL_REDUCE_MAX_ROWS",
    "SPLIT_K_SERIAL_REDUCE",
    "SplitKOutputs",
    "num_sms",
    "split_k_output",
    "split_k_outputs",
    "splitk_reduce",
    "splits_for",
]

# A split-K decode GEMV (quant_gemv.py's, int4_gemv.py's, fp8_gemv.py's, the Gluon ones) sums its partials in the
# program that finishes each column tile last (quant_tiles.store_gemv_out: a counter per tile), instead of a
# splitk_reduce launch after it: the 8B batch-1 decode runs four such launches a layer in FP8 and int4 (128 a
# step), each a kernel's ramp and drain of ~2-3 us for 10-230 KB of partials. Bit-equal to the two-launch path
# (tests/unit/test_quant_gemv.py). Measured on an H200 (2026-12-03, `queue.sh serial-reduce`, GPU tests passed):
# the 8B decode at batch 1 (32K) FP8 blocks 4.38 -> 4.28 ms, GPTQ int4 4.35 -> 4.15 ms. At 64 rows the last program
# of a tile sums every row's partials alone: the 8B int4 decode at batch 64 (4K) 16.53 ms with the reduction
# launch, 18.24 ms serial (FP8 12.38 / 12.40; batch 1 4.35 -> 4.13 and 4.36 -> 4.25 in the same call, RESULTS.md
# nineteenth session), so serial only up to SERIAL_REDUCE_MAX_ROWS rows (8: between the two measured points).
SPLIT_K_SERIAL_REDUCE = True
SERIAL_REDUCE_MAX_ROWS = 8
SERIAL_LOCKS = 1 << 16  # counters per device (column tiles of one GEMV); a GEMV with more reduces apart
_SERIAL_LOCKS: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _splitk_reduce_kernel(
    part_ptr, b_ptr, out_ptr, N, num_splits, stride_ps, stride_pm, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, INTERPRET_BF16: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """out[m, n] = sum over the splits in order (+ bias), rounded once to out's dtype."""
    pdl_prologue(USE_PDL)
    m, pid = tl.program_id(0), tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, num_splits):  # in order: deterministic
        acc += tl.load(part_ptr + s * stride_ps + m * stride_pm + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + m * stride_om + offs, rounded(acc, out_ty, INTERPRET_BF16).to(out_ty), mask=mask)


@functools.cache
def num_sms(device_index: int) -> int:
    """The CUDA device's SM count (read once): what the split counts fill. Callers read it as split_k.num_sms, so a
    test fakes one GPU's count in one place."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def splits_for(device: torch.device, n_blocks: int, num_tiles: int) -> int:
    """SPLIT_K of a GEMV over n_blocks row blocks and num_tiles K tiles: ~8 programs per SM, each with at
    least 2 tiles, at most 32 splits (N = 4096 in blocks of 64: 16 splits on an H200); 1 off the GPU."""
    if device.type != "cuda":
        return 1
    return max(1, min(triton.cdiv(8 * num_sms(device.index or 0), n_blocks), num_tiles // 2, 32))


def split_k_output(
    num_tiles: int, split_k: int, m: int, n: int, dtype: torch.dtype, device: torch.device
) -> tuple[int, int, torch.Tensor]:
    """(tiles per split, splits, output) of a split-K GEMV over num_tiles K tiles asking for split_k splits: no
    split left empty; the output [M, N] in dtype, or with several splits their fp32 partials [splits, M, N]
    (store_gemv_out writes them, splitk_reduce adds them)."""
    tiles_per_split = triton.cdiv(num_tiles, max(1, min(split_k, num_tiles)))
    splits = triton.cdiv(num_tiles, tiles_per_split)
    if splits > 1:
        return tiles_per_split, splits, torch.empty(splits, m, n, dtype=torch.float32, device=device)
    return tiles_per_split, splits, torch.empty(m, n, dtype=dtype, device=device)


@dataclass
class SplitKOutputs:
    """What a split-K GEMV kernel writes (its out_ptr, res_ptr and lock_ptr: quant_tiles.store_gemv_out) and how
    its result is had: the output itself with one split, else the fp32 partials summed by splitk_reduce after
    the launch or (SPLIT_K_SERIAL_REDUCE) by the kernel's last program of each tile into `res`."""

    tiles_per_split: int
    splits: int
    out: torch.Tensor  # [M, N] in the output dtype, or with several splits their fp32 partials [splits, M, N]
    res: torch.Tensor | None = None  # serial: [M, N] in the output dtype
    locks: torch.Tensor | None = None  # serial: the device's int32 counters, zero between launches

    @property
    def partial(self) -> bool:
        return self.splits > 1

    @property
    def serial(self) -> bool:
        return self.res is not None

    @property
    def stride_os(self) -> int:
        """The partials' split stride (0 with one split)."""
        return self.out.stride(0) if self.partial else 0

    def pointers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """out_ptr, res_ptr, lock_ptr (out stands in for those not written)."""
        return self.out, self.res if self.serial else self.out, self.locks if self.serial else self.out

    @property
    def summed_in_kernel(self) -> bool:
        """Whether the kernel itself leaves the final sums: with one split, or summing its own partials (no
        splitk_reduce launch after it)."""
        return not self.partial or self.serial

    def bias_in_kernel(self, bias: torch.Tensor | None) -> bool:
        """Whether the kernel adds the bias (HAS_BIAS): where it leaves the final sums."""
        return bias is not None and self.summed_in_kernel

    def result(self, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The product [M, N] in dtype once the kernel was launched."""
        if self.serial:
            return self.res
        return splitk_reduce(self.out, bias, dtype) if self.partial else self.out


def split_k_outputs(
    num_tiles: int, split_k: int, m: int, n: int, n_tiles: int, dtype: torch.dtype, device: torch.device
) -> SplitKOutputs:
    """split_k_output's buffers for a GEMV over n_tiles column tiles, with the serial reduction's result and
    counters (launch.zeroed_counters: one set for every GEMV of the device) when SPLIT_K_SERIAL_REDUCE is on, it
    splits, it has at most SERIAL_REDUCE_MAX_ROWS rows, and the counters cover its tiles."""
    tiles_per_split, splits, out = split_k_output(num_tiles, split_k, m, n, dtype, device)
    if splits == 1 or not SPLIT_K_SERIAL_REDUCE or m > SERIAL_REDUCE_MAX_ROWS or n_tiles > SERIAL_LOCKS:
        return SplitKOutputs(tiles_per_split, splits, out)
    locks = zeroed_counters(_SERIAL_LOCKS, SERIAL_LOCKS, device)
    return SplitKOutputs(tiles_per_split, splits, out, torch.empty(m, n, dtype=dtype, device=device), locks)


def splitk_reduce(partials: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """[splits, M, N] float32 partial sums -> [M, N] in dtype: summed in split order (+ bias), rounded once."""
    num_splits, m, n = partials.shape
    res = torch.empty(m, n, dtype=dtype, device=partials.device)
    block = 1024 if n >= 1024 else triton.next_power_of_2(n)
    pdl = use_pdl(partials)
    _splitk_reduce_kernel[(m, triton.cdiv(n, block))](
        partials, bias if bias is not None else partials, res, n, num_splits, partials.stride(0),
        partials.stride(1), res.stride(0), HAS_BIAS=bias is not None, BLOCK=block,
        INTERPRET_BF16=interpreting() and dtype == torch.bfloat16, USE_PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    return res
