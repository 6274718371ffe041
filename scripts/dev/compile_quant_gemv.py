"""Compile the decode GEMV kernels (longserve/kernels/quant_gemv.py, int4_gemv.py: variants with "int4", moe_wna16.py's grouped kernel:
"moe_grouped", fp8_gemv.py: variants with "fp8", activation.py's SiLU-and-mul + FP8 quantization: "silu_quant", quant_fp8.py's activation quantization: "group_quant") for sm90 with Triton's real compiler, on any
machine (no GPU needed: triton ships its nvidia backend and ptxas), and report per variant the registers, spills
and whether the packed weights are loaded with 16-byte vectors. Catches constructs that the interpreter accepts
and the compiler refuses (tests/unit/test_quant_gemv.py runs it).

    python3 scripts/dev/compile_quant_gemv.py            # the default variants, one JSON line each
    python3 scripts/dev/compile_quant_gemv.py '{"bm": 4, "zp": true}'   # one variant (keys: compile_gemv's)
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # the real compiler, before triton is imported
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from longserve.testing.kernel_compile import compile_sm90, compiled_report, report_variants  # noqa: E402

VARIANTS = [
    {},  # M = 1, int4 g128 symmetric, split-K: the decode case
    {"pdl": True},
    {"bm": 4, "zp": True, "split": 1, "bias": True},
    {"bits": 8, "bm": 2, "bn": 32},
    {"gidx": True, "zp": True, "bk": 64, "bn": 32},
    {"dot": True, "bm": 16},
    {"dot": True, "bm": 16, "gidx": True, "zp": True, "bk": 64, "bn": 32, "x": "fp16"},
    {"dot": True, "bm": 64, "bits": 8, "split": 1, "bias": True},
    {"even_k": False, "per_col": True, "bk": 64, "bn": 32, "split": 1, "x": "fp32"},
    {"serial": True},  # the split-K partials summed by the last program of each tile (SPLIT_K_SERIAL_REDUCE)
    {"reduce": True},  # the split-K reduction
    {"reduce": True, "pdl": True},  # programmatic dependent launch (kernels/launch.py PDL): griddepcontrol
    {"fp8": True},  # block FP8, M = 1, split-K: the decode case
    {"fp8": True, "pdl": True},
    {"fp8": True, "serial": True, "bias": True},
    {"fp8": True, "bm": 8, "bn": 32, "split": 1, "bias": True, "even_k": False},
    {"fp8": True, "bm": 16, "bn": 16, "x": "fp32"},
    {"fp8": True, "channel": True},  # per-channel FP8, M = 1, split-K
    {"fp8": True, "channel": True, "bm": 4, "split": 1, "bias": True, "even_k": False},
    {"fp8": True, "routed": True, "x_row_div": 8, "pdl": True},  # MoE decode: gate+up over (token, k) pairs
    {"fp8": True, "routed": True, "split": 1},  # down, one split
    {"int4": True, "bn": 256},  # the one-row fast path, g128 symmetric, split-K: the decode case
    {"int4": True, "bn": 256, "pdl": True},
    {"int4": True, "bn": 256, "serial": True, "pdl": True},
    {"int4": True, "bn": 256, "serial": True, "pdl": True, "prefetch": 2},  # L2 prefetch (INT4_GEMV_PREFETCH)
    {"int4": True, "bn": 256, "raw_hi": True},  # the same with the unmasked high value (INT4_GEMV_RAW_HI)
    {"int4": True, "zp": True, "split": 1, "bias": True, "x": "fp16"},
    {"int4": True, "routed": True, "x_row_div": 8, "split": 1},  # MoE decode, gate+up over (token, k) pairs
    {"int4": True, "routed": True, "zp": True},  # MoE down, split-K
    {"int4": True, "routed": True, "zp": True, "pdl": True},
    {"int4": True, "routed": True, "zp": True, "raw_hi": True},
    {"moe_grouped": True},  # the grouped int4 MoE kernel, gate+up over the pairs' token rows
    {"moe_grouped": True, "zp": True, "x_row_div": 1},  # its down projection
    {"silu_quant": True},  # activation.py's SiLU-and-mul + FP8 quantization (block-FP8 down input)
    {"silu_quant": True, "pdl": True},
    {"group_quant": True},  # quant_fp8.per_token_group_quant's kernel: 8 groups of 128 a program
    {"group_quant": True, "int8": True, "block": 4096, "gpp": 1},  # per token, int8
    {"group_quant": True, "pdl": True},
    {"mma": True},  # kernels/int4_mma_gemv.py (Gluon): 1-8 rows on the tensor cores, split-K, g128 symmetric
    {"mma": True, "zp": True, "serial": True, "bias": True, "pdl": True, "even_n": False, "group_shift": -1},
    {"mma": True, "split": 1, "bias": True, "reps": 2, "group_shift": 1, "stages": 2},
    {"mma": True, "routed": True, "zp": True, "x_row_div": 8, "pdl": True},  # MoE pairs
    # the words by a TMA ring (int4_mma_gemv.STAGES), routed: the expert's rows in the experts' descriptor
    {"mma": True, "routed": True, "zp": True, "x_row_div": 8, "pdl": True, "stages": 3, "even_n": False},
    {
        "mma": True,
        "reps": 2,
        "stages": 2,
        "stage_steps": 2,
        "pdl": True,
        "serial": True,
    },  # 128 bytes a row a box
    {"mma": True, "pdl": True, "serial": True, "prefetch": 2},  # L2 prefetch (int4_mma_gemv.PREFETCH)
    {"mma": True, "routed": True, "x_row_div": 8, "pdl": True, "prefetch": 2, "even_n": False},
    {
        "mma": True,
        "reps": 2,
        "unroll": 2,
        "pdl": True,
        "serial": True,
    },  # two steps a turn (int4_mma_gemv.UNROLL)
    # the down projection at one row fed gate|up: silu(gate) * up staged in shared memory (GATED)
    {"mma": True, "reps": 2, "stages": 2, "gated": True, "pdl": True, "serial": True},
    # a step's x and scales asked for a step ahead (int4_mma_gemv.AHEAD): one row, zero points, N not whole programs
    {
        "mma": True,
        "reps": 2,
        "stages": 2,
        "ahead": True,
        "pdl": True,
        "serial": True,
        "zp": True,
        "even_n": False,
    },
    {
        "mma": True,
        "reps": 2,
        "stages": 2,
        "ahead": True,
        "gated": True,
        "pdl": True,
        "serial": True,
    },  # gate, up
    # the next RMSNorm in the epilogue (gluon_gemv.norm_row, NORM): the o projection (serial sum) and gated down
    {"mma": True, "reps": 2, "stages": 2, "ahead": True, "pdl": True, "serial": True, "norm": True},
    {
        "mma": True,
        "reps": 2,
        "stages": 2,
        "ahead": True,
        "gated": True,
        "pdl": True,
        "split": 1,
        "norm": True,
    },
    {"mma": True, "token_tiles": 2, "zp": True},  # 9 to 16 rows: a second B and C on the same A
    {"mma": True, "token_tiles": 2, "row_blocks": 4},  # 17 to 64 rows: blocks of 16, split-K partials
    {"fp8_wgmma": True},  # kernels/fp8_wgmma_gemv.py (Gluon): block FP8 by TMA + wgmma, one row, split-K
    {"fp8_wgmma": True, "rows": 16, "pdl": True, "serial": True, "bias": True},
    {"fp8_wgmma": True, "rows": 32, "split": 1, "imprecise_acc": 128},  # 32 rows, no promotion inside a block
    {"fp8_wgmma": True, "channel": True, "rows": 4, "pdl": True},  # per-channel FP8 (e4m3 activations)
    # the down projection fed gate|up: silu(gate) * up made inside (GATED)
    {"fp8_wgmma": True, "gated": True, "pdl": True, "serial": True},
    # block FP8's activations two blocks ahead and weight scales one (fp8_wgmma_gemv.AHEAD), gated and routed
    {"fp8_wgmma": True, "ahead": True, "gated": True, "pdl": True, "serial": True},
    {"fp8_wgmma": True, "ahead": True, "routed": True, "x_row_div": 8, "pdl": True},
    # the next RMSNorm in the epilogue (NORM), serial sum and one split
    {"fp8_wgmma": True, "ahead": True, "pdl": True, "serial": True, "norm": True},
    {"fp8_wgmma": True, "ahead": True, "gated": True, "pdl": True, "split": 1, "norm": True},
    {
        "fp8_wgmma": True,
        "routed": True,
        "x_row_div": 8,
        "pdl": True,
    },  # MoE decode: gate+up over (token, k) pairs
    {"dense": True},  # kernels/dense_gemm.py: 16-bit, 64 rows, the 8B gate_up's tiles (one split)
    {"dense": True, "split": 4, "serial": True, "bias": True, "pdl": True},
]


def compile_gemv(x="bf16", bits=4, zp=False, gidx=False, per_col=False, bias=False, even_k=True, dot=False,
                 bm=1, bn=64, bk=128, split=4, pdl=False, serial=False, num_warps=4, num_stages=2):  # fmt: skip
    """TTIR -> TTGIR -> LLVM -> PTX -> cubin for sm90, with the runtime's specializations (pointers and
    multiples of 16: tt.divisibility=16)."""
    from longserve.kernels.quant_gemv import _wna16_gemv_kernel as fn

    names = fn.arg_names
    ptrs = {"x_ptr": f"*{x}", "w_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*u8" if zp else "*fp16",
            "g_ptr": "*i32" if gidx else "*fp16", "b_ptr": f"*{x}" if bias else "*fp16",
            "out_ptr": "*fp32" if split > 1 else f"*{x}", "res_ptr": f"*{x}", "lock_ptr": "*i32"}  # fmt: skip
    consts = dict(BITS=bits, HAS_ZP=zp, HAS_GIDX=gidx, SCALE_PER_COL=per_col or gidx,
                  HAS_BIAS=bias and (split == 1 or serial), EVEN_K=even_k, USE_DOT=dot, BLOCK_M=bm, BLOCK_N=bn,
                  BLOCK_K=bk, PARTIAL=split > 1, INTERPRET=False, INTERPRET_BF16=False, USE_PDL=pdl,
                  SERIAL=serial)  # fmt: skip
    sig = {a: ptrs.get(a, "constexpr" if a in consts else "i32") for a in names}
    div16 = [*ptrs, "K", "N", "stride_xm", "stride_wn", "stride_om", "stride_os"]
    attrs = {a: [["tt.divisibility", 16]] for a in div16}
    return compile_sm90(fn, sig, consts, attrs, num_warps=num_warps, num_stages=num_stages)


def compile_reduce(x="bf16", bias=True, pdl=False):
    """The split-K reduction kernel for sm90."""
    from longserve.kernels.split_k import _splitk_reduce_kernel as fn

    sig = {"part_ptr": "*fp32", "b_ptr": f"*{x}", "out_ptr": f"*{x}", "N": "i32", "num_splits": "i32",
           "stride_ps": "i32", "stride_pm": "i32", "stride_om": "i32", "HAS_BIAS": "constexpr",
           "BLOCK": "constexpr", "INTERPRET_BF16": "constexpr", "USE_PDL": "constexpr"}  # fmt: skip
    consts = {"HAS_BIAS": bias, "BLOCK": 1024, "INTERPRET_BF16": False, "USE_PDL": pdl}
    return compile_sm90(fn, sig, consts, num_warps=4)


def compile_fp8_gemv(fp8=True, channel=False, x="bf16", bias=False, even_k=True, bm=1, bn=64, bk=128, split=4,
                     pdl=False, serial=False, routed=False, x_row_div=1, num_warps=4,
                     num_stages=2):  # fmt: skip
    """The FP8 GEMV (block, or per channel) for sm90, specialized as at run time; `routed`: over MoE (token,
    expert) pairs (kernels/moe_fp8_gemv.py)."""
    from longserve.kernels.fp8_gemv import _fp8_gemv_kernel as fn

    ptrs = {"x_ptr": "*u8" if channel else f"*{x}", "xs_ptr": "*fp32", "w_ptr": "*u8", "s_ptr": "*fp32",
            "b_ptr": f"*{x}" if bias else "*fp32", "out_ptr": "*fp32" if split > 1 else f"*{x}",
            "res_ptr": f"*{x}", "lock_ptr": "*i32", "ids_ptr": "*i32"}  # fmt: skip
    consts = dict(PER_CHANNEL=channel, HAS_BIAS=bias and (split == 1 or serial), EVEN_K=even_k, BLOCK_M=bm,
                  BLOCK_N=bn, BLOCK_K=bk, PARTIAL=split > 1, INTERPRET=False, INTERPRET_BF16=False, USE_PDL=pdl,
                  SERIAL=serial, ROUTED=routed, X_ROW_DIV=x_row_div)  # fmt: skip
    sig = {a: ptrs.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
    div16 = [*ptrs, "K", "N", "stride_xm", "stride_wn", "stride_om", "stride_os", "stride_we", "stride_se"]
    attrs = {a: [["tt.divisibility", 16]] for a in div16}
    return compile_sm90(fn, sig, consts, attrs, num_warps=num_warps, num_stages=num_stages)


def compile_int4_gemv(int4=True, x="bf16", zp=False, bias=False, bn=64, bk=128, split=4, routed=False, x_row_div=1,
                      raw_hi=False, pdl=False, serial=False, prefetch=0, num_warps=4, num_stages=2):  # fmt: skip
    """The one-row int4 GEMV (kernels/int4_gemv.py) for sm90, specialized as at run time; `routed`: over MoE
    (token, expert) pairs (kernels/moe_wna16.py)."""
    from longserve.kernels.int4_gemv import int4_gemv_kernel as fn

    ptrs = {"x_ptr": f"*{x}", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8" if zp else "*fp16",
            "b_ptr": f"*{x}" if bias else "*fp16", "ids_ptr": "*i32",
            "out_ptr": "*fp32" if split > 1 else f"*{x}", "res_ptr": f"*{x}", "lock_ptr": "*i32"}  # fmt: skip
    consts = dict(HAS_ZP=zp, HAS_BIAS=bias and (split == 1 or serial), BLOCK_N=bn, BLOCK_K=bk, PARTIAL=split > 1,
                  INTERPRET_BF16=False, ROUTED=routed, X_ROW_DIV=x_row_div, USE_RAW_HI=raw_hi,
                  USE_PDL=pdl, SERIAL=serial, PREFETCH=prefetch)  # fmt: skip
    sig = {a: ptrs.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
    div16 = [*ptrs, "N", "stride_wn", "stride_os", "stride_xm", "stride_om", "stride_we", "stride_se"]
    attrs = {a: [["tt.divisibility", 16]] for a in div16}
    return compile_sm90(fn, sig, consts, attrs, num_warps=num_warps, num_stages=num_stages)


# gluon_gemv.norm_row's arguments (NORM; placeholders of these types without it)
_NORM_PTRS = {"nres_ptr": "*bf16", "nw_ptr": "*bf16", "nout_ptr": "*bf16", "nlock_ptr": "*i32", "eps": "fp32"}


def compile_int4_mma(mma=True, zp=False, bias=False, split=4, serial=False, even_n=True, group_shift=0, reps=None,
                     stages=0, pdl=False, routed=False, x_row_div=1, token_tiles=1, row_blocks=1, prefetch=0,
                     unroll=1, stage_steps=1, gated=False, ahead=False, norm=False, num_warps=4):  # fmt: skip
    """kernels/int4_mma_gemv.py's tensor-core int4 GEMV (Gluon) for sm90, specialized as at run time (an integer
    argument of 1 is a constant then: row_blocks up to 16 rows); `routed`: over MoE (token, expert) pairs
    (kernels/moe_wna16.py)."""
    import torch
    from triton.runtime.jit import mangle_type

    from longserve.kernels import int4_mma_gemv as mma_mod

    fn = mma_mod.int4_mma_gemv_kernel
    ptrs = {"x_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8" if zp else "*fp16",
            "b_ptr": "*bf16" if bias else "*fp16", "out_ptr": "*fp32" if split > 1 else "*bf16", "res_ptr": "*bf16",
            "lock_ptr": "*i32", "ids_ptr": "*i32", **_NORM_PTRS}  # fmt: skip
    consts = dict(HAS_ZP=zp, HAS_BIAS=bias and (split == 1 or serial), PARTIAL=split > 1, SERIAL=serial,
                  EVEN_N=even_n, GROUP_SHIFT=group_shift, REPS=reps or mma_mod.REPS, STAGES=stages,
                  USE_PDL=pdl, ROUTED=routed, X_ROW_DIV=x_row_div, TOKEN_TILES=token_tiles,
                  PREFETCH=prefetch, UNROLL=unroll, GATED=gated, AHEAD=ahead, NORM=norm,
                  NORM_BLOCK=4096 if norm else 1)  # fmt: skip
    if stages:  # the ring's TMA descriptor, boxes of half this REPS's program columns by stage_steps steps
        columns = 16 * num_warps * consts["REPS"]
        old, mma_mod.STAGE_STEPS = mma_mod.STAGE_STEPS, stage_steps
        try:
            ptrs["w_desc"] = mangle_type(
                mma_mod._descriptor(torch.zeros(512, 256, dtype=torch.uint8), columns)
            )
        finally:
            mma_mod.STAGE_STEPS = old
    else:
        consts["w_desc"] = None
    if row_blocks == 1:
        consts["row_blocks"] = 1
    sig = {a: ptrs.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
    div16 = [
        *ptrs,
        "N",
        "stride_xm",
        "stride_wn",
        "stride_sn",
        "stride_zn",
        "stride_os",
        "stride_om",
        "stride_we",
    ]
    attrs = {a: [["tt.divisibility", 16]] for a in div16}
    return compile_sm90(fn, sig, consts, attrs, num_warps=num_warps)


def compile_fp8_wgmma(fp8_wgmma=True, rows=1, bias=False, split=4, serial=False, pdl=False, imprecise_acc=32,
                      channel=False, routed=False, x_row_div=1, gated=False, ahead=False, norm=False):  # fmt: skip
    """kernels/fp8_wgmma_gemv.py's FP8 GEMV on the tensor cores (Gluon: TMA, wgmma) for sm90 at `rows` activation
    rows, block FP8 (bf16 activations) or `channel` (e4m3 activations, per-channel scales), specialized as at run
    time."""
    import torch
    from triton.runtime.jit import mangle_type

    from longserve.kernels import fp8_wgmma_gemv as wg

    w = torch.zeros(256, 512, dtype=torch.float8_e4m3fn)
    layout = wg.gl.NVMMASharedLayout.get_default_for(list(wg.BLOCK), wg.gl.float8e4nv)
    desc = wg.TensorDescriptor(w, list(w.shape), list(w.stride()), list(wg.BLOCK), layout)
    ptrs = {"w_desc": mangle_type(desc), "x_ptr": "*u8" if channel else "*bf16", "xs_ptr": "*fp32", "s_ptr": "*fp32",
            "b_ptr": "*bf16" if bias else "*fp32", "ids_ptr": "*i32",
            "out_ptr": "*fp32" if split > 1 else "*bf16", "res_ptr": "*bf16", "lock_ptr": "*i32",
            **_NORM_PTRS}  # fmt: skip
    consts = dict(HAS_BIAS=bias and (split == 1 or serial), PARTIAL=split > 1, SERIAL=serial,
                  BLOCK_T=wg.block_t(rows), STAGES=wg.STAGES, IMPRECISE_ACC=imprecise_acc, USE_PDL=pdl,
                  PER_CHANNEL=channel, num_warps=wg.WARPS, ROUTED=routed, X_ROW_DIV=x_row_div,
                  GATED=gated, AHEAD=ahead, NORM=norm, NORM_BLOCK=4096 if norm else 1)  # fmt: skip
    fn = wg.fp8_wgmma_gemv_kernel
    sig = {a: ptrs.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
    attrs = {
        a: [["tt.divisibility", 16]] for a in ["x_ptr", "s_ptr", "out_ptr", "N", "stride_xm", "stride_om"]
    }
    return compile_sm90(fn, sig, consts, attrs, num_warps=wg.WARPS)


def compile_moe_grouped(moe_grouped=True, x="bf16", zp=False, bm=16, bn=64, x_row_div=8, num_warps=4,
                        num_stages=2):  # fmt: skip
    """kernels/moe_wna16.py's grouped int4 MoE kernel for sm90, with 16-bit dots as on the GPU."""
    from longserve.kernels.moe_wna16 import _grouped_int4_kernel

    fn = _grouped_int4_kernel.fn  # the @triton.jit function inside fast_launch's wrapper

    ptrs = {"x_ptr": f"*{x}", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8" if zp else "*fp16",
            "sorted_ptr": "*i32", "expert_ids_ptr": "*i32", "num_post_ptr": "*i32", "out_ptr": f"*{x}"}  # fmt: skip
    consts = dict(X_ROW_DIV=x_row_div, HAS_ZP=zp, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, INTERPRET_FP32_DOT=False,
                  INTERPRET_BF16=False)  # fmt: skip
    sig = {a: ptrs.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
    div16 = [*ptrs, "N", "stride_xm", "stride_wn", "stride_om", "stride_we"]
    attrs = {a: [["tt.divisibility", 16]] for a in div16}
    return compile_sm90(fn, sig, consts, attrs, num_warps=num_warps, num_stages=num_stages)


def compile_silu_quant(silu_quant=True, x="bf16", pdl=False):
    """kernels/activation.py's fused SiLU-and-mul + per-token-group e4m3 quantization for sm90."""
    from longserve.kernels.activation import _silu_and_mul_quant_kernel

    fn = _silu_and_mul_quant_kernel.fn  # the @triton.jit function inside fast_launch's wrapper
    ptrs = {"x_ptr": f"*{x}", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    consts = dict(QMAX=448.0, GROUP=128, GPP=8, INTERPRET=False, USE_PDL=pdl)
    sig = {a: ptrs.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
    attrs = {a: [["tt.divisibility", 16]] for a in [*ptrs, "inter", "stride_x", "stride_q"]}
    return compile_sm90(fn, sig, consts, attrs, num_warps=4)


def compile_group_quant(group_quant=True, x="bf16", int8=False, block=128, gpp=8, pdl=False):
    """quant_fp8.per_token_group_quant's kernel for sm90 (e4m3 or int8 out)."""
    from longserve.kernels.quant_fp8 import _group_quant_kernel

    fn = _group_quant_kernel.fn  # the @triton.jit function inside fast_launch's wrapper

    ptrs = {"x_ptr": f"*{x}", "q_ptr": "*i8" if int8 else "*fp8e4nv", "s_ptr": "*fp32", "static_ptr": f"*{x}"}
    consts = dict(
        QMAX=127.5 if int8 else 448.0,
        OUT_INT8=int8,
        STATIC=False,
        BLOCK=block,
        GPP=gpp,
        INTERPRET=False,
        USE_PDL=pdl,
    )
    sig = {a: ptrs.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
    attrs = {a: [["tt.divisibility", 16]] for a in [*ptrs, "K", "group_size", "stride_xm", "stride_qm"]}
    return compile_sm90(fn, sig, consts, attrs, num_warps=4)


def compile_dense(dense=True, x="bf16", bm=64, bn=64, bk=128, split=1, bias=False, serial=False, pdl=False,
                  num_warps=4, num_stages=4):  # fmt: skip
    """kernels/dense_gemm.py's 16-bit skinny GEMM for sm90 (tl.dot on 16-bit tiles, as on the GPU)."""
    from longserve.kernels.dense_gemm import _dense_gemm_kernel as fn

    ptrs = {"x_ptr": f"*{x}", "w_ptr": f"*{x}", "b_ptr": f"*{x}", "out_ptr": "*fp32" if split > 1 else f"*{x}",
            "res_ptr": f"*{x}", "lock_ptr": "*i32"}  # fmt: skip
    consts = dict(HAS_BIAS=bias and (split == 1 or serial), EVEN_K=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                  PARTIAL=split > 1, DOT_PRECISION="tf32", INTERPRET_BF16=False, USE_PDL=pdl, SERIAL=serial)  # fmt: skip
    sig = {a: ptrs.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
    attrs = {
        a: [["tt.divisibility", 16]]
        for a in [*ptrs, "N", "K", "stride_xm", "stride_wn", "stride_om", "stride_os"]
    }
    return compile_sm90(fn, sig, consts, attrs, num_warps=num_warps, num_stages=num_stages)


def report(variant: dict) -> dict:
    if variant.get("dense"):
        c = compile_dense(**variant)
    elif variant.get("group_quant"):
        c = compile_group_quant(**variant)
    elif variant.get("silu_quant"):
        c = compile_silu_quant(**variant)
    elif variant.get("moe_grouped"):
        c = compile_moe_grouped(**variant)
    elif variant.get("int4"):
        c = compile_int4_gemv(**variant)
    elif variant.get("mma"):
        c = compile_int4_mma(**variant)
    elif variant.get("fp8_wgmma"):
        c = compile_fp8_wgmma(**variant)
    elif variant.get("fp8"):
        c = compile_fp8_gemv(**variant)
    else:
        args = {k: v for k, v in variant.items() if k != "reduce"}
        c = compile_reduce(**args) if variant.get("reduce") else compile_gemv(**args)
    ptx = c.asm["ptx"]
    # pdl: the wait and the early launch of the next kernel are in the PTX (only then)
    pdl = "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    # serial: the per-tile counter's atomic (acquire-release at GPU scope) is in the PTX (only then)
    serial = "atom.global.gpu.acq_rel.add" in ptx
    return compiled_report(c, variant, ld_v4="ld.global.v4.b32" in ptx or "cp.async.cg" in ptx, pdl=pdl,
                           serial=serial, mma_sync=ptx.count("mma.sync"), wgmma=ptx.count("wgmma.mma_async"),
                           tma="cp.async.bulk.tensor" in ptx,
                           prefetch=ptx.count("prefetch.global.L2"))  # fmt: skip


def _gluon_builds() -> bool:
    """Whether this Triton builds the Gluon kernels (int4_mma_gemv, fp8_wgmma_gemv: gluon_compat.supported, 3.6-3.9)."""
    try:
        from longserve.kernels import int4_mma_gemv
    except ImportError:
        return False
    return int4_mma_gemv.supported()


if __name__ == "__main__":
    report_variants(
        report, [v for v in VARIANTS if not (v.get("mma") or v.get("fp8_wgmma")) or _gluon_builds()]
    )
