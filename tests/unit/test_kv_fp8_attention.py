"""The fp8 (e4m3) KV cache at the attention level: what KVCache stores, the Triton extend/decode kernels
(TRITON_INTERPRET=1 on the CPU: the interpreter loads float8_e4m3fn and widens it in the kernel, so the
kernels themselves run here) against their torch references and the torch backends on the same e4m3 pages,
the split cuDNN/SDPA path's dequantized prefix, and the error against exact K/V bounded by e4m3's precision."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from longserve.attention import KVCache, TorchAttentionBackend, TorchSDPABackend, build_metadata  # noqa: E402
from longserve.attention.kv_quant import (  # noqa: E402
    FP8_KV_DTYPE,
    FP8_MAX,
    dequantize_kv,
    kv_scale_name,
    layer_kv_scales,
    quantize_kv,
)
from longserve.attention.sdpa import prefix_split_sdpa  # noqa: E402
from longserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from longserve.kernels.decode_attention import decode_attention, decode_attention_ref  # noqa: E402
from longserve.kernels.extend_attention import extend_attention, extend_attention_ref  # noqa: E402

E4M3_REL = 2.0**-4  # e4m3 keeps 3 mantissa bits: round-to-nearest is within 2^-4 of a normal value
E4M3_MIN_NORMAL = 2.0**-6
K_SCALE, V_SCALE = 0.02, 0.05  # calibrated-checkpoint-like scales (1.0 is the default)


def test_store_quantizes_with_the_layer_scales_and_saturates():
    cache = KVCache(2, 4, 4, 2, 8, FP8_KV_DTYPE, "cpu")
    cache.set_scales([1.0, K_SCALE], [1.0, V_SCALE])
    g = torch.Generator().manual_seed(0)
    k = torch.randn(5, 2, 8, generator=g)
    v = torch.randn(5, 2, 8, generator=g)
    k[0, 0, 0] = 1e4  # past e4m3's range even at scale 1: saturates to 448, never NaN
    slots = torch.tensor([3, 7, 8, 0, 15])
    for layer in (0, 1):
        cache.store(layer, slots, k, v)
        kc = cache.k[layer].view(-1, 2, 8)[slots]
        assert kc.dtype == FP8_KV_DTYPE and not torch.isnan(kc.float()).any()
        ks = cache.k_scales[layer]
        assert torch.equal(
            kc.view(torch.uint8), (k / ks).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE).view(torch.uint8)
        )
        back, _ = cache.dequantize(layer, kc, kc, torch.float32)
        normal = (k / ks).abs() >= E4M3_MIN_NORMAL
        err = ((back - k).abs() / k.abs())[normal & ((k / ks).abs() <= FP8_MAX)]
        assert err.max() <= E4M3_REL and err.max() > 0  # rounded, within e4m3's precision
    assert cache.k[0].view(-1, 2, 8)[3, 0, 0].float() == FP8_MAX


def test_as_stored_is_what_the_pages_read_back():
    cache = KVCache(1, 2, 4, 1, 4, FP8_KV_DTYPE, "cpu")
    cache.set_scales([K_SCALE], [V_SCALE])
    k, v = torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    cache.store(0, torch.tensor([1, 2, 3]), k, v)
    k_rt, v_rt = cache.as_stored(0, k, v)
    k_pg, v_pg = cache.dequantize(
        0, cache.k[0].view(-1, 1, 4)[1:4], cache.v[0].view(-1, 1, 4)[1:4], torch.float32
    )
    assert torch.equal(k_rt, k_pg) and torch.equal(v_rt, v_pg)


def test_checkpoint_scale_names():
    assert kv_scale_name("model.layers.3.self_attn.k_scale") == (3, "k")
    assert kv_scale_name("model.layers.0.self_attn.v_proj.output_scale") == (0, "v")  # llm-compressor
    assert kv_scale_name("model.layers.12.self_attn.attn.k_scale") == (12, "k")
    assert kv_scale_name("model.layers.1.self_attn.kv_scale") == (1, "kv")  # the older single scale
    assert kv_scale_name("model.layers.1.self_attn.k_proj.weight_scale") is None
    assert kv_scale_name("model.layers.1.mlp.down_proj.output_scale") is None
    assert layer_kv_scales({(0, "k"): 2.0, (1, "kv"): 3.0}, 3) == ([2.0, 3.0, 1.0], [1.0, 3.0, 1.0])


class Fp8Step:
    """A mixed step (cold prompt, extends over a prefix, decode rows) over scattered e4m3 pages whose
    prefix holds values x / scale of the exact K/V `k_full` / `v_full` (kept to bound the error)."""

    def __init__(self, prefix_lens, query_lens, page_size=4, heads=(4, 2), head_dim=32, seed=0):
        g = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        num_q, num_kv = heads
        seq_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
        need = [-(-s // page_size) for s in seq_lens]
        pool = list(range(sum(need) + 3))
        rng.shuffle(pool)
        tables = []
        for n in need:
            tables.append(pool[:n])
            pool = pool[n:]
        self.meta = build_metadata(prefix_lens, query_lens, tables, page_size, "cpu")
        self.shape = (sum(need) + 3, page_size, num_kv, head_dim)
        # exact K/V of every position of every request; the prefix goes into the pages, the rest is "new"
        self.k_full = [torch.randn(s, num_kv, head_dim, generator=g) for s in seq_lens]
        self.v_full = [torch.randn(s, num_kv, head_dim, generator=g) for s in seq_lens]
        self.q = torch.randn(sum(query_lens), num_q, head_dim, generator=g)
        self.k = torch.cat([k[p:] for k, p in zip(self.k_full, prefix_lens)])
        self.v = torch.cat([v[p:] for v, p in zip(self.v_full, prefix_lens)])
        self.tables, self.prefix_lens, self.scale = tables, prefix_lens, head_dim**-0.5

    def cache(self, dtype=FP8_KV_DTYPE) -> KVCache:
        c = KVCache(1, self.shape[0], self.shape[1], self.shape[2], self.shape[3], dtype, "cpu")
        if dtype == FP8_KV_DTYPE:
            c.set_scales([K_SCALE], [V_SCALE])
        page_size = self.shape[1]
        for table, p, k, v in zip(self.tables, self.prefix_lens, self.k_full, self.v_full):
            slots = torch.tensor([table[i // page_size] * page_size + i % page_size for i in range(p)])
            if p:
                c.store(0, slots, k[:p], v[:p])
        return c

    def run(self, backend, cache=None, window=None):
        cache = cache or self.cache()
        return backend.forward(self.q, self.k, self.v, 0, self.meta, cache, self.scale, window), cache


MIXED = ([0, 3, 17, 17, 40], [16, 5, 1, 16, 5])


@pytest.mark.parametrize("window", [None, 7])
def test_triton_extend_backend_reads_fp8_pages_as_the_references(window):
    step = Fp8Step(*MIXED, seed=1)
    expected, ref_cache = step.run(TorchAttentionBackend(), window=window)
    for backend in (
        TritonAttentionBackend(cold_path="triton"),
        TritonAttentionBackend(cold_path="triton", extend_splits=3),
        TorchSDPABackend(),
    ):
        out, cache = step.run(backend, window=window)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
        assert torch.equal(
            cache.k[0].view(torch.uint8), ref_cache.k[0].view(torch.uint8)
        )  # the same bytes stored


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 9])
def test_decode_kernel_on_fp8_pages_equals_its_reference(num_splits, window):
    step = Fp8Step([30, 9, 64], [1, 1, 1], page_size=8, heads=(8, 2), seed=num_splits)
    cache = step.cache()
    m = step.meta
    cache.store(0, m.slot_mapping, step.k, step.v)
    args = (
        step.q,
        cache.k[0],
        cache.v[0],
        m.seq_lens,
        m.page_table,
        m.page_size,
        step.scale,
        window,
        num_splits,
    )
    out = decode_attention(*args, k_scale=K_SCALE, v_scale=V_SCALE)
    ref = decode_attention_ref(*args, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # the backend takes the decode path with the cache's scales; the torch backends agree
    expected, _ = step.run(TorchAttentionBackend(), window=window)
    for backend in (TritonAttentionBackend(), TorchSDPABackend()):
        torch.testing.assert_close(step.run(backend, window=window)[0], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_with_16bit_queries_dots_in_fp16(num_splits, monkeypatch):
    """16-bit queries on e4m3 pages: the kernel widens the pages to fp16 and scales q once (KV_FP8_AS_F16: one
    conversion a pair on sm90), equal to the reference to fp16's rounding of the scaled q and of p, and to the
    path without it (q's dtype, the scale on the scores). fp16 queries: the interpreter's bf16 is wrong on either
    path (the output ~4e7 off); tests/gpu/test_kv_fp8_gpu.py runs bf16."""
    from longserve.kernels import decode_attention as da

    step = Fp8Step([30, 9, 64], [1, 1, 1], page_size=8, heads=(8, 2), seed=7 + num_splits)
    cache = step.cache()
    m = step.meta
    cache.store(0, m.slot_mapping, step.k, step.v)
    q = step.q.half()
    args = (q, cache.k[0], cache.v[0], m.seq_lens, m.page_table, m.page_size, step.scale, None, num_splits)
    out = decode_attention(*args, k_scale=K_SCALE, v_scale=V_SCALE)
    ref = decode_attention_ref(*args, k_scale=K_SCALE, v_scale=V_SCALE)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=2e-3)
    monkeypatch.setattr(da, "KV_FP8_AS_F16", False)
    torch.testing.assert_close(out.float(), decode_attention(*args, k_scale=K_SCALE, v_scale=V_SCALE).float(),
                               atol=2e-3, rtol=2e-3)  # fmt: skip


def test_extend_kernel_direct_with_scales_and_16bit_queries():
    # 16-bit queries: the kernel widens e4m3 to the query's dtype (exact: every e4m3 value is an fp16 and a
    # bf16 value) for 16-bit dots. fp16 here: the interpreter's bf16 dots are wrong with a bf16 cache too
    # (a 16-bit-cache run of this test is off by ~1e8 there); the GPU tests cover bf16
    step = Fp8Step([0, 17, 40], [16, 5, 23], seed=5)
    cache = step.cache()
    m = step.meta
    cache.store(0, m.slot_mapping, step.k, step.v)
    q = step.q.half()
    args = (q, cache.k[0], cache.v[0], m.query_start_loc, m.prefix_lens, m.seq_lens, m.page_table,
            m.page_size, m.max_query_len, step.scale)  # fmt: skip
    for splits in (1, 2):
        out = extend_attention(*args, num_splits=splits, k_scale=K_SCALE, v_scale=V_SCALE)
        ref = extend_attention_ref(*args, k_scale=K_SCALE, v_scale=V_SCALE)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_split_sdpa_path_dequantizes_the_cached_prefix():
    step = Fp8Step([12, 33], [20, 9], seed=3)
    cache = step.cache()
    m = step.meta
    cache.store(0, m.slot_mapping, step.k, step.v)
    k_new, v_new = cache.as_stored(0, step.k, step.v)
    out = prefix_split_sdpa(
        step.q, k_new, v_new, cache.k[0], cache.v[0], m, step.scale,
        lambda a, b: cache.dequantize(0, a, b, step.q.dtype),
    )  # fmt: skip
    expected, _ = step.run(TorchAttentionBackend())
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_fp8_error_against_exact_kv_is_within_e4m3_precision():
    """Attention over e4m3 K/V vs over the exact values, per output row: with every K and V element
    within a relative 2^-4 (normal range) or half a subnormal step times its scale, each score moves by
    at most dS = scale * sum_d |q_d| * dk_d, so the softmax weights by a factor within e^(+-2 dS) and the
    output by at most max|v| (e^(2 dS_max) - 1) + max dv."""
    step = Fp8Step(*MIXED, heads=(2, 2), seed=7)
    out_fp8, _ = step.run(TorchAttentionBackend())
    exact, _ = step.run(TorchAttentionBackend(), cache=step.cache(torch.float32))
    group, row = 1, 0
    for r, (p, q_len) in enumerate(zip(step.prefix_lens, step.meta.query_lens_cpu)):
        k, v = step.k_full[r], step.v_full[r]  # [S, Hkv, D]
        dk = torch.maximum(k.abs() * E4M3_REL, torch.full_like(k, 2.0**-10 * K_SCALE))
        dv = torch.maximum(v.abs() * E4M3_REL, torch.full_like(v, 2.0**-10 * V_SCALE))
        for i in range(q_len):
            q = step.q[row + i]  # [Hq, D]
            seen = p + i + 1
            ds = step.scale * (
                q.abs()[:, None, :] * dk[:seen].transpose(0, 1).repeat_interleave(group, 0)
            ).sum(-1)
            vmax = v[:seen].abs().amax(dim=(0, 2)).repeat_interleave(group)  # [Hq]
            bound = vmax * (torch.exp(2 * ds.amax(-1)) - 1) + dv[:seen].amax(dim=(0, 2)).repeat_interleave(
                group
            )
            err = (out_fp8[row + i] - exact[row + i]).abs().amax(-1)  # [Hq]
            assert (err <= bound).all(), (r, i, err, bound)
        row += q_len
    assert (out_fp8 - exact).abs().max() > 1e-4  # the cache really rounded


def test_quantize_roundtrip_is_exact_for_e4m3_values():
    x = torch.arange(256, dtype=torch.uint8).view(FP8_KV_DTYPE).float()
    x = x[~torch.isnan(x)]
    assert torch.equal(dequantize_kv(quantize_kv(x, 1.0), 1.0, torch.float32), x)
    assert torch.equal(dequantize_kv(quantize_kv(x, 1.0), 1.0, torch.bfloat16).float(), x)
