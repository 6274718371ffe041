"""Triton attention on the GPU at serving shapes (bf16/fp16) vs. the torch reference in float32."""

from __future__ import annotations

import random

import pytest
import torch

from longserve.attention import KVCache, TorchAttentionBackend, build_metadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
TOL = 2e-2


def run_step(
    prefix_lens: list[int],
    query_lens: list[int],
    page_size: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    seed: int = 0,
    consecutive: bool = False,
    **backend_kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(triton output in `dtype`, reference output in float32) for one step over scattered pages (each
    request's consecutive, as a fresh pool hands them out, with `consecutive`)."""
    from longserve.attention.triton_backend import TritonAttentionBackend

    torch.manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
    pages_needed = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_needed) + 5
    pool = list(range(num_pages))
    if not consecutive:
        random.Random(seed).shuffle(pool)
    page_tables = []
    for n in pages_needed:
        page_tables.append(pool[:n])
        pool = pool[n:]
    meta = build_metadata(prefix_lens, query_lens, page_tables, page_size, "cuda")
    cache = KVCache(1, num_pages, page_size, NUM_KV_HEADS, HEAD_DIM, dtype, "cuda")
    cache.k[0].normal_()
    cache.v[0].normal_()
    ref_cache = KVCache(1, 1, page_size, NUM_KV_HEADS, HEAD_DIM, torch.float32, "cuda")
    ref_cache.k, ref_cache.v = [cache.k[0].float()], [cache.v[0].float()]
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, NUM_Q_HEADS, HEAD_DIM, device="cuda").to(dtype)  # [T, Hq, D]
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device="cuda").to(dtype)  # [T, Hkv, D]
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device="cuda").to(dtype)  # [T, Hkv, D]
    scale = HEAD_DIM**-0.5

    backend = TritonAttentionBackend(**backend_kwargs)
    out = backend.forward(q, k, v, 0, meta, cache, scale, sliding_window)  # [T, Hq, D]
    expected = TorchAttentionBackend().forward(
        q.float(), k.float(), v.float(), 0, meta, ref_cache, scale, sliding_window
    )  # [T, Hq, D] float32
    torch.cuda.synchronize()
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.equal(cache.k[0].float(), ref_cache.k[0])  # the backend stored the new K/V
    return out, expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [16, 64])
def test_extend_ragged(dtype: torch.dtype, page_size: int) -> None:
    prefix_lens = [0, 8192, 1000, 37, 4096]
    query_lens = [2048, 512, 1, 1000, 1]
    out, expected = run_step(prefix_lens, query_lens, page_size, dtype, cold_path="triton")
    torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)


@pytest.mark.parametrize(
    "prefix_lens,query_lens", [([32768], [64]), ([600], [64]), ([9000, 40000], [48, 64])]
)
def test_wide_short_tile(
    prefix_lens: list[int], query_lens: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the prefix hit's launch with triton_backend.WIDE_SHORT_CHUNKS on (WIDE_SHORT_TILE: 256 rows a kv head on 16
    # warps, keys split to one wave; one split over 600 keys), and two such chunks in one batch, against fp32
    from longserve.attention import triton_backend
    from longserve.attention.triton_backend import TritonAttentionBackend

    monkeypatch.setattr(triton_backend, "WIDE_SHORT_CHUNKS", True)

    group = NUM_Q_HEADS // NUM_KV_HEADS
    seq_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
    cfg, _ = TritonAttentionBackend().extend_launch(
        query_lens, seq_lens, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cuda")
    )
    assert cfg["BLOCK_M"] == (256 if min(query_lens) * group > 128 else 64)
    out, expected = run_step(prefix_lens, query_lens, 16, torch.bfloat16, cold_path="triton")
    torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cold_path", ["sdpa", "triton"])
def test_cold_prompts(dtype: torch.dtype, cold_path: str) -> None:
    out, expected = run_step([0, 0], [2048, 700], 16, dtype, cold_path=cold_path)
    torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("num_splits", [None, 1])
def test_decode_long(dtype: torch.dtype, page_size: int, num_splits: int | None) -> None:
    prefix_lens = [131071, 5000, 16, 0]
    out, expected = run_step(prefix_lens, [1] * 4, page_size, dtype, num_splits=num_splits)
    torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("num_query", [1, 300])
def test_sliding_window(num_query: int) -> None:
    out, expected = run_step([0, 9000, 3000], [num_query] * 3, 16, torch.bfloat16, sliding_window=4096)
    torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)


