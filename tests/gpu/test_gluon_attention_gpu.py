"""Our Gluon attention kernel (kernels/gluon_attention.py) on an H200: against fp32 attention on the layouts the
engine hands it, and in the engine's split prefill path, where it answers the long prefix calls in cuDNN's place."""

from __future__ import annotations

import pytest
import torch

from longserve.attention import gluon_calls
from longserve.kernels.gluon_attention_reference import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an sm90 GPU",
    ),
]


def _fused_qkv(rows: int, hq: int, hkv: int, d: int = 128):
    """q, k, v as views of one fused [rows, (hq + 2 hkv) d] buffer, as the models' qkv projection writes them."""
    buf = torch.randn(rows, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    q, k, v = buf.split([hq * d, hkv * d, hkv * d], dim=1)
    return q.view(rows, hq, d), k.view(rows, hkv, d), v.view(rows, hkv, d)


@pytest.mark.parametrize(
    "rows,prefix,causal,hq,hkv",
    [
        (1000, 0, True, 32, 8),  # a cold prompt's causal square, a partial last tile
        (300, 900, True, 32, 8),  # bottom-right: new rows over a prefix in one call
        (4096, 8269, False, 32, 8),  # a chunk's prefix call, keys not a multiple of the key tile
        (129, 4000, False, 8, 1),  # a group of 8 q heads on one kv head
        (512, 0, True, 4, 4),  # no grouping
        (5000, 3000, False, 32, 8),  # more tiles than SMs: the persistent programs walk several
        (4096, 0, True, 32, 8),  # causal, 1,024 tiles: the persistent programs' snake order (_tile)
    ],
)
def test_kernel_matches_fp32(rows: int, prefix: int, causal: bool, hq: int, hkv: int) -> None:
    from longserve.kernels import gluon_attention as ga

    torch.manual_seed(0)
    d = 128
    q, k_new, v_new = _fused_qkv(rows, hq, hkv)
    if prefix:  # the prefix on consecutive cache pages, then the chunk's own keys
        pages = torch.randn(2, (prefix + rows + 15) // 16, 16, hkv, d, device="cuda", dtype=torch.bfloat16)
        k, v = (p.flatten(0, 1)[: prefix + rows] for p in pages)
    else:
        k, v = k_new, v_new
    assert ga.fits(q, k, v)
    o, lse = ga.attention(q, k, v, causal, d**-0.5)
    o_ref, lse_ref = reference(q, k, v, causal, d**-0.5)
    assert o.shape == (rows, hq, d) and lse.shape == (hq, rows)
    assert (o.float() - o_ref).abs().max().item() < 2e-2  # bf16 output and P
    assert (lse - lse_ref).abs().max().item() < 1e-3


def test_long_prefix_calls_run_the_kernel_in_the_engines_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4K chunk over a 12K prefix, after the serving warm-up, in the Triton backend's split path, the kernel's
    thresholds lowered to take it (at the engine's, 8K rows over 32K keys, the fp32 reference would need 43 GB): its
    prefix call (4096 rows x 12288 keys) runs in the kernel, its causal part in cuDNN; the step equals fp32
    attention and the step with every call cuDNN's."""
    import longserve.attention.triton_backend as tb
    from longserve.attention import KVCache
    from longserve.attention import sdpa_shapes as shapes
    from longserve.attention.base import GraphShape
    from longserve.kernels import gluon_attention as ga
    from tests.gpu.test_attention_gpu import HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, TOL, run_step

    calls: list[tuple[int, int, bool]] = []
    real = ga.attention
    monkeypatch.setattr(
        ga,
        "attention",
        lambda q, k, v, c, s: calls.append((q.shape[0], k.shape[0], c)) or real(q, k, v, c, s),
    )
    monkeypatch.setattr(gluon_calls, "GLUON_MIN_ROWS", 4096)
    monkeypatch.setattr(gluon_calls, "GLUON_MIN_KEYS", 8192)
    monkeypatch.setattr(shapes, "PLANS", shapes.PlanRegistry())
    monkeypatch.setattr(tb, "PLANS", shapes.PLANS)
    cache = KVCache(1, 16384 // 16 + 1, 16, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    shape = GraphShape(16384, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cuda"))
    tb.TritonAttentionBackend().warm_up(shape, 4096, cache)
    assert calls, "the warm-up built no prefix call in the kernel"
    calls.clear()
    out, expected = run_step([12288], [4096], 16, torch.bfloat16, consecutive=True)
    torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)
    assert calls == [(4096, 12288, False)]
    monkeypatch.setattr(gluon_calls, "GLUON_PREFIX_CALLS", False)
    library, _ = run_step([12288], [4096], 16, torch.bfloat16, consecutive=True)
    assert calls == [(4096, 12288, False)]  # no further call
    assert (out.float() - library.float()).abs().max().item() < 1e-2


def test_a_chunk_at_the_engines_threshold_equals_cudnns(monkeypatch: pytest.MonkeyPatch) -> None:
    """An 8K chunk over a 32K prefix on scattered pages, at the engine's own thresholds (no fp32 reference: 43 GB):
    the split path's step with the kernel taking its prefix call equals the step with cuDNN's, within bf16's noise."""
    import random

    import longserve.attention.triton_backend as tb
    from longserve.attention import KVCache, build_metadata
    from longserve.attention import sdpa_shapes as shapes
    from longserve.attention.base import GraphShape
    from longserve.kernels import gluon_attention as ga
    from tests.gpu.test_attention_gpu import HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS

    calls: list[tuple[int, int]] = []
    real = ga.attention
    monkeypatch.setattr(
        ga, "attention", lambda q, k, v, c, s: calls.append((q.shape[0], k.shape[0])) or real(q, k, v, c, s)
    )
    monkeypatch.setattr(shapes, "PLANS", shapes.PlanRegistry())
    monkeypatch.setattr(tb, "PLANS", shapes.PLANS)
    prefix, new, page = 32768, 8192, 16
    num_pages = (prefix + new) // page + 1
    cache = KVCache(1, num_pages, page, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    shape = GraphShape(
        prefix + new, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cuda")
    )
    backend = tb.TritonAttentionBackend()
    backend.warm_up(shape, new, cache)
    torch.manual_seed(0)
    cache.k[0].normal_()
    cache.v[0].normal_()
    table = list(range(1, num_pages))
    random.Random(0).shuffle(table)  # scattered: the prefix gathered, not a view
    meta = build_metadata([prefix], [new], [table], page, "cuda")
    q = torch.randn(new, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(new, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(new, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    calls.clear()
    ours = backend.forward(q, k, v, 0, meta, cache, HEAD_DIM**-0.5)
    assert calls == [(new, prefix)]
    monkeypatch.setattr(gluon_calls, "GLUON_PREFIX_CALLS", False)
    library = backend.forward(q, k, v, 0, meta, cache, HEAD_DIM**-0.5)
    assert calls == [(new, prefix)]
    assert (ours.float() - library.float()).abs().max().item() < 1e-2


def _paged_case(prefix_lens: list[int], query_lens: list[int], page_size: int, seed: int = 0):
    """q and a bf16 paged cache on scattered pages (page 0 reserved) holding each request's prefix and new tokens."""
    import random

    from tests.gpu.test_attention_gpu import HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS

    g = torch.Generator(device="cuda").manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefix_lens, query_lens)]
    pages = [-(-s // page_size) for s in seq_lens]
    pool = list(range(1, sum(pages) + 1))
    random.Random(seed).shuffle(pool)
    width, tables, at = max(pages), [], 0
    for n in pages:
        tables.append(pool[at : at + n] + [0] * (width - n))
        at += n
    shape = (len(pool) + 1, page_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (torch.randn(shape, generator=g, device="cuda").bfloat16() for _ in range(2))
    q = torch.randn(sum(query_lens), NUM_Q_HEADS, HEAD_DIM, generator=g, device="cuda").bfloat16()
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    ints = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    return q, k_cache, v_cache, ints(starts), ints(prefix_lens), ints(seq_lens), ints(tables)


@pytest.mark.parametrize(
    "prefix_lens,query_lens,page_size,splits",
    [
        ([32768], [64], 16, 32),  # the prefix hit, at the Triton kernel's split count for it
        ([32768], [64], 16, 3),  # splits of many key blocks each
        ([0, 4000, 100], [300, 512, 30], 16, 4),  # a cold chunk, a suffix, a short one; empty splits
        ([2000], [300], 64, 1),  # pages of 64, one split
    ],
)
def test_extend_kernel_matches_fp32(prefix_lens, query_lens, page_size, splits) -> None:
    from longserve.kernels import gluon_extend
    from longserve.kernels.attention_reference import extend_attention_ref

    q, k_cache, v_cache, qsl, pre, seq, pt = _paged_case(prefix_lens, query_lens, page_size)
    args = (qsl, pre, seq, pt, page_size, max(query_lens), q.shape[2] ** -0.5)
    out = gluon_extend.extend_attention(q, k_cache, v_cache, *args, splits)
    ref = extend_attention_ref(q.float(), k_cache, v_cache, *args)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max().item() < 2e-2


def test_the_backend_takes_the_extend_kernel_when_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """gluon_calls.GLUON_EXTEND_CALLS on: a backend built then answers a 64-token chunk over a 32K prefix (the Triton
    extend kernel's shape) with the Gluon kernel, equal to fp32 attention; a fp32 call stays Triton's."""
    import longserve.attention.triton_backend as tb
    from longserve.kernels import gluon_extend
    from tests.gpu.test_attention_gpu import TOL, run_step

    calls: list[int] = []
    real = gluon_extend.extend_attention
    monkeypatch.setattr(
        gluon_extend, "extend_attention", lambda q, *a: calls.append(q.shape[0]) or real(q, *a)
    )
    monkeypatch.setattr(gluon_calls, "GLUON_EXTEND_CALLS", True)
    assert tb.TritonAttentionBackend()._extend is gluon_calls.extend_attention
    out, expected = run_step([32768], [64], 16, torch.bfloat16)
    torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)
    assert calls == [64]
    out, expected = run_step([300], [20], 16, torch.float16)  # not bf16: Triton's
    torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)
    assert calls == [64]


@pytest.mark.parametrize("kernel", ["triton", "gluon"])
@pytest.mark.parametrize("padded", [False, True])
def test_non_finite_values_past_a_requests_end_do_not_reach_its_output(kernel: str, padded: bool) -> None:
    """The slots of a request's last page past its length hold whatever the page's earlier owner wrote: NaN there
    (an earlier request's broken K/V) must not reach this request's attention. The Triton kernel masks those loads;
    the Gluon kernel's first consumer zeroes those V rows once they land (gluon_extend._zero_past_end). padded: one
    request's 17 tokens in a CUDA graph's bucket of 256 (query_start_loc counts 256, seq_lens the 17)."""
    from longserve.kernels import gluon_extend
    from longserve.kernels.attention_reference import extend_attention_ref
    from longserve.kernels.extend_attention import extend_attention

    prefix_lens, query_lens, page_size = ([1000], [17], 16) if padded else ([2000, 300], [37, 20], 64)
    q, k_cache, v_cache, qsl, pre, seq, pt = _paged_case(prefix_lens, query_lens, page_size)
    args = (qsl, pre, seq, pt, page_size, max(query_lens), q.shape[2] ** -0.5)
    ref = extend_attention_ref(q.float(), k_cache, v_cache, *args)
    real = len(q)
    if padded:  # the bucket's padding rows (their outputs are not read) and its page table, as the graph's
        q = torch.cat([q, torch.randn(256 - real, *q.shape[1:], device="cuda").bfloat16()])
        qsl = torch.tensor([0, 256], dtype=torch.int32, device="cuda")
        width = -(-(prefix_lens[0] + 256) // page_size)  # page 0 in the columns past the request's
        pt = torch.nn.functional.pad(pt, (0, width - pt.shape[1]))
        args = (qsl, pre, seq, pt, page_size, 256, q.shape[2] ** -0.5)
    for r, s in enumerate(seq.tolist()):  # NaN in every slot past the request's end in its last page
        last = pt[r, (s - 1) // page_size]
        k_cache[last, s % page_size or page_size :] = float("nan")
        v_cache[last, s % page_size or page_size :] = float("nan")
    if kernel == "gluon":
        out = gluon_extend.extend_attention(q, k_cache, v_cache, *args, 2)
    else:
        out = extend_attention(q, k_cache, v_cache, *args, num_splits=2)
    assert torch.isfinite(out[:real]).all()
    assert (out[:real].float() - ref).abs().max().item() < 2e-2
