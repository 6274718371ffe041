"""Instructions a weight in the inner loop of the one-row int4 GEMV (kernels/int4_gemv.py), of the FP8 GEMV at
one row (kernels/fp8_gemv.py, variants with "fp8") and of the tensor-core int4 GEMV (kernels/int4_mma_gemv.py,
"mma"), from their sm90 SASS, with registers, on any machine (Triton ships ptxas and nvdisasm). An H200 streams an int4 weight in ~0.12 ns and an e4m3 one in ~0.24 ns, and its SMs
issue ~33 T lane-instructions/s: at ~4 instructions a weight the int4 GEMV's issue takes as long as its bytes
(issue-bound), the FP8 one's at ~8; this count tells how far a loop is from that before a GPU does. The loop is
the longest backward branch (the mma GEMV's: the shortest holding HMMA); a weight is one of the BLOCK_N x BLOCK_K a program's tile holds, over its 32 x
num_warps threads.

    python3 scripts/dev/count_gemv_sass.py                        # the default variants, one line each
    python3 scripts/dev/count_gemv_sass.py '{"bn": 128, "raw_hi": true}'   # one variant (compile_int4_gemv's keys)
    python3 scripts/dev/count_gemv_sass.py '{"fp8": true, "bn": 128, "split": 8}'   # (compile_fp8_gemv's)
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # the real compiler, before triton is imported
sys.path.insert(0, os.path.dirname(__file__))

from compile_quant_gemv import compile_fp8_gemv, compile_int4_gemv, compile_int4_mma  # noqa: E402

from longserve.testing.kernel_compile import report_variants  # noqa: E402
from longserve.testing.sass import (  # noqa: E402
    cubin_tool,
    innermost_loop,
    loop_instructions,
    opcode_counts,
    resource_usage,
)

VARIANTS = [
    {"bn": 256},
    {"bn": 256, "raw_hi": True},
    {"bn": 128},
    {"bn": 128, "raw_hi": True},
    {"bn": 256, "routed": True, "zp": True},
    {"bn": 256, "routed": True, "zp": True, "raw_hi": True},
    {"fp8": True, "bn": 64, "split": 8},
    {"fp8": True, "channel": True, "bn": 64},
    {"mma": True},  # kernels/int4_mma_gemv.py: the tensor cores' products, 4 tiles of 16 columns a warp
    {"mma": True, "reps": 2},
    {"mma": True, "reps": 2, "stages": 2},
    {"mma": True, "stages": 2},
    {"mma": True, "token_tiles": 2},  # 9 to 16 rows (per weight for all 16 tokens)
]


def count(variant: dict) -> dict:
    if variant.get("mma"):  # a warp's 16 columns x 128 k a tile, over its 32 lanes
        from longserve.kernels import int4_mma_gemv

        compiled = compile_int4_mma(**variant)
        weights_per_thread = 64 * variant.get("reps", int4_mma_gemv.REPS)
    else:
        kw = {"bn": 256, **variant}
        compiled = compile_fp8_gemv(**kw) if kw.get("fp8") else compile_int4_gemv(**kw)
        weights_per_thread = kw["bn"] * kw.get("bk", 128) / (32 * kw.get("num_warps", 4))
    sass = cubin_tool(compiled.asm["cubin"], "nvdisasm", "-c")
    # the mma GEMV's main loop is the shortest holding HMMA: with a ring (STAGES) the longest backward branch is an
    # mbarrier wait's retry, which jumps back across the loop and the epilogue (977 instructions against the loop's
    # 260 at REPS 2, 2 stages, AHEAD, the norm epilogue; thirty-first session)
    body = innermost_loop(sass, "HMMA") if variant.get("mma") else loop_instructions(sass)
    return {"variant": variant, "loop": len(body), "per_weight": round(len(body) / weights_per_thread, 2),
            "regs": resource_usage(compiled.asm["cubin"])["regs"], "top": dict(list(opcode_counts(body).items())[:8])}  # fmt: skip


if __name__ == "__main__":
    report_variants(count, VARIANTS)