def test_bench_attention_runs() -> None:
    from longserve.bench.kernels.attention import BenchCase, bench_attention

    cases = [BenchCase("cold_1k", 0, 1024), BenchCase("suffix", 4096, 64), BenchCase("decode_4k", 4095, 1)]
    rows = bench_attention(cases, warmup=1, repeats=2)
    assert [(r["case"], r["impl"]) for r in rows] == [
        ("cold_1k", "triton"),
        ("cold_1k", "sdpa"),
        ("suffix", "triton"),
        ("suffix", "split_sdpa"),
        ("decode_4k", "triton"),
    ]
    assert all(r["ms"] > 0 and r["tflops"] > 0 for r in rows)
    assert rows[-1]["gbps"] > 0


def test_library_paths_run_only_at_built_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the warm-up a cold batch and a long chunk over a prefix run in the Triton kernel; after it,
    at padded shapes, in cuDNN, equal to the reference, and a first call of a built shape does not wait
    for a plan build. Prints what one build costs (the reason for all this)."""
    import time

    import longserve.attention.triton_backend as tb
    from longserve.attention import sdpa_shapes as shapes
    from longserve.attention.base import GraphShape

    calls: list[tuple[int, ...]] = []
    real = tb.prefix_split_sdpa
    monkeypatch.setattr(
        tb, "prefix_split_sdpa", lambda *a, **kw: calls.append(kw["requests"]) or real(*a, **kw)
    )
    # cold; chunks over a prefix (one with a tail); a chunk with a decode and a short chunk beside it
    cases = [([0, 0], [2000, 1500]), ([4096, 6000], [2048, 1800]), ([100, 4096, 300], [1, 2048, 40])]
    monkeypatch.setattr(shapes, "PLANS", shapes.PlanRegistry())
    monkeypatch.setattr(tb, "PLANS", shapes.PLANS)
    for prefix_lens, query_lens in cases:
        out, expected = run_step(prefix_lens, query_lens, 16, torch.bfloat16)
        torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)
    assert calls == []  # nothing built yet: Triton
    # the serving warm-up (runner/warm_up.py calls it): the plans, and the extend-kernel variants the Triton
    # part of a mixed step reaches (its decode and short chunk alone compile a short-tile variant: 1.4 s on
    # an H200, 2026-12-02, when this test warmed up the plans only)
    start = time.perf_counter()
    cache = KVCache(1, 8192 // 16 + 1, 16, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    graph_shape = GraphShape(8192, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cuda"))
    tb.TritonAttentionBackend().warm_up(graph_shape, 2048, cache)
    print(f"warm-up: {len(shapes.warm_up_shapes(2048, 8192))} plans in {time.perf_counter() - start:.2f}s")
    calls.clear()  # the warm-up's own passes went through the library too
    for prefix_lens, query_lens in cases:
        start = time.perf_counter()
        out, expected = run_step(prefix_lens, query_lens, 16, torch.bfloat16)
        took = time.perf_counter() - start
        torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)
        assert took < 1.0, f"{prefix_lens}/{query_lens}: {took:.2f}s"  # (a build would add ~0.3 s a shape)
    assert calls == [(0, 1), (0, 1), (1,)]  # the decode and the short chunk ran in Triton beside it
    q = torch.zeros(3000, 16, HEAD_DIM, dtype=torch.bfloat16, device="cuda")  # a shape nobody built
    from longserve.attention.sdpa import _heads, attention_with_lse

    for label in ("first call (builds)", "second call"):
        torch.cuda.synchronize()
        start = time.perf_counter()
        attention_with_lse(_heads(q), _heads(q[:, :4]), _heads(q[:, :4]), True, 0.1)
        torch.cuda.synchronize()
        print(f"cuDNN plan of a new shape, {label}: {time.perf_counter() - start:.3f}s")


def test_a_chunk_over_an_unaligned_prefix_runs_at_built_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes beside a long prompt take their tokens from the budget, so its second chunk follows chunk - d
    tokens of prefix. The warm-up builds a full chunk over every PREFIX_GRANULE of prefix (before `3a86049`
    only over multiples of the chunk, and such chunks ran in Triton): the chunk, with a decode beside it,
    runs in cuDNN at built shapes, without a build; so does a shorter last chunk, padded to the chunk's rows."""
    import time

    from longserve.attention import sdpa_shapes as shapes
    from longserve.attention import triton_backend as tb
    from longserve.attention.base import GraphShape

    calls: list[tuple[int, ...]] = []
    real = tb.prefix_split_sdpa
    monkeypatch.setattr(
        tb, "prefix_split_sdpa", lambda *a, **kw: calls.append(kw["requests"]) or real(*a, **kw)
    )
    monkeypatch.setattr(shapes, "PLANS", shapes.PlanRegistry())
    monkeypatch.setattr(tb, "PLANS", shapes.PLANS)
    chunk, longest = 4096, 12288
    cache = KVCache(1, longest // 16 + 1, 16, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    graph_shape = GraphShape(
        longest, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cuda")
    )
    tb.TritonAttentionBackend().warm_up(graph_shape, chunk, cache)
    calls.clear()
    for prefix_lens, query_lens in (
        ([chunk - 1, 300], [chunk - 1, 1]),
        ([2 * chunk - 2, 500], [chunk - 1, 1]),
        # a last chunk: its rows padded to the chunk's (PAD_QUERY_MIN_FILL)
        ([2 * chunk - 2, 500], [3000, 1]),
    ):
        start = time.perf_counter()
        out, expected = run_step(prefix_lens, query_lens, 16, torch.bfloat16)
        took = time.perf_counter() - start
        torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)
        assert took < 1.0, f"{prefix_lens}/{query_lens}: {took:.2f}s"  # (a build would add ~0.3 s a shape)
    assert calls == [(0,), (0,), (0,)]  # the chunks in cuDNN, the decodes beside them in Triton


