"""Compile the one-launch MoE alignment kernel (longserve/kernels/moe_align.py) and the router's top-k kernel
(kernels/moe_routing.py, variants with "routing": true) for sm90 with Triton's real
compiler, on any machine (no GPU needed: triton ships its nvidia backend and ptxas), and report per variant
the registers, spills and shared memory. Catches constructs that the interpreter accepts and the compiler
refuses (tests/unit/test_moe_align.py runs it). The compile and report steps are longserve/testing/kernel_compile.py's.

    python3 scripts/dev/compile_moe_align.py                       # the default variants, one JSON line each
    python3 scripts/dev/compile_moe_align.py '{"pairs": 4096, "block_m": 64, "emap": true}'   # one variant

To check another Triton (the GPU machine's 3.6.0): install it aside (pip install --no-deps --target DIR
triton==3.6.0) and run with PYTHONPATH=DIR:. ; the JSON names the version used.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # the real compiler, before triton is imported
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from longserve.testing.kernel_compile import compile_sm90, compiled_report, report_variants  # noqa: E402

# (T*k pairs, BLOCK_M, expert map, ids dtype): decode of Qwen3-30B-A3B (8 pairs) and Mixtral (2), a batch of
# 64 decodes, the 4096-pair cap the bench measures up to, the largest size the kernel takes
VARIANTS = [
    {"pairs": 8, "block_m": 16},
    {"pairs": 2, "block_m": 16, "emap": True},
    {"pairs": 512, "block_m": 16, "ids": "i64"},
    {"pairs": 4096, "block_m": 64},
    {"pairs": 4096, "block_m": 64, "emap": True},
    {"pairs": 8192, "block_m": 128, "experts": 256},
    {"routing": True},  # the router's top-k (kernels/moe_routing.py): Qwen3-30B-A3B's 128 experts, top-8
    {"routing": True, "experts": 8, "top_k": 2, "logits": "fp32", "out": "fp32", "sigmoid": True},
    {"pairs": 8, "block_m": 16, "pdl": True},  # programmatic dependent launch (kernels/launch.py PDL)
    {"routing": True, "pdl": True},
]


def compile_align(pairs=8, block_m=16, emap=False, ids="i32", experts=128, pdl=False):
    """The alignment kernel as `moe_align` launches it for `pairs` pairs."""
    from longserve.kernels.moe_align import _moe_align_kernel, align_launch_config
    from longserve.kernels.moe_reference import padded_size_bound

    fn = _moe_align_kernel.fn  # the @triton.jit function inside fast_launch's wrapper
    rows = padded_size_bound(pairs, experts + emap, block_m)
    cfg = align_launch_config(pairs, rows)
    consts = dict(HAS_MAP=emap, BLOCK_P=cfg["BLOCK_P"], BLOCK_M=block_m, FILL=cfg["FILL"], USE_PDL=pdl)
    ptrs = {"topk_ids_ptr": f"*{ids}", "expert_map_ptr": "*i32" if emap else f"*{ids}",
            "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "num_post_ptr": "*i32"}  # fmt: skip
    sig = {a: ptrs.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
    attrs = {a: [["tt.divisibility", 16]] for a in ptrs}
    return compile_sm90(fn, sig, consts, attrs, num_warps=cfg["num_warps"]), cfg


def compile_routing(
    experts=128, top_k=8, logits="bf16", out="bf16", sigmoid=False, renormalize=True, pdl=False
):
    """The router's top-k kernel as `route_topk_fused` launches it."""
    import triton

    from longserve.kernels.moe_routing import _route_topk_kernel

    fn = _route_topk_kernel.fn
    block_e = triton.next_power_of_2(experts)
    consts = dict(K=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), SOFTMAX=not sigmoid,
                  RENORMALIZE=renormalize, USE_PDL=pdl)  # fmt: skip
    ptrs = {"logits_ptr": f"*{logits}", "weights_ptr": f"*{out}", "ids_ptr": "*i32"}
    sig = {a: ptrs.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
    num_warps = 1 if block_e <= 256 else 4
    attrs = {a: [["tt.divisibility", 16]] for a in ptrs}
    return compile_sm90(fn, sig, consts, attrs, num_warps=num_warps), {"num_warps": num_warps}


def report(variant: dict) -> dict:
    args = {k: v for k, v in variant.items() if k != "routing"}
    c, cfg = compile_routing(**args) if variant.get("routing") else compile_align(**args)
    ptx = c.asm["ptx"]
    # pdl: the wait and the early launch of the next kernel are in the PTX (only then)
    pdl = "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    return compiled_report(
        c, variant, launch=cfg, bar_sync="bar.sync" in ptx or "barrier.sync" in ptx, pdl=pdl
    )


if __name__ == "__main__":
    report_variants(report, VARIANTS)
