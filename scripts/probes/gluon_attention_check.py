"""Checks of our Gluon attention kernel (longserve/kernels/gluon_attention.py): against an fp32 reference and cuDNN,
timed beside cuDNN and FA3 on a GPU; built for sm90 on any machine (`--compile-only`, Triton 3.6); its loop in torch
on the CPU (`--emulate`). GLUON_SPLIT, GLUON_PINGPONG, GLUON_BLOCK_N, GLUON_STAGES, GLUON_RUN (GLUON_PAIRS=1/0: a run
of 2/1), GLUON_PERSISTENT, GLUON_LOAD_REGS and GLUON_COMPUTE_REGS pick the variant (unset: the engine's, `Variant()`).
Writes $OUT/gluon_attention_split{0,1}_pp{0,1}_bn{64,128}_st{2,3}_run{1,2,..}_pers{0,1}.json on a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from longserve.kernels import gluon_attention as ga
from longserve.kernels.gluon_attention_reference import emulate, reference

HQ, HKV, D = 32, 8, ga.D  # the Llama-3.1-8B shape


def variant_from_env() -> ga.Variant:
    """The variant the GLUON_* variables name, over the engine's."""
    names = {"split": "GLUON_SPLIT", "pingpong": "GLUON_PINGPONG", "block_n": "GLUON_BLOCK_N",
             "stages": "GLUON_STAGES", "run": "GLUON_RUN", "persistent": "GLUON_PERSISTENT",
             "load_regs": "GLUON_LOAD_REGS", "compute_regs": "GLUON_COMPUTE_REGS"}  # fmt: skip
    given = {}
    if os.environ.get("GLUON_PAIRS") is not None:  # the twenty-second session's name: pairs = runs of 2
        given["run"] = 2 if os.environ["GLUON_PAIRS"] == "1" else 1
    for field in dataclasses.fields(ga.Variant):
        value = os.environ.get(names[field.name])
        if value is not None:
            given[field.name] = value == "1" if field.type in (bool, "bool") else int(value)
    return dataclasses.replace(ga.Variant(), **given)


ga.use_variant(variant_from_env())


def compile_only() -> None:
    """Build the kernel for sm90 here (no GPU): registers, spills, shared memory, the key-block loop's SASS."""
    from triton.runtime.jit import mangle_type

    from longserve.testing.kernel_compile import gluon_sm90_report

    q = torch.zeros(1024, HQ + 2 * HKV, D, dtype=torch.bfloat16)
    q_desc, k_desc, v_desc = ga.descriptors(q[:, :HQ], q[:, HQ : HQ + HKV], q[:, HQ + HKV :])
    for causal in (True, False):
        names = ["q_desc", "k_desc", "v_desc"]
        signature = {n: mangle_type(d) for n, d in zip(names, (q_desc, k_desc, v_desc))}
        signature.update({"o_ptr": "*bf16", "lse_ptr": "*fp32", "num_heads": "i32", "num_rows": "i32",
                          "num_keys": "i32", "shift": "i32",
                          "qk_scale": "fp32", "o_row_stride": "i32"})  # fmt: skip
        warps = 4 if ga.SPLIT else ga.NUM_WARPS
        constexprs = {"GROUP": HQ // HKV, "CAUSAL": causal, "BLOCK_M": ga.BLOCK_M, "BLOCK_N": ga.BLOCK_N, "HEAD_DIM": D,
                      "STAGES": ga.STAGES, "SPLIT": ga.SPLIT, "PART_M": ga.BLOCK_M // 2 if ga.SPLIT else ga.BLOCK_M,
                      "PINGPONG": ga.PINGPONG, "num_warps": warps}  # fmt: skip
        signature.update({n: "constexpr" for n in constexprs})
        report = gluon_sm90_report(
            ga.attention_fwd_kernel, signature, constexprs, num_warps=warps, maxnreg=168
        )
        print(json.dumps({"causal": causal, **report}))


def time_ms(fn) -> float:
    from longserve.platform import cuda_time_ms

    return cuda_time_ms(fn, warmup=3, iters=1, repeats=10)


