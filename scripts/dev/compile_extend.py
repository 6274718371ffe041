"""Compile the paged extend attention kernel (longserve/kernels/extend_attention.py `_extend_kernel`) for sm90 with
Triton's real compiler, on any machine (no GPU needed), and report per tile the registers, the stack (spills) and
the wgmma / cp.async in its PTX: which tiles the prefix hit's short chunks can take (triton_backend.SHORT_CHUNK_TILE)
before a GPU times them (`gpu_check.sh hit-fa3`). Pointers and 16-multiple strides are specialized as the GPU
launches them (without that, every tile seems to spill ~1 KB a thread: scalar loads).

    python3 scripts/dev/compile_extend.py                               # the default tiles, one JSON line each
    python3 scripts/dev/compile_extend.py '{"m": 256, "n": 32, "warps": 16}'   # one tile (keys: VARIANTS')
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # the real compiler, before triton is imported
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from longserve.testing.kernel_compile import compile_sm90, compiled_report, report_variants  # noqa: E402

# m, n: rows and keys a tile; the backend's short chunks take 64x64 on 4 warps, its long ones 128x64 on 8
VARIANTS = [
    {"m": 64, "n": 64, "warps": 4, "stages": 3},
    {"m": 64, "n": 64, "warps": 4, "stages": 3, "split": False},
    {"m": 128, "n": 64, "warps": 8, "stages": 3, "split": False},
    {"m": 128, "n": 32, "warps": 8, "stages": 2},
    {"m": 256, "n": 32, "warps": 8, "stages": 2},
    # 16 warps: four warpgroups of 64 rows, 64 accumulator registers a thread each
    {"m": 256, "n": 32, "warps": 16, "stages": 2},
    {"m": 256, "n": 64, "warps": 16, "stages": 3},  # triton_backend.WIDE_SHORT_TILE, as launched
    # head dim 256 (Qwen3.5's full attention): extend_config's tile, and the short chunks' tile
    {"m": 64, "n": 32, "warps": 8, "stages": 2, "d": 256},
    {"m": 64, "n": 32, "warps": 8, "stages": 2, "d": 256, "split": False},
    {"m": 64, "n": 64, "warps": 4, "stages": 3, "d": 256},
]
POINTERS = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "o_ptr", "lse_ptr", "query_start_loc_ptr", "prefix_lens_ptr",
            "seq_lens_ptr", "page_table_ptr")  # fmt: skip
STRIDES = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_os", "stride_slot", "stride_kvh")


def report(v: dict) -> dict:
    from longserve.kernels.extend_attention import _extend_kernel

    split = v.get("split", True)
    out = "*fp32" if split else "*bf16"
    types = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "o_ptr": out, "lse_ptr": "*fp32",
             "query_start_loc_ptr": "*i32", "prefix_lens_ptr": "*i32", "seq_lens_ptr": "*i32",
             "page_table_ptr": "*i32", "qk_scale": "fp32", "v_scale": "fp32"}  # fmt: skip
    d = v.get("d", 128)  # the head dim
    constexprs = {"GROUP": 4, "PAGE_SIZE": 16, "HEAD_DIM": d, "BLOCK_D": d, "BLOCK_M": v["m"], "BLOCK_N": v["n"],
                  "SPLIT": split, "HAS_WINDOW": False, "DOT_PRECISION": "tf32"}  # fmt: skip
    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "i32")
        for name in _extend_kernel.fn.arg_names
    }
    div = [["tt.divisibility", 16]]
    attrs = {name: div for name in (*POINTERS, *STRIDES) if split or name != "stride_os"}
    k = compile_sm90(
        _extend_kernel, signature, constexprs, attrs, num_warps=v["warps"], num_stages=v.get("stages", 2)
    )
    ptx = k.asm["ptx"]
    return compiled_report(k, v, wgmma=ptx.count("wgmma.mma_async"), cp_async=ptx.count("cp.async.cg"))


if __name__ == "__main__":
    report_variants(report, VARIANTS)
