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