def heads(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [T, H, D] -> [1, H, T, D], as the engine hands cuDNN its views


def check_case(new: int, prefix: int, causal: bool, flash_attn_varlen_func) -> dict:
    """One shape: q/k/v as the engine lays them; the kernel against fp32 (small enough) and cuDNN, timed with
    cuDNN and FA3 (None: not on the path)."""
    from longserve.attention import sdpa

    scale, keys = D**-0.5, prefix + new
    qkv = torch.randn(new, (HQ + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : HQ * D].view(new, HQ, D)
    if prefix == 0:  # a cold chunk: its own K/V, views of the fused output
        k = qkv[:, HQ * D : (HQ + HKV) * D].view(new, HKV, D)
        v = qkv[:, (HQ + HKV) * D :].view(new, HKV, D)
    else:  # a prefix and the chunk's keys, as consecutive cache pages hold them
        k = torch.randn(keys, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(keys, HKV, D, device="cuda", dtype=torch.bfloat16)
    flop = 4 * new * (prefix + (new + 1) / 2 if causal else keys) * D * HQ
    row = {
        "new": new,
        "keys": keys,
        "causal": causal,
        "split": ga.SPLIT,
        "pingpong": ga.PINGPONG,
        "block_n": ga.BLOCK_N,
        "stages": ga.STAGES,
        "run": ga.VARIANT.run,
        "persistent": ga.PERSISTENT,
    }
    try:
        o, lse = ga.attention(q, k, v, causal, scale)
        if new * keys <= 8192 * 12288:  # the fp32 reference's [Hq, L, S] scores: up to ~13 GB
            o_ref, lse_ref = reference(q, k, v, causal, scale)
            row["max_err"] = (o.float() - o_ref).abs().max().item()
            row["lse_err"] = (lse - lse_ref).abs().max().item()
        row["gluon_ms"] = round(time_ms(lambda: ga.attention(q, k, v, causal, scale)), 3)
        row["gluon_tflops"] = round(flop / row["gluon_ms"] / 1e9, 1)
    except Exception as e:  # noqa: BLE001 - a probe reports whatever breaks
        row["error"] = repr(e)[:300]
    if prefix == 0 or not causal:  # torch's cuDNN call aligns a causal mask top-left: squares only
        cudnn = lambda: sdpa.library_attention_with_lse(heads(q), heads(k), heads(v), causal, scale)  # noqa: E731
        if "gluon_ms" in row:
            row["vs_cudnn_err"] = (o.float() - cudnn()[0][0].transpose(0, 1).float()).abs().max().item()
        row["cudnn_ms"] = round(time_ms(cudnn), 3)
        row["cudnn_tflops"] = round(flop / row["cudnn_ms"] / 1e9, 1)
    if flash_attn_varlen_func is not None:
        cu_q = torch.tensor([0, new], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, keys], dtype=torch.int32, device="cuda")
        fa3 = lambda: flash_attn_varlen_func(  # noqa: E731
            q, k, v, new, cu_q, keys, cu_seqlens_k=cu_k, softmax_scale=scale, causal=causal, fa_version=3
        )
        row["fa3_ms"] = round(time_ms(fa3), 3)
        row["fa3_tflops"] = round(flop / row["fa3_ms"] / 1e9, 1)
    return row


def variant() -> str:
    """The variant's name in file names: split, ping-pong, key tile, stages, run, persistent."""
    v = ga.VARIANT
    return f"split{int(v.split)}_pp{int(ga.PINGPONG)}_bn{v.block_n}_st{v.stages}_run{v.run}_pers{int(v.persistent)}"


# --prefix-sweep: the prefix calls (no mask) around the engine's threshold (attention/gluon_calls.py: >= 4096 rows
# over >= 8192 keys), where only 8K rows over 32K / 128K keys had been timed
SWEEP = [
    (new, keys - new, False)
    for new in (2048, 4096, 8192)
    for keys in (4096, 8192, 16384, 32768)
    if keys > new
]


def gpu_check(cases=None, name: str = "") -> None:
    torch.manual_seed(0)
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    rows = []
    for new, prefix, causal in cases or ((1000, 0, True), (8192, 0, True), (32768, 0, True), (8192, 24576, False),
                                         (8192, 122880, False), (3000, 9000, True)):  # fmt: skip
        rows.append(check_case(new, prefix, causal, flash_attn_varlen_func))
        print(json.dumps(rows[-1]), flush=True)
    path = os.path.join(os.environ.get("OUT", "/tmp"), f"gluon_attention_{variant()}{name}.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        compile_only()
    elif "--emulate" in sys.argv:  # the algorithm on the CPU, against fp32
        torch.manual_seed(0)
        for rows, keys, causal, block_n in ((300, 300, True, 128), (200, 700, True, 64), (130, 500, False, 128),
                                            (129, 129, True, 64), (64, 1000, False, 64)):  # fmt: skip
            qkv = [torch.randn(n, h, D).bfloat16() for n, h in ((rows, HQ), (keys, HKV), (keys, HKV))]
            o, lse = emulate(*qkv, causal, D**-0.5, block_n)
            o_ref, lse_ref = reference(*qkv, causal, D**-0.5)
            print(
                json.dumps(
                    {
                        "rows": rows,
                        "keys": keys,
                        "causal": causal,
                        "block_n": block_n,
                        "max_err": (o - o_ref).abs().max().item(),
                        "lse_err": (lse - lse_ref).abs().max().item(),
                    }
                )
            )
    else:
        gpu_check(SWEEP, "_sweep") if "--prefix-sweep" in sys.argv else gpu_check()