def test_a_lone_prompts_chunks_run_in_pieces_at_built_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone prompt's steps (sched/chunk_size.py): its first of the lone size, then chunks shrinking to the usual one.
    Warm-up for lone steps builds the usual chunk's rows over every prefix (not the lone step's), and the chunks
    between run their prefix part in pieces at those rows (sdpa_shapes.PlanRegistry._pieces): in cuDNN, equal to
    the fp32 reference, without a build mid-step."""
    import time

    from longserve.attention import sdpa_shapes as shapes
    from longserve.attention import triton_backend as tb
    from longserve.attention.base import GraphShape
    from longserve.sched.chunk_size import bounded_lone_chunk

    calls: list[tuple[int, ...]] = []
    real = tb.prefix_split_sdpa

    def split(*args, **kw):  # a chunk over a prefix: its pieces' rows (warm-up's cold calls have none)
        if 0 in kw["query_rows"]:
            calls.append(kw["query_rows"][0])
        return real(*args, **kw)

    monkeypatch.setattr(tb, "prefix_split_sdpa", split)
    monkeypatch.setattr(shapes, "PLANS", shapes.PlanRegistry())
    monkeypatch.setattr(tb, "PLANS", shapes.PLANS)
    chunk, lone, prompt = 2048, 8192, 20000
    cache = KVCache(1, prompt // 16 + 1, 16, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    graph_shape = GraphShape(
        prompt, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cuda")
    )
    tb.TritonAttentionBackend().warm_up(graph_shape, chunk, cache, step_tokens=lone)
    calls.clear()
    done = lone
    while done < prompt - chunk:
        n = bounded_lone_chunk(prompt - done, done, lone, chunk)
        start = time.perf_counter()
        out, expected = run_step([done], [n], 16, torch.bfloat16)
        took = time.perf_counter() - start
        torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)
        assert took < 1.0, f"{done}+{n}: {took:.2f}s"  # (a build would add ~0.3 s a shape)
        done += n
    # every chunk in cuDNN: 3393 new over 8192 in two pieces, 2603 and 2195 in 2048 + 1024, then a usual chunk
    assert calls == [(2048, 2048), (2048, 1024), (2048, 1024), (2048,)], calls


def test_a_short_chunk_over_a_long_prefix_runs_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix hit's question (64 new tokens of the 8B heads over 32K cached keys on consecutive pages, with and
    without a tail) runs in the packed cuDNN call (sdpa.packed_prefix_sdpa) at plans the warm-up built, equal to
    the fp32 reference; beside it a decode runs in Triton; over scattered pages, the Triton kernel. Prints the
    packed plans' build time and one step's time."""
    import time

    from longserve.attention import sdpa_shapes as shapes
    from longserve.attention import triton_backend as tb
    from longserve.attention.base import GraphShape

    calls: list[tuple[int, int]] = []
    real = tb.TritonAttentionBackend._packed

    def packed(self, q, k_cache, v_cache, meta, r, splits, *args):
        calls.append((r, splits))
        return real(self, q, k_cache, v_cache, meta, r, splits, *args)

    monkeypatch.setattr(tb.TritonAttentionBackend, "_packed", packed)
    monkeypatch.setattr(shapes, "PACKED_PREFIX_CALLS", True)
    monkeypatch.setattr(shapes, "PLANS", shapes.PlanRegistry())
    monkeypatch.setattr(tb, "PLANS", shapes.PLANS)
    longest = 40960
    cache = KVCache(1, 16, 16, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    graph_shape = GraphShape(
        longest, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cuda")
    )
    start = time.perf_counter()
    tb.TritonAttentionBackend().warm_up(graph_shape, 2048, cache)
    print(
        f"warm-up with {len(shapes.warm_up_packed_splits(longest))} packed plans: {time.perf_counter() - start:.2f}s"
    )
    calls.clear()
    for prefix_lens, query_lens, packed in (
        ([32768], [64], (0, 16)),
        ([32768 + 100], [40], (0, 16)),  # a tail of 100 keys in the causal part
        ([20000, 3000], [64, 1], (0, 9)),  # a decode beside it: Triton
    ):
        start = time.perf_counter()
        out, expected = run_step(prefix_lens, query_lens, 16, torch.bfloat16, consecutive=True)
        took = time.perf_counter() - start
        torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)
        assert took < 1.0, f"{prefix_lens}/{query_lens}: {took:.2f}s"  # no plan built mid-step
        assert calls[-1] == packed and len(calls) == 1  # one layer, one packed request
        calls.clear()
    out, expected = run_step([32768], [64], 16, torch.bfloat16)  # scattered: the Triton kernel
    torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)
    assert calls == []


