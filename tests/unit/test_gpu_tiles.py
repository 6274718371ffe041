"""The attention kernels' launches at the GPU's tiles (longserve/testing/gpu_tiles.py), built from interpreted
float32 launches for CI's sm90 compile check: bf16 tensors, the GPU's config functions' tiles for every built-in
head shape, float32 workspaces kept, and each one compiles for sm90."""

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
    path.write_text("".join(json.dumps(r) + "\n" for r in _interpreted_launches()))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": root}
    done = subprocess.run([sys.executable, "-m", "longserve.testing.kernel_compile", str(path)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=root)  # fmt: skip
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    tiles = [r for r in results if r.get("tile")]
    assert done.returncode == 0 and all(r["ok"] for r in results), done.stdout[-3000:] + done.stderr[-2000:]
    assert len(tiles) >= 6 and all(r["regs"] > 0 for r in tiles), tiles
