"""The attention and fused-MoE kernels' launches at the GPU's tiles (longserve/testing/gpu_tiles.py), built from
interpreted launches for CI's sm90 compile check. Attention: bf16 tensors, the GPU's config functions' tiles for
every built-in head shape, float32 workspaces kept. MoE: default_moe_config's and the shipped tables' tiles, with
the constexprs that follow from a tile as moe_gemm sets them. Each compiles for sm90."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from longserve.testing import gpu_tiles, kernel_compile  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="records interpreted launches"
)


def _interpreted_launches() -> list[dict]:
    """One split decode, one unsplit decode and one extend launch, float32, at the interpreter's tiles (a head dim
    of 48 and pages of 8: this test's records among those other tests in the process left)."""
    from longserve.attention.base import KVCache
    from longserve.attention.metadata import build_step_tensors
    from longserve.kernels.decode_attention import decode_attention
    from longserve.kernels.extend_attention import extend_attention

    kernel_compile.record_launches()
    d, heads, kv_heads, page = 48, 4, 2, 8
    cache = KVCache(1, 8, page, kv_heads, d, torch.float32, "cpu")
    cache.k[0].normal_(), cache.v[0].normal_()
    q = torch.randn(2, heads, d)
    meta, _ = build_step_tensors([5, 19], [1, 1], [[0], [2, 3, 4]], page, "cpu")
    for splits in (1, 2):
        decode_attention(
            q, cache.k[0], cache.v[0], meta.seq_lens, meta.page_table, page, d**-0.5, None, splits
        )
    extend_attention(q, cache.k[0], cache.v[0], torch.tensor([0, 1, 2], dtype=torch.int32),
                     meta.seq_lens - 1, meta.seq_lens, meta.page_table, page, 1, d**-0.5)  # fmt: skip
    mine = [
        r for r in kernel_compile._RECORDS.values() if r["name"] in ("_decode_split_kernel", "_extend_kernel")
    ]
    return [r for r in mine if (r["constexprs"]["HEAD_DIM"], r["constexprs"]["PAGE_SIZE"]) == (d, page)]


def test_the_gpu_variants_are_the_gpus_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    records = _interpreted_launches()
    assert {(r["name"], r["constexprs"]["SPLIT"]) for r in records} >= {
        ("_decode_split_kernel", True), ("_decode_split_kernel", False), ("_extend_kernel", False)
    }  # fmt: skip
    assert all(r["constexprs"].get("BLOCK_N") == 16 for r in records)  # the interpreter's tiles
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the config functions answer as on the GPU
    from longserve.attention import triton_backend as tb
    from longserve.kernels.decode_attention import decode_config
    from longserve.kernels.extend_attention import extend_config

    variants = gpu_tiles.gpu_variants(records)
    shapes = gpu_tiles.head_shapes()
    assert (128, 4) in shapes and (256, 8) in shapes  # Llama-3.1-8B's and Qwen3.5-35B-A3B's
    for v in variants:
        c, sig, head_dim = v["constexprs"], v["signature"], v["constexprs"]["HEAD_DIM"]
        assert sig["q_ptr"] == sig["k_cache_ptr"] == "*bf16" and c["DOT_PRECISION"] == "tf32"
        tile = {k: c[k] for k in c if k in ("BLOCK_M", "BLOCK_N")} | v["options"]
        if v["name"] == "_decode_split_kernel":
            assert tile in [decode_config(head_dim, torch.bfloat16, n) for n in (1, 10**6)]
            assert sig["mid_o_ptr"] == ("*fp32" if c["SPLIT"] else "*bf16")  # the partials stay float32
        else:
            plain = extend_config(head_dim, torch.bfloat16)
            if head_dim <= tb.SHORT_TILES_MAX_HEAD_DIM:  # a key split's warps (records of other tests split)
                long = {**plain, "num_warps": tb.KEY_SPLIT_WARPS} if c["SPLIT"] else plain
                assert tile in [long, *(tb.short_chunk_config(plain, wide) for wide in (False, True))]
            else:
                assert tile == plain
    decode_tiles = {(v["constexprs"]["HEAD_DIM"], v["constexprs"]["BLOCK_N"], v["options"]["num_warps"])
                    for v in variants if v["name"] == "_decode_split_kernel"}  # fmt: skip
    assert {(128, 64, 2), (128, 64, 4), (256, 32, 8)} <= decode_tiles  # few programs, many, the wide head
    extend_rows = {(v["constexprs"]["HEAD_DIM"], v["constexprs"]["BLOCK_M"]) for v in variants
                   if v["name"] == "_extend_kernel"}  # fmt: skip
    assert {(128, 64), (128, 128), (128, 256), (256, 64)} <= extend_rows


