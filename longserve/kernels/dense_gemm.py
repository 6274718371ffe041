"""A 16-bit GEMM for a few dozen rows ([M <= 128, K] x [N, K]^T) on the tensor cores, in Triton: the decode step's
unquantized linears at batch 16-128, where the weights' bytes, not the FLOPs, set the time.

Each program streams one BLOCK_N-row slice of the weight over its share of K (split-K when the slices alone are
too few to fill the chip) through tl.dot, which Triton software-pipelines (num_stages tiles in flight:
cp.async / TMA), the activations' [BLOCK_M, BLOCK_K] tile beside it. Several splits write fp32 partials that
quant_gemv's split-K machinery sums in split order (a splitk_reduce launch, or the last program of each tile
with SPLIT_K_SERIAL_REDUCE). Reference: `F.linear` (fp32 accumulation, rounded once).

Why: at batch 64 (4K contexts) the Llama-3.1-8B decode step's GEMMs read the 15 GB of weights in 4.37 ms
through cuBLAS (3.4 TB/s of the ~4.2 measured; RESULTS.md, `5c2b5be` profile), the step 13.1 ms against
vLLM's 13.4 where issue 19 asks 0.95x. Measured on an H200 (2026-12-03, `gpu_check.sh dense-gemm`, RESULTS.md
thirteenth session) it lost: per projection cuBLAS was as fast or faster with the default tiles (the best tiles
of a sweep gained a few percent on gate_up, down and lm_head at 64 rows), and the 8B decode went 8.87 -> 9.02 ms
at batch 16, 13.10 -> 13.69 ms at batch 64. So off (DENSE_GEMM_TRITON_MAX_TOKENS = 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels import split_k
from longserve.kernels.activation import silu_mul_rounded
from longserve.kernels.extend_attention import interpreting
from longserve.kernels.gemv_tables import tuned_gemv_config
from longserve.kernels.launch import pdl_prologue, use_pdl
from longserve.kernels.quant_tiles import store_gemv_out
from longserve.kernels.split_k import split_k_outputs

__all__ = [
    "DENSE_GEMM_GATED_MAX_TOKENS",
    "DENSE_GEMM_TABLES",
    "DENSE_GEMM_TRITON_MAX_TOKENS",
    "DENSE_GEMM_TRITON_MIN_TOKENS",
    "dense_gemm",
    "dense_gemm_config",
    "dense_gemm_plan",
    "table_rows",
    "tuned_dense_config",
]

# Token counts whose unquantized linears (models/linear_method.py) take this kernel instead of cuBLAS on CUDA:
# none (slower than cuBLAS in the 8B decode on an H200: the module docstring).
DENSE_GEMM_TRITON_MIN_TOKENS = 16
DENSE_GEMM_TRITON_MAX_TOKENS = 0
# Decode-sized products (1 to DENSE_GEMM_MAX_BLOCK_M rows) whose shape has an entry in this GPU's tuned table
# (gemv_tables, kernel "dense_gemm": `python -m longserve.kernels.tune_gemv --kernels dense`, which times this
# kernel's tiles against cuBLAS and writes an entry only where one beats it by 3%) take this kernel with those
# tiles, an MLP's down projection with silu(gate) * up made on its loads (GATED). Why a table: cuBLAS's GEMV tile
# of 64 columns gives a narrow weight few programs (the seed's Qwen3.5-35B-A3B: its router, 256 outputs, 4; its
# 2,048-wide output projections 32 of an H100's 132 SMs); whether splitting K wins depends on the shape. Off:
# what the tuner's isolated timings promise, the engine does not deliver. On an H100 (fiftieth session,
# `gpu_check.sh dense-tables{,-8b}`, RESULTS.md), the tuner found the seed's output projections 11.1 -> 9.3 us at one
# row, its router 5.2 -> 4.1, its stacked MoE inputs at 8 rows 12.2 -> 5.7, the 8B's o 16.1 -> 14.5 and down 42.9
# -> 41.3; with those tables the seed's decode b1@32K went 3.50 -> 3.64 ms (b8@8K 5.44 -> 5.31, b64@4K even) and the
# 8B's b1@32K 7.43 -> 8.43 ms, b16@8K 11.64 -> 12.82, b64@4K 17.36 -> 18.47. In the step the tables also sent the
# down projections there gated (from gate|up), a variant the tuner had not timed, and the gated down projection
# had lost alone in the forty-first session (b1 7.38 -> 7.97 ms): now it reads a table of its own ("dense_gemm_gated",
# `--kernels dense_gated`, timed against silu_and_mul + cuBLAS), not yet measured. No table is shipped.
DENSE_GEMM_TABLES = False
# Decode batches up to this many rows run an unquantized MLP's down projection here with silu(gate) * up made on
# its loads (GATED), instead of cuBLAS after silu_and_mul's launch: one launch and the gap before it a layer (~2.6
# us between graph kernels on an H100, RESULTS.md thirty-fourth session's hit profile: ~0.9 ms over ~350 kernels),
# the bf16 8B's decode b1@32K 7.70 ms against vLLM's 8.03 where issue 19 asks 7.63; it pays only if this kernel
# reads the 117 MB down weight about as fast as cuBLAS. It does not: off (0). `gpu_check.sh dense-gated` on an H100
# (RESULTS.md forty-first session, off / on twice, the same in both): b1@32K 7.38 / 7.97 ms, b16@8K 11.63 / 12.25,
# b64@4K 17.35 / 19.10 (the skinny GEMM's slower read of the weight costs more than the launch saves).
DENSE_GEMM_GATED_MAX_TOKENS = 0
DENSE_GEMM_MAX_BLOCK_M = 128


@triton.jit
def _dense_gemm_kernel(
    x_ptr,  # [M, K] 16-bit (fp32 under the interpreter's exact path)
    w_ptr,  # [N, K]
    b_ptr,  # [N] bias (HAS_BIAS: with one split, or SERIAL)
    out_ptr,  # [M, N] in x's dtype, or (PARTIAL) [splits, M, N] float32 partial sums
    res_ptr,  # SERIAL: [M, N] in x's dtype, the partials' sum (quant_tiles.store_gemv_out)
    lock_ptr,  # SERIAL: int32 counters, one per column tile, zero
    M, N, K, tiles_per_split, num_tiles,
    stride_xm, stride_wn, stride_om, stride_os,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET_BF16: tl.constexpr,
    USE_PDL: tl.constexpr, SERIAL: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """Grid (column tiles, splits): out[:, tile] = x[:, k range] . w[tile, k range]^T in fp32. GATED: x_ptr is an
    MLP's gate|up [M, 2K] and the input silu(gate) * up, made as each tile is loaded (activation.silu_and_mul's
    rounding, so the product equals silu_and_mul's then this kernel's bit for bit)."""
    pdl_prologue(USE_PDL)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    rows_n = tl.where(n_mask, offs_n, 0)  # a ragged last tile reads row 0 again; never stored
    x_rows = x_ptr + tl.where(m_mask, offs_m, 0)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_rows = w_ptr + rows_n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    for t in range(t_begin, t_end):
        cols = t * BLOCK_K + offs_k  # [BLOCK_K]
        if EVEN_K:
            if GATED:  # the mask is all true here; silu_mul_rounded's loads take one
                x = silu_mul_rounded(x_rows, cols[None, :], (cols < K)[None, :], K, w_ptr.dtype.element_ty)
                x = x.to(w_ptr.dtype.element_ty)
            else:
                x = tl.load(x_rows + cols[None, :])  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_rows + cols[None, :])  # [BLOCK_N, BLOCK_K]
        else:
            k_ok = cols < K
            if GATED:
                x = silu_mul_rounded(x_rows, cols[None, :], k_ok[None, :], K, w_ptr.dtype.element_ty)
                x = x.to(w_ptr.dtype.element_ty)
            else:
                x = tl.load(x_rows + cols[None, :], mask=k_ok[None, :], other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=k_ok[None, :], other=0.0)
        if INTERPRET_BF16:  # the interpreter's 16-bit dot is not exact: the products in fp32 (exact for bf16)
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    out_off = offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    store_gemv_out(out_ptr, acc, out_off, out_mask, b_ptr, offs_n[None, :], n_mask[None, :], pid_k, stride_os,
                   res_ptr, lock_ptr, HAS_BIAS, PARTIAL, INTERPRET_BF16, SERIAL)  # fmt: skip


def table_rows(m: int) -> int:
    """The row count whose table entry serves a product of m rows: the next power of two (the tuner times 1, 2,
    4, ..., 128; the engine's decode graphs run bucketed batch sizes, 12, 24, 48, ..., between them, whose
    BLOCK_M is the next power of two's)."""
    return triton.next_power_of_2(m)


def tuned_dense_config(
    m: int, n: int, k: int, device: torch.device, gated: bool = False
) -> dict[str, int] | None:
    """This GPU's table's tiles for [m, k] x [n, k]^T (gated: a down projection from gate|up, whose own table,
    "dense_gemm_gated", was timed against silu_and_mul then cuBLAS), or None (tables off, none for this GPU or
    this shape, no CUDA device, the interpreter)."""
    if not DENSE_GEMM_TABLES or not 1 <= m <= DENSE_GEMM_MAX_BLOCK_M:
        return None
    return tuned_gemv_config("dense_gemm_gated" if gated else "dense_gemm", n, k, table_rows(m), device)


def dense_gemm_plan(x: torch.Tensor, w: torch.Tensor, gated: bool = False) -> dict[str, int] | None:
    """The tiles with which a linear of these operands (on a GPU) takes this kernel, looked up once for dense_gemm's
    `config`: this GPU's table's entry for a decode batch of a shape it holds (DENSE_GEMM_TABLES), else {} (the
    default tiles) for a 16-bit 2-D product of a token count in the switched-on range, else None: not this kernel.
    gated: x is an MLP's gate|up and w its down projection, silu(gate) * up made on the loads (its silu_and_mul
    launch gone), by DENSE_GEMM_GATED_MAX_TOKENS and the gated table."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        return None
    rows = x.shape[0]
    tuned = tuned_dense_config(rows, w.shape[0], w.shape[1], x.device, gated)
    if tuned is not None:
        return tuned
    low, high = (
        (1, DENSE_GEMM_GATED_MAX_TOKENS)
        if gated
        else (DENSE_GEMM_TRITON_MIN_TOKENS, DENSE_GEMM_TRITON_MAX_TOKENS)
    )
    return {} if low <= rows <= min(high, DENSE_GEMM_MAX_BLOCK_M) else None


def dense_gemm_config(m: int, n: int, k: int, device: torch.device) -> dict[str, int]:
    """Tiles for [m, k] x [n, k]^T: BLOCK_M the rows' power of two (>= 16, tl.dot), 64 weight rows by 128 columns
    a tile in 4 stages (~80 KB of shared memory at 64 rows: one or two programs an SM), and splits of K until
    the column tiles make ~2 programs an SM, each split at least 4 tiles."""
    block_m = max(16, triton.next_power_of_2(m))
    block_n, block_k = 64, 128 if k >= 128 else max(16, triton.next_power_of_2(k))
    num_tiles = triton.cdiv(k, block_k)
    split = 1
    if device.type == "cuda":
        n_blocks = triton.cdiv(n, block_n)
        split = max(1, min(triton.cdiv(2 * split_k.num_sms(device.index or 0), n_blocks), num_tiles // 4, 16))
    stages = 4 if block_m <= 64 else 3
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split, "num_warps": 4,
            "num_stages": stages}  # fmt: skip


def dense_gemm(
    x: torch.Tensor,  # [M, K], or gated: gate|up [M, 2K]
    w: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    config: dict[str, int] | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """[M, N] in x's dtype: F.linear(x, w, bias) with fp32 accumulation, rounded once (splits summed in order);
    gated: F.linear(silu_and_mul(x), w, bias) without the [M, K] product written between. Tiles: `config`'s
    (dense_gemm_plan's: the table already looked up) over dense_gemm_config's; with no config, this GPU's table's
    (DENSE_GEMM_TABLES) over dense_gemm_config's."""
    m, k = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    n = w.shape[0]
    assert w.shape[1] == k and 1 <= m <= DENSE_GEMM_MAX_BLOCK_M, f"x {tuple(x.shape)}, w {tuple(w.shape)}"
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    tuned = None if config is not None else tuned_dense_config(m, n, k, x.device, gated)
    cfg = {**dense_gemm_config(m, n, k, x.device), **(tuned or {}), **(config or {})}
    assert cfg["BLOCK_M"] >= m, cfg
    num_tiles = triton.cdiv(k, cfg["BLOCK_K"])
    n_tiles = triton.cdiv(n, cfg["BLOCK_N"])
    sk = split_k_outputs(num_tiles, cfg["SPLIT_K"], m, n, n_tiles, x.dtype, x.device)
    interpret_bf16 = interpreting() and x.dtype != torch.float32
    pdl = use_pdl(x)
    _dense_gemm_kernel[(n_tiles, sk.splits)](
        x, w, bias if bias is not None else w, *sk.pointers(), m, n, k, sk.tiles_per_split, num_tiles,
        x.stride(0), w.stride(0), sk.out.stride(-2), sk.stride_os,
        HAS_BIAS=sk.bias_in_kernel(bias), EVEN_K=k % cfg["BLOCK_K"] == 0,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], PARTIAL=sk.partial,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", INTERPRET_BF16=interpret_bf16,
        USE_PDL=pdl, SERIAL=sk.serial, GATED=gated, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        launch_pdl=pdl,
    )  # fmt: skip
    return sk.result(bias, x.dtype)