def test_split_counts_share_one_compiled_kernel() -> None:
    """The extend and decode kernels take their split count at run time: a serving mix of counts compiles
    one kernel, not one per count (each a second or more of a stalled step)."""
    from longserve.kernels import decode_attention as dec
    from longserve.kernels import extend_attention as ext

    def variants(kernel) -> int:
        return sum(len(caches[0]) for caches in kernel.fn.device_caches.values())

    run_step([8192], [64], 16, torch.bfloat16, num_splits=1)  # decode needs query 1: compile both kinds
    run_step([8192], [1], 16, torch.bfloat16, num_splits=2)
    before = (variants(ext._extend_kernel), variants(dec._decode_split_kernel))
    for splits in (2, 3, 5, 7, 16, 32):
        out, expected = run_step([8192], [64], 16, torch.bfloat16, extend_splits=splits)
        torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)
        out, expected = run_step([8192, 300], [1, 1], 16, torch.bfloat16, num_splits=splits)
        torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)
    after = (variants(ext._extend_kernel), variants(dec._decode_split_kernel))
    assert after[0] - before[0] <= 1 and after[1] == before[1], (before, after)


@pytest.mark.parametrize("batch,context", [(1, 32768), (16, 8192), (64, 4096)])
def test_decode_serial_merge_on_the_gpu(batch: int, context: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode splits merged in the kernel (decode_attention.DECODE_SERIAL_MERGE_MAX_SPLITS, here at every
    split count) at the 8B decode shapes and the engine's split counts: the two-launch output to a bf16 rounding
    step (fp32 sums in another order), the fp32 reference's, again after 50 launches back to back (the counters
    back at zero), from a CUDA graph replayed for new queries, PDL on and off; both paths' times printed."""
    from longserve.kernels import decode_attention as dec
    from longserve.kernels import launch
    from longserve.platform import capture_cuda_graph, cuda_graph_time_ms

    page = 16
    num_pages = batch * context // page + 1
    gen = torch.Generator(device="cuda").manual_seed(batch)
    k_cache = torch.randn(num_pages, page, NUM_KV_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    v_cache = torch.randn(num_pages, page, NUM_KV_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    pages = torch.randperm(num_pages - 1, device="cuda", generator=gen)[: batch * (context // page)] + 1
    table = pages.view(batch, context // page).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    seq_lens[0] = context - 37  # a request whose last split holds fewer keys
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    splits = dec.choose_num_splits(
        context, batch, NUM_KV_HEADS, torch.cuda.get_device_properties(0).multi_processor_count
    )
    assert splits > 1
    monkeypatch.setattr(dec, "DECODE_SERIAL_MERGE_MAX_SPLITS", 0)
    run = lambda: dec.decode_attention(
        q, k_cache, v_cache, seq_lens, table, page, HEAD_DIM**-0.5, None, splits
    )  # noqa: E731
    want = run()
    ref = dec.decode_attention_ref(
        q.float(), k_cache.float(), v_cache.float(), seq_lens, table, page, HEAD_DIM**-0.5, None, splits
    )
    torch.testing.assert_close(want.float(), ref, atol=TOL, rtol=TOL)
    two_launch_us = cuda_graph_time_ms(run, 2, 20, 5) * 1e3
    monkeypatch.setattr(dec, "DECODE_SERIAL_MERGE_MAX_SPLITS", dec.MAX_SPLITS)
    bf16_step = 2**-7  # relative
    for pdl in (False, True):
        monkeypatch.setattr(launch, "PDL", pdl)
        for _ in range(50):
            out = run()
        torch.testing.assert_close(out, want, atol=bf16_step, rtol=bf16_step)
        assert not dec._MERGE_LOCKS[q.device].any()
    outs: dict[str, torch.Tensor] = {}
    graph = capture_cuda_graph(lambda: outs.update(o=run()))
    q.copy_(torch.randn(q.shape, device="cuda", generator=gen))
    monkeypatch.setattr(dec, "DECODE_SERIAL_MERGE_MAX_SPLITS", 0)
    fresh = run()
    monkeypatch.setattr(dec, "DECODE_SERIAL_MERGE_MAX_SPLITS", dec.MAX_SPLITS)
    for _ in range(3):
        graph.replay()
    torch.testing.assert_close(outs["o"], fresh, atol=bf16_step, rtol=bf16_step)
    assert not dec._MERGE_LOCKS[q.device].any()
    serial_us = cuda_graph_time_ms(run, 2, 20, 5) * 1e3
    print(
        f"\ndecode b{batch}@{context} ({splits} splits): kernel + merge {two_launch_us:.1f} us, in-kernel merge {serial_us:.1f} us"
    )


# the wide-head tile (decode_attention.WIDE_HEAD_CONFIG) and candidates of sweep_decode.py --shape qwen3.5
WIDE_TILES = [None, {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}, {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
              {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2}]  # fmt: skip


@pytest.mark.parametrize(
    "cfg", WIDE_TILES, ids=lambda c: "default" if c is None else "-".join(map(str, c.values()))
)
@pytest.mark.parametrize("batch,context", [(1, 32768), (8, 8192)])
def test_decode_wide_heads(batch: int, context: int, cfg: dict | None) -> None:
    """The seed's attention layers at decode (16 query heads on 2 KV heads of 256) over scattered pages, the
    engine's split count, with the wide-head tile and the sweep's candidates: the fp32 reference's output, one
    request shorter than a split."""
    from longserve.kernels import decode_attention as dec

    heads, kv_heads, dim, page = 16, 2, 256, 16
    num_pages = batch * context // page + 1
    gen = torch.Generator(device="cuda").manual_seed(batch + dim)
    k_cache = torch.randn(num_pages, page, kv_heads, dim, device="cuda", generator=gen).bfloat16()
    v_cache = torch.randn(num_pages, page, kv_heads, dim, device="cuda", generator=gen).bfloat16()
    pages = torch.randperm(num_pages - 1, device="cuda", generator=gen)[: batch * (context // page)] + 1
    table = pages.view(batch, context // page).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    seq_lens[-1] = 300
    q = torch.randn(batch, heads, dim, device="cuda", generator=gen).bfloat16()
    splits = dec.choose_num_splits(
        context, batch, kv_heads, torch.cuda.get_device_properties(0).multi_processor_count
    )
    out = dec.decode_attention(
        q, k_cache, v_cache, seq_lens, table, page, dim**-0.5, None, splits, config=cfg
    )
    ref = dec.decode_attention_ref(
        q.float(), k_cache.float(), v_cache.float(), seq_lens, table, page, dim**-0.5, None, splits
    )
    torch.testing.assert_close(out.float(), ref, atol=TOL, rtol=TOL)