def test_the_gpu_variants_compile_for_sm90(tmp_path) -> None:
    """Through the check's own entry point: the launches at the GPU's tiles are compiled after the records."""
    if kernel_compile.sm90_compiler_missing():
        pytest.skip(kernel_compile.sm90_compiler_missing())
    path = tmp_path / "records.jsonl"
    # and the block-FP8 experts' gate+up GEMM (at the H200 table's tiles among others)
    fp8_up = [
        r
        for r in _interpreted_moe_launches()
        if r["constexprs"]["WEIGHT_QUANT"] == 2 and r["constexprs"]["SILU_AND_MUL"]
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in _interpreted_launches() + fp8_up[:1]))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": root}
    done = subprocess.run([sys.executable, "-m", "longserve.testing.kernel_compile", str(path)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=root)  # fmt: skip
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    tiles = [r for r in results if r.get("tile")]
    assert done.returncode == 0 and all(r["ok"] for r in results), done.stdout[-3000:] + done.stderr[-2000:]
    assert len(tiles) >= 6 and all(r["regs"] > 0 for r in tiles), tiles
    assert any(r["tile"].startswith("moe fp8_e4m3") and '"num_warps": 8' in r["tile"] for r in tiles), tiles


def _interpreted_moe_launches() -> list[dict]:
    """The fused MoE GEMM's gate+up and down launches, bf16 activations, on bf16, block-FP8 (16 x 16 scale blocks)
    and GPTQ-int4 experts (groups of 32), at the interpreter's 16-wide tiles."""
    from longserve.kernels import moe_gemm
    from longserve.kernels.fused_moe import fused_moe
    from longserve.kernels.moe_reference import MoEQuant, route_topk
    from longserve.kernels.quant_fp8 import FP8_DTYPE

    kernel_compile.record_launches()
    g = torch.Generator().manual_seed(0)
    e, h, i = 4, 64, 32
    x = torch.randn(5, h, generator=g).bfloat16()
    weights, ids = route_topk(torch.randn(5, e, generator=g), 2, True)
    # GROUP_M 3 (no other test's) marks this function's records among the process's
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 3, "num_warps": 4, "num_stages": 1}
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    fused_moe(x, w13.bfloat16(), w2.bfloat16(), weights.bfloat16(), ids, config=cfg)
    s13, s2 = (
        torch.rand(e, 2 * i // 16, h // 16, generator=g) / 20,
        torch.rand(e, h // 16, i // 16, generator=g) / 20,
    )
    fp8 = MoEQuant("fp8_e4m3", 16, s13, s2, block_n=16)
    fused_moe(x, w13.to(FP8_DTYPE), w2.to(FP8_DTYPE), weights.bfloat16(), ids, quant=fp8, config=cfg)
    packed13 = torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, generator=g)
    packed2 = torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8, generator=g)
    int4 = MoEQuant(
        "int4",
        32,
        torch.rand(e, 2 * i, h // 32, generator=g) / 20,
        torch.rand(e, h, i // 32, generator=g) / 20,
    )
    fused_moe(x, packed13, packed2, weights.bfloat16(), ids, quant=int4, config=cfg)
    key = (moe_gemm.__name__, "_moe_gemm_kernel")
    return [
        r
        for r in kernel_compile._RECORDS.values()
        if (r["module"], r["name"]) == key and r["constexprs"]["GROUP_M"] == 3
    ]


def test_the_moe_variants_are_fused_moes_gpu_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    records = _interpreted_moe_launches()
    kinds = {(r["constexprs"]["WEIGHT_QUANT"], r["constexprs"]["SILU_AND_MUL"]) for r in records}
    assert kinds >= {(q, up) for q in (0, 1, 2) for up in (True, False)}, kinds
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # default_moe_config answers as on the GPU
    from longserve.kernels.moe_config import CONFIG_DIR, default_moe_config, load_table

    variants = [v for v in gpu_tiles.gpu_variants(records) if v["name"] == "_moe_gemm_kernel"]
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
    for v in variants:
        c = v["constexprs"]
        quant, weights = c["WEIGHT_QUANT"], v["tile"].split(" ")[1]
        assert weights == {0: "bfloat16", 1: "int4", 2: "fp8_e4m3"}[quant]
        configs = [default_moe_config(128, 768, 2048, 8, torch.bfloat16, t) for t in (64, 1024, 8192)]
        configs += [
            cfg for p in CONFIG_DIR.glob(f"*dtype={weights}.json") for cfg in load_table(str(p)).values()
        ]
        if not c["SILU_AND_MUL"]:  # the down GEMM: its own tile where the config has one, the rows shared
            configs = [{**cfg, **cfg.get("down", {}), "BLOCK_M": cfg["BLOCK_M"]} for cfg in configs]
        tile = {k: c[k] for k in keys[:4]} | v["options"]
        # fused_moe._fit_block_k: a K tile within one 128-wide group
        assert tile in [
            {**{k: cfg[k] for k in keys}, "BLOCK_K": min(cfg["BLOCK_K"], 128)} for cfg in configs
        ], tile
        assert v["signature"]["c_ptr"] == "*bf16" and c["ACT_KIND"] == (1 if quant == 2 else 0)
        if quant == 2:  # block FP8 as the official checkpoints: 128 x 128 scale blocks
            assert c["BLOCK_N_SCALE"] == 128 and c["GROUP_BLOCKS"] == 128 // c["BLOCK_K"]
            assert c["SCALAR_B_SCALE"] == (128 % c["BLOCK_N"] == 0) and c["FP32_DOT"] == (c["BLOCK_K"] < 32)
    fp8_prefill = load_table(str(CONFIG_DIR / "E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_e4m3.json"))[
        8192
    ]
    seen = {(v["constexprs"]["WEIGHT_QUANT"], v["constexprs"]["SILU_AND_MUL"], v["constexprs"]["BLOCK_M"],
             v["constexprs"]["BLOCK_N"], v["options"]["num_warps"]) for v in variants}  # fmt: skip
    assert (2, True, 64, 128, 8) in seen and (0, True, 128, 128, 8) in seen, (
        seen
    )  # the tables' and default's prefill
    assert fp8_prefill["BLOCK_M"] == 64 and fp8_prefill["num_warps"] == 8
