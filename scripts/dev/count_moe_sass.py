"""What the fused MoE kernel (kernels/moe_gemm.py `_moe_gemm_kernel`) becomes on sm90 at the A3B prefill tiles,
16-bit experts against block-FP8 ones at each `max_num_imprecise_acc` (quant_fp8.FP8_DOT_MAX_IMPRECISE_ACC), on
any machine (Triton ships ptxas and nvdisasm): the tensor-core instructions (wgmma or mma.sync), the registers and
spills, and the main loop's instruction counts (the FP8-to-fp16 conversions F2FP, the promotions FADD, the scale
products FMUL, the scale loads LDG). `"scalar": false` builds a weight scale per column (the per-channel route)
instead of one a tile.

Why: the A3B FP8 cold prefill runs its expert GEMMs ~40% slower than bf16's where FP8's tensor cores are twice as
fast (RESULTS.md seventeenth session). With Triton 3.6 (the H200's), `max_num_imprecise_acc=0` (fp32 accumulation,
the default) builds the FP8 dots as mma.sync on fp16 operands (each e4m3 converted by F2FP): no FP8 tensor core.

    python3 scripts/dev/count_moe_sass.py                 # bf16, then FP8 at 0, 32, 64, 128 and None
    python3 scripts/dev/count_moe_sass.py '{"wq": 2, "acc": 32, "bm": 128, "warps": 8}'
    python3 scripts/dev/count_moe_sass.py '{"wq": 1, "stages": 3}' '{"wq": 1, "stages": 3, "rows": true}'
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # the real compiler, before triton is imported

from longserve.testing.kernel_compile import compile_sm90, report_variants  # noqa: E402
from longserve.testing.sass import cubin_tool, loop_instructions, opcode_counts, resource_usage  # noqa: E402

# the H200 table's prefill tiles for the A3B FP8 experts (moe_configs/E=128,N=768,...,dtype=fp8_e4m3.json, "8192")
LOOP_OPS = ("HGMMA", "QGMMA", "HMMA", "F2FP", "FADD", "FMUL", "FFMA", "LDG", "LDGSTS", "LDS", "STS", "MUFU")
VARIANTS = [{"wq": 0}] + [{"wq": 2, "acc": acc} for acc in (0, 32, 64, 128, None)]


def compile_moe(wq=2, acc=0, bm=64, bn=128, bk=128, warps=8, stages=4, silu=True, scalar=True, rows=False):
    """The gate+up kernel (SILU_AND_MUL) over the pairs' token rows, weights 16-bit (wq 0), GPTQ int4 in groups of
    128 (wq 1; rows: moe_gemm.INT_ROWS's tiles) or e4m3 with 128 x 128 block scales and e4m3 activations quantized
    per 128-group (wq 2), as fused_moe launches it at prefill sizes."""
    from longserve.kernels import moe_gemm

    fn = moe_gemm._moe_gemm_kernel
    while not hasattr(fn, "arg_names"):  # launch.py's FastKernel around the JITFunction
        fn = fn.fn
    w = {0: "*bf16", 1: "*u8", 2: "*fp8e4nv"}[wq]
    ptrs = {"a_ptr": "*bf16" if wq == 1 else w, "b_ptr": w, "c_ptr": "*bf16", "a_scale_ptr": "*fp32",
            "b_scale_ptr": "*fp16" if wq == 1 else "*fp32", "b_zero_ptr": w, "b_gidx_ptr": w,
            "topk_weights_ptr": "*fp32", "sorted_token_ids_ptr": "*i32", "expert_ids_ptr": "*i32",
            "num_tokens_post_padded_ptr": "*i32"}  # fmt: skip
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=16, SILU_AND_MUL=silu, A_ROW_DIV=8 if silu else 1,
                  MUL_ROUTED_WEIGHT=False, EVEN_K=True, WEIGHT_QUANT=wq, BITS=4 if wq == 1 else 8, HAS_ZP=False,
                  HAS_GIDX=False, BLOCK_N_SCALE=128, SCALAR_B_SCALE=scalar and wq == 2, GROUP_BLOCKS=128 // bk,
                  ACT_KIND=0, INTERPRET_BF16=False, FP32_DOT=False, DOT_PRECISION="tf32",
                  MAX_IMPRECISE_ACC=acc if wq == 2 else None, USE_PDL=False, INT_ROWS=rows)  # fmt: skip
    missing = set(consts) - set(fn.arg_names)
    assert not missing, f"_moe_gemm_kernel has no {missing}"
    sig = {a: ptrs.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
    div16 = [*ptrs, "K", "N", "stride_am", "stride_bn", "stride_be", "stride_cm"]
    attrs = {a: [["tt.divisibility", 16]] for a in div16 if a in fn.arg_names}
    return compile_sm90(fn, sig, consts, attrs, num_warps=warps, num_stages=stages)


def report(variant: dict) -> dict:
    c = compile_moe(**variant)
    ptx = c.asm["ptx"]
    out = {"variant": variant, "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync")}
    out.update(resource_usage(c.asm["cubin"]))
    loop = opcode_counts(loop_instructions(cubin_tool(c.asm["cubin"], "nvdisasm", "-c")))
    out["loop"] = {op: loop.get(op, 0) for op in LOOP_OPS}
    out["loop_instructions"] = sum(n for op, n in loop.items() if op)
    return out


if __name__ == "__main__":
    report_variants(report, VARIANTS)
