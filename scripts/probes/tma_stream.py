"""GPU probe: how fast TMA streams weights from HBM by the shape of its boxes. The int4 mma GEMV's ring
(kernels/int4_mma_gemv.py) asks for [64 rows x 64 B] a box at one row: 64 bytes of each of 64 weight rows 2 KB apart
(the 8B gate_up's K / 2), the next 64 bytes of the same rows a step later. By it the 8B gate_up takes 24.3 us against
14 us of bytes at 4.2 TB/s, where the FP8 GEMV's [128 rows x 128 B] boxes take gate_up's 117 MB in 32.9 us (3.6 TB/s;
RESULTS.md twenty-fifth and twenty-eighth sessions). HBM's rows are ~2 KB: few bytes of many rows at a time may
leave its row buffers mostly unused. This streams 256 MB of rows of 2 KB through a ring of boxes of each shape (each
program one run of rows over all of K, as the GEMV's programs), and boxes of the same bytes laid out one after
another (tiles repacked contiguous, as Marlin packs its weights), and prints GB/s beside a device copy's.

    python3 scripts/probes/tma_stream.py            # on the GPU: one JSON line a variant

Each program reads its tiles back from shared memory (16 bytes a lane, XOR-ed into registers, one sum stored), so
the stream is consumed as the GEMV consumes it.
"""

from __future__ import annotations

import json

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from longserve.kernels.gluon_compat import barrier, tma_load
from longserve.platform import cuda_time_ms

ROW_WORDS = 512  # 2 KB rows: the 8B gate_up's packed int4 rows (K = 4096)
ROWS = 131072  # 256 MB: past L2 (50 MB) many times
# (rows, words) a box; contiguous: the same bytes a tile, tiles one after another
VARIANTS = [(64, 16, False), (128, 16, False), (32, 32, False), (64, 32, False), (16, 64, False), (32, 64, False),
            (8, 128, False), (64, 16, True), (128, 16, True), (64, 32, True)]  # fmt: skip
STAGES = (2, 4)
WARPS = 4


@gluon.jit
def stream_kernel(desc, out_ptr, n_tiles_k, STAGES: gl.constexpr, CONTIG: gl.constexpr):
    R: gl.constexpr = desc.block_type.shape[0]
    C: gl.constexpr = desc.block_type.shape[1]
    TC: gl.constexpr = C // 4 if C // 4 < 32 else 32  # lanes along a row, 16 bytes each
    L: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TC, TC], [gl.num_warps(), 1], [1, 0])
    pid = gl.program_id(0)
    ring = gl.allocate_shared_memory(gl.int32, [STAGES, R, C], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.expect(ready.index(i), desc.block_type.nbytes)
        if CONTIG:  # tile (pid, t) at rows (pid n_tiles_k + t) R of the repacked view
            tma_load(desc, [(pid * n_tiles_k + i) * R, 0], ready.index(i), ring.index(i))
        else:
            tma_load(desc, [pid * R, i * C], ready.index(i), ring.index(i))
    acc = gl.zeros([R, C], gl.int32, L)
    for t in range(n_tiles_k):
        slot = t % STAGES
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        acc = acc ^ ring.index(slot).load(L)
        barrier()  # every warp past the slot before it is refilled
        if t + STAGES < n_tiles_k:
            mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
            if CONTIG:
                tma_load(desc, [(pid * n_tiles_k + t + STAGES) * R, 0], ready.index(slot), ring.index(slot))
            else:
                tma_load(desc, [pid * R, (t + STAGES) * C], ready.index(slot), ring.index(slot))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    gl.store(out_ptr + pid, gl.sum(gl.sum(acc, axis=1), axis=0))


def descriptor(buf: torch.Tensor, rows: int, words: int, contig: bool) -> TensorDescriptor:
    view = buf.view(-1, words) if contig else buf
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor(view, list(view.shape), list(view.stride()), [rows, words], layout)


def main() -> None:
    buf = torch.randint(-(2**31), 2**31 - 1, (ROWS, ROW_WORDS), dtype=torch.int32, device="cuda")
    nbytes = buf.numel() * 4
    copy = torch.empty_like(buf)
    ms = cuda_time_ms(lambda: copy.copy_(buf), warmup=2, iters=3, repeats=5)
    print(json.dumps({"variant": "device copy (read + write)", "ms": round(ms, 3),
                      "GB/s": round(2 * nbytes / ms / 1e6)}), flush=True)  # fmt: skip
    for rows, words, contig in VARIANTS:
        for stages in STAGES:
            n_tiles_k = ROW_WORDS // words
            programs = ROWS // rows
            desc = descriptor(buf, rows, words, contig)
            out = torch.empty(programs, dtype=torch.int32, device="cuda")
            run = lambda d=desc, o=out, n=n_tiles_k, s=stages, c=contig, p=programs: stream_kernel[(p,)](  # noqa: E731
                d, o, n, STAGES=s, CONTIG=c, num_warps=WARPS
            )
            ms = cuda_time_ms(run, warmup=2, iters=3, repeats=5)
            print(json.dumps({"box": f"{rows} x {words * 4} B", "contiguous": contig, "stages": stages,
                              "ms": round(ms, 3), "GB/s": round(nbytes / ms / 1e6)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
