"""Triton attention kernels (under TRITON_INTERPRET=1 on the CPU) vs. the torch reference backend."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from longserve.attention import (  # noqa: E402
    ATTENTION_BACKEND_CLASSES,
    AttentionMetadata,
    GraphShape,
    KVCache,
    TorchAttentionBackend,
    attention_backend_class,
    build_metadata,
    get_attention_backend,
    triton_backend,
)
from longserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from longserve.kernels.decode_attention import choose_num_splits, decode_attention, decode_attention_ref  # noqa: E402
from longserve.kernels.extend_attention import (  # noqa: E402
    choose_extend_splits,
    extend_attention,
    extend_attention_ref,
    extend_config,
    merge_splits,
)
from longserve.platform import ATTENTION_BACKENDS  # noqa: E402

HEADS = [(4, 2), (2, 2)]  # (Hq, Hkv)
ATOL = 1e-4


class Step:
    """One random step: scattered pages holding noise, prefix K/V already in them, new q/k/v to store."""

    def __init__(
        self,
        prefix_lens: list[int],
        query_lens: list[int],
        page_size: int,
        heads: tuple[int, int],
        head_dim: int,
        seed: int,
        contiguous: bool = False,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        num_q_heads, num_kv_heads = heads
        seq_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
        pages_needed = [-(-s // page_size) for s in seq_lens]
        num_pages = sum(pages_needed) + 3  # spare pages of noise catch wrong-page reads
        pool = list(range(num_pages))
        if (
            contiguous
        ):  # each request's pages consecutive ids (after a noise page), as a lone prompt gets them
            pool = pool[1:] + pool[:1]
        else:
            rng.shuffle(pool)
        page_tables = []
        for n in pages_needed:
            page_tables.append(pool[:n])
            pool = pool[n:]
        self.meta: AttentionMetadata = build_metadata(prefix_lens, query_lens, page_tables, page_size, "cpu")
        self.cache = KVCache(1, num_pages, page_size, num_kv_heads, head_dim, torch.float32, "cpu")
        self.cache.k[0].copy_(torch.randn(self.cache.k[0].shape, generator=gen))
        self.cache.v[0].copy_(torch.randn(self.cache.v[0].shape, generator=gen))
        num_tokens = sum(query_lens)
        self.q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen)  # [T, Hq, D]
        self.k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)  # [T, Hkv, D]
        self.v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)  # [T, Hkv, D]
        self.scale = head_dim**-0.5

    def clone_cache(self) -> KVCache:
        cache = KVCache(1, 1, 1, 1, 1, torch.float32, "cpu")
        cache.k, cache.v = [self.cache.k[0].clone()], [self.cache.v[0].clone()]
        return cache

    def run(self, backend: object, sliding_window: int | None = None) -> tuple[torch.Tensor, KVCache]:
        cache = self.clone_cache()
        out = backend.forward(self.q, self.k, self.v, 0, self.meta, cache, self.scale, sliding_window)
        return out, cache  # [T, Hq, D]

    def compare(self, backend: object, sliding_window: int | None = None) -> None:
        out, cache = self.run(backend, sliding_window)
        expected, ref_cache = self.run(TorchAttentionBackend(), sliding_window)
        assert out.shape == expected.shape and out.dtype == expected.dtype
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=ATOL)
        assert torch.equal(cache.k[0], ref_cache.k[0]) and torch.equal(cache.v[0], ref_cache.v[0])


def random_lengths(seed: int, num_reqs: int, prefills: bool = True) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    prefix_lens = [rng.choice([0, 3, 17]) for _ in range(num_reqs)]
    query_lens = [rng.choice([1, 5, 16]) for _ in range(num_reqs)]
    if prefills and max(query_lens) == 1:
        query_lens[0] = 16  # keep the step off the decode path
    return prefix_lens, query_lens


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_dim", [16, 32])
def test_extend_backend_matches_torch(page_size: int, heads: tuple[int, int], head_dim: int) -> None:
    seed = page_size * 100 + heads[0] * 10 + head_dim
    step = Step(*random_lengths(seed, num_reqs=3), page_size, heads, head_dim, seed)
    step.compare(TritonAttentionBackend(cold_path="triton"))


def test_every_length_mix_in_one_batch() -> None:
    # cold prompts, extends over a prefix and decode rows (query_len 1) all in one extend launch
    prefix_lens, query_lens = [0, 3, 17, 17, 40], [16, 5, 1, 16, 5]
    step = Step(prefix_lens, query_lens, 4, (4, 2), 16, seed=1)
    step.compare(TritonAttentionBackend(cold_path="sdpa"))  # has prefixes, so sdpa is not taken


def test_a_gluon_extend_build_failure_leaves_the_calls_to_triton(monkeypatch, caplog) -> None:
    """The Gluon extend kernel's first call on a device builds it (GLUON_EXTEND_CALLS): if that fails, the call and
    every later one on the device are the Triton kernel's, with a warning, not an error inside a step."""
    import logging

    from longserve.attention import gluon_calls
    from longserve.kernels import gluon_extend

    step = Step([0, 17, 40], [16, 5, 23], 16, (4, 2), 32, seed=3)
    meta = step.meta
    step.cache.store(0, meta.slot_mapping, step.k, step.v)
    args = (
        step.q, step.cache.k[0], step.cache.v[0], meta.query_start_loc, meta.prefix_lens, meta.seq_lens,
        meta.page_table, meta.page_size, meta.max_query_len, step.scale,
    )  # fmt: skip
    builds = []

    def build_fails(*a, **kw):
        builds.append(1)
        raise RuntimeError("no sm90 build here")

    monkeypatch.setattr(gluon_calls, "_extend_runs", lambda *a: True)  # as on an H200
    monkeypatch.setattr(gluon_calls, "_EXTEND_BUILT", {})
    monkeypatch.setattr(gluon_extend, "extend_attention", build_fails)
    expected = extend_attention(*args)
    with caplog.at_level(logging.WARNING, logger=gluon_calls.logger.name):
        outs = [gluon_calls.extend_attention(*args) for _ in range(2)]
    assert builds == [1] and gluon_calls._EXTEND_BUILT == {None: False}  # tried once on the device
    for out in outs:
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert (
        "the Gluon extend kernel did not build (no sm90 build here): extend calls stay Triton's"
        in caplog.text
    )


@pytest.mark.parametrize(
    "block_m,block_n,num_splits", [(32, 16, 1), (16, 32, 1), (64, 16, 1), (16, 16, 3), (256, 64, 3)]
)
def test_extend_tile_shapes_and_splits(block_m: int, block_n: int, num_splits: int) -> None:
    # unmasked/masked key-range boundaries move with the tiles and the key splits; rows of a block span
    # several tokens; with splits, some (row block, split) programs see no key at all
    step = Step([0, 17, 40], [16, 5, 23], 4, (4, 2), 32, seed=block_m + block_n)
    meta = step.meta
    k_cache, v_cache = step.cache.k[0], step.cache.v[0]
    step.cache.store(0, meta.slot_mapping, step.k, step.v)
    for window in (None, 7, 20):
        args = (
            step.q, k_cache, v_cache, meta.query_start_loc, meta.prefix_lens, meta.seq_lens, meta.page_table,
            meta.page_size, meta.max_query_len, step.scale, window,
        )  # fmt: skip
        config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 1}
        out = extend_attention(*args, config=config, num_splits=num_splits)
        torch.testing.assert_close(out, extend_attention_ref(*args), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("sliding_window", [1, 5, 20])
def test_extend_sliding_window(sliding_window: int) -> None:
    step = Step([0, 17, 40], [16, 5, 16], 4, (4, 2), 16, seed=sliding_window)
    step.compare(TritonAttentionBackend(cold_path="triton"), sliding_window)
    step.compare(TritonAttentionBackend(cold_path="triton", extend_splits=2), sliding_window)


@pytest.mark.parametrize("heads", HEADS)
def test_extend_split_keys(heads: tuple[int, int]) -> None:
    # a short suffix over a longer prefix: the case split-K exists for
    step = Step([40, 17, 3], [5, 1, 16], 1, heads, 32, seed=heads[0])
    step.compare(TritonAttentionBackend(cold_path="triton", extend_splits=4))


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_backend_matches_torch(page_size: int, heads: tuple[int, int], num_splits: int | None) -> None:
    seed = page_size * 10 + heads[1] + (num_splits or 0)
    prefix_lens = [0, 3, 17][: 1 + seed % 3] + [40]
    step = Step(prefix_lens, [1] * len(prefix_lens), page_size, heads, 32, seed)
    step.compare(TritonAttentionBackend(num_splits=num_splits))


@pytest.mark.parametrize("sliding_window", [1, 6, 30])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_sliding_window(sliding_window: int, num_splits: int) -> None:
    step = Step([3, 17, 40], [1, 1, 1], 4, (4, 2), 16, seed=sliding_window)
    step.compare(TritonAttentionBackend(num_splits=num_splits), sliding_window)


def test_decode_more_splits_than_keys() -> None:
    # most splits of the short requests are empty; the merge must weigh them 0
    step = Step([0, 2, 40], [1, 1, 1], 16, (4, 2), 16, seed=3)
    meta = step.meta
    step.cache.store(0, meta.slot_mapping, step.k, step.v)
    k_cache, v_cache = step.cache.k[0], step.cache.v[0]
    out = decode_attention(
        step.q, k_cache, v_cache, meta.seq_lens, meta.page_table, meta.page_size, step.scale, None, 8
    )
    expected = extend_attention_ref(
        step.q, k_cache, v_cache, meta.query_start_loc, meta.prefix_lens, meta.seq_lens, meta.page_table,
        meta.page_size, 1, step.scale,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_decode_serial_merge_equals_the_merge_launch(monkeypatch, sliding_window) -> None:
    """decode_attention.DECODE_SERIAL_MERGE_MAX_SPLITS: each (request, kv head)'s last split program merges the partials
    in the kernel, and no merge kernel runs: the two-launch output to fp32 rounding (the splits are summed in
    order there, in a tree here), the reference's, the counters back at zero after every launch, empty splits
    (more splits than a short request has keys) weighed 0. fp32 (the interpreter's bf16 dots are not the
    GPU's; tests/gpu/test_attention_gpu.py has bf16)."""
    from longserve.kernels import decode_attention as da

    step = Step([0, 2, 40, 100], [1, 1, 1, 1], 4, (4, 2), 16, seed=7)
    meta = step.meta
    step.cache.store(0, meta.slot_mapping, step.k, step.v)
    k_cache, v_cache = step.cache.k[0], step.cache.v[0]
    args = (step.q, k_cache, v_cache, meta.seq_lens, meta.page_table, meta.page_size, step.scale)
    monkeypatch.setattr(da, "DECODE_SERIAL_MERGE_MAX_SPLITS", 0)
    two = decode_attention(*args, sliding_window, 8)
    ref = decode_attention_ref(*args, sliding_window, 8)
    monkeypatch.setattr(da, "DECODE_SERIAL_MERGE_MAX_SPLITS", 8)
    monkeypatch.setattr(da, "merge_splits", lambda *a: pytest.fail("the merge kernel ran"))
    for _ in range(3):  # the counters a launch leaves serve the next
        one = decode_attention(*args, sliding_window, 8)
        torch.testing.assert_close(one, two, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(one, ref, atol=ATOL, rtol=ATOL)
        assert int(da._MERGE_LOCKS[torch.device("cpu")].count_nonzero()) == 0
    monkeypatch.setattr(da, "MERGE_LOCKS", 4)  # 4 requests x 2 kv heads: more pairs than counters
    monkeypatch.setattr(da, "merge_splits", merge_splits)
    torch.testing.assert_close(decode_attention(*args, sliding_window, 8), two, atol=0, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_decode_kernel_matches_its_reference(num_splits: int, sliding_window: int | None) -> None:
    """decode_attention against decode_attention_ref (same signature), which matches the torch backend."""
    step = Step([0, 5, 17, 40], [1, 1, 1, 1], 4, (4, 2), 16, seed=20 + num_splits)
    meta = step.meta
    backend_out, cache = step.run(TorchAttentionBackend(), sliding_window)  # stores the new K/V
    args = (
        step.q, cache.k[0], cache.v[0], meta.seq_lens, meta.page_table, meta.page_size, step.scale,
        sliding_window, num_splits,
    )  # fmt: skip
    expected = decode_attention_ref(*args)
    torch.testing.assert_close(expected, backend_out, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(decode_attention(*args), expected, atol=ATOL, rtol=ATOL)


def test_graph_capture_hooks_fix_the_launch() -> None:
    """What decode and prefill graphs capture with: a split count fixed per batch size (decode) and the
    extend kernel with the split count planned for the longest context (prefill), never the cuDNN paths."""
    backend = TritonAttentionBackend(num_sms=132)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    shape = GraphShape(32768, 32, 8, 128, bf16, cuda)
    assert backend.supports_cuda_graphs and not TorchAttentionBackend.supports_cuda_graphs
    splits = {bs: backend.prepare_for_capture(bs, shape).num_splits for bs in (1, 8, 128)}
    assert splits == {bs: choose_num_splits(32768, bs, 8, 132) for bs in (1, 8, 128)}
    assert splits[1] > splits[128]  # a lone request spreads its keys; a full batch fills the chip alone
    for tokens in (16, 64, 256):
        planned = backend.prepare_for_extend_capture(tokens, shape)
        assert isinstance(planned, TritonAttentionBackend) and planned.cold_path == "triton"
        assert planned.extend_splits == backend.extend_launch([tokens], [32768], 32, 8, 128, bf16, cuda)[1]
    assert backend.prepare_for_extend_capture(16, shape).extend_splits > 1
    with pytest.raises(NotImplementedError, match="torch"):
        TorchAttentionBackend().prepare_for_capture(1, shape)


@pytest.mark.parametrize("heads", HEADS)
def test_cold_sdpa_path(heads: tuple[int, int]) -> None:
    step = Step([0, 0, 0], [16, 5, 1], 4, heads, 16, seed=heads[1])
    step.compare(TritonAttentionBackend(cold_path="sdpa"))
    step.compare(TritonAttentionBackend(cold_path="triton"))
    step.compare(TritonAttentionBackend(cold_path="sdpa"), sliding_window=4)  # window -> triton kernel


def test_choose_num_splits() -> None:
    assert choose_num_splits(131072, 1, 8, 132) >= 32  # one long request spreads over the chip
    assert choose_num_splits(128, 1, 8, 132) == 1  # short: no split
    assert choose_num_splits(32768, 256, 8, 132) == 1  # a full batch fills the chip by itself
    # extend: a 64-token question over a 32K document gets split; an 8K chunk fills the chip alone
    assert choose_extend_splits([64], [32832], 32, 8, 128, 132) >= 8
    assert choose_extend_splits([8192], [8192 + 122880], 32, 8, 128, 132) == 1
    assert choose_extend_splits([64], [128], 32, 8, 128, 132) == 1


def test_extend_launch_tiles_and_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    # what the backend launches (and the prefill graphs fix their grid to): on a 16-bit GPU run, 64-row
    # tiles for a short chunk, keys split with 4 warps; a long chunk keeps the default tiles, unsplit;
    # float32 (or CPU) keeps the default tiles whatever the length
    backend = TritonAttentionBackend(num_sms=132)
    cuda, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    default = extend_config(128, bf16)
    cfg, splits = backend.extend_launch([16], [32784], 32, 8, 128, bf16, cuda)
    assert (cfg["BLOCK_M"], cfg["num_warps"]) == (64, 4)
    assert splits == choose_extend_splits([16], [32784], 32, 8, 64, 132) > 1
    # the prefix hit (64 new x 4 q heads = 256 rows a kv head, alone), with the wide tile on: one 256-row tile a kv
    # head on 16 warps, keys split to one wave of the chip's 132 SMs (8 kv heads x 16 splits), at 32K as at 128K
    monkeypatch.setattr(triton_backend, "WIDE_SHORT_CHUNKS", False)
    cfg, _ = backend.extend_launch([64], [32832], 32, 8, 128, bf16, cuda)
    assert (cfg["BLOCK_M"], cfg["num_warps"]) == (64, 4)  # switched off: the 64-row tiles
    monkeypatch.setattr(triton_backend, "WIDE_SHORT_CHUNKS", True)
    for context in (32832, 131136):
        cfg, splits = backend.extend_launch([64], [context], 32, 8, 128, bf16, cuda)
        assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], splits) == (256, 64, 16, 16)
    assert choose_extend_splits([64], [32832], 32, 8, 256, 132, one_wave=True) == 16
    assert cfg["num_stages"] == triton_backend.SHORT_CHUNK_STAGES  # unless the tile carries its own
    monkeypatch.setattr(
        triton_backend, "WIDE_SHORT_TILE", {**triton_backend.WIDE_SHORT_TILE, "num_stages": 2}
    )
    cfg, _ = backend.extend_launch([64], [32832], 32, 8, 128, bf16, cuda)
    assert (cfg["BLOCK_M"], cfg["num_stages"]) == (256, 2)
    # and at least 1,024 keys a split
    assert choose_extend_splits([64], [2048], 32, 8, 256, 132, one_wave=True) == 2
    # a decode beside it would fill 4 of 256 rows: the batch keeps the 64-row tiles, as does a chunk of 32 tokens
    for query_lens in ([64, 1], [32]):
        cfg, _ = backend.extend_launch(query_lens, [32832] * len(query_lens), 32, 8, 128, bf16, cuda)
        assert (cfg["BLOCK_M"], cfg["num_warps"]) == (64, 4), query_lens
    cfg, splits = backend.extend_launch([8192], [131072], 32, 8, 128, bf16, cuda)
    assert (cfg, splits) == (default, 1)
    cfg, splits = backend.extend_launch([64], [32832], 32, 8, 128, torch.float32, cpu)
    assert cfg == extend_config(128, torch.float32) and splits == choose_extend_splits(
        [64], [32832], 32, 8, cfg["BLOCK_M"], 132
    )
    assert (
        TritonAttentionBackend(num_sms=132, extend_splits=3).extend_launch(
            [64], [32832], 32, 8, 128, bf16, cuda
        )[1]
        == 3
    )  # a fixed split count wins


def test_registry_and_errors() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # no GPU needed: nothing touches the device
    backend = get_attention_backend("triton", cuda)
    assert isinstance(backend, TritonAttentionBackend) and backend.name == "triton"
    assert isinstance(get_attention_backend("auto", cpu), TorchAttentionBackend)
    # one rule for every entry point: the Triton kernels need CUDA, so on the CPU every name is torch
    assert isinstance(get_attention_backend("triton", cpu), TorchAttentionBackend)
    assert isinstance(get_attention_backend("flashinfer", cuda), TritonAttentionBackend)
    assert isinstance(get_attention_backend("auto", cuda), TritonAttentionBackend)
    assert attention_backend_class("fa3") is TritonAttentionBackend
    assert set(ATTENTION_BACKEND_CLASSES) == set(ATTENTION_BACKENDS)  # a class for every canonical name
    with pytest.raises(ValueError, match="cold_path"):
        TritonAttentionBackend(cold_path="flash")


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("contiguous", [False, True], ids=["scattered", "consecutive"])
def test_prefix_split_sdpa_path(
    monkeypatch: pytest.MonkeyPatch, heads: tuple[int, int], contiguous: bool
) -> None:
    """Chunks over a cached prefix as (prefix, no mask) + (new, causal) SDPA calls merged by log-sum-exp; a
    prefix on consecutive pages is read as a view of them, scattered ones gathered."""
    import longserve.attention.triton_backend as tb

    calls = []
    real = tb.prefix_split_sdpa
    monkeypatch.setattr(tb, "SPLIT_SDPA_MIN_QUERY", 5)
    monkeypatch.setattr(
        tb, "prefix_split_sdpa", lambda *a, **kw: calls.append(kw["requests"]) or real(*a, **kw)
    )
    step = Step([0, 3, 17, 40], [5, 16, 7, 9], 4, heads, 32, seed=11, contiguous=contiguous)
    views = [step.meta.contiguous_pages(r, -(-p // 4)) for r, p in enumerate([0, 3, 17, 40])]
    # (a one-page prefix is trivially consecutive; the longer ones of the shuffled pool are not)
    assert views[0] is None and (views[2:] == [8, 14] if contiguous else views[2:] == [None, None])
    step.compare(TritonAttentionBackend(cold_path="sdpa"))
    assert calls == [(0, 1, 2, 3)]
    # per request: a chunk under the threshold (and a decode) in the Triton kernel, the long chunk in the
    # library call, in one step
    mixed = Step([3, 17, 9], [4, 16, 1], 4, heads, 32, seed=12, contiguous=contiguous)
    mixed.compare(TritonAttentionBackend(cold_path="sdpa"))
    assert calls == [(0, 1, 2, 3), (1,)] and mixed.meta.subset((0, 2)) is not None
    short = Step([3, 17], [4, 1], 4, heads, 32, seed=13)  # nothing long: all in the Triton kernel
    short.compare(TritonAttentionBackend(cold_path="sdpa"))
    assert len(calls) == 2


@pytest.mark.parametrize("heads", HEADS)
def test_decodes_beside_library_prompts_take_the_decode_kernel(monkeypatch, heads: tuple[int, int]) -> None:
    """A mixed step: the cold prompts in the library call, the decodes beside them in the split-K decode kernel
    (not the extend kernel, whose 64-row tiles a decode's GQA rows barely fill), the output equal to the
    reference; a short chunk among the rest keeps the rest in the extend kernel."""
    import longserve.attention.triton_backend as tb

    backend = TritonAttentionBackend(cold_path="sdpa")
    decoded, extended = [], []
    real_decode, real_extend = backend._decode, backend._extend
    backend._decode = lambda q, *a, **kw: decoded.append(q.shape[0]) or real_decode(q, *a, **kw)
    backend._extend = lambda q, *a, **kw: extended.append(q.shape[0]) or real_extend(q, *a, **kw)
    monkeypatch.setattr(tb, "SPLIT_SDPA_MIN_QUERY", 1 << 20)  # no chunk over a prefix in the library
    Step([0, 21, 0, 9, 40], [16, 1, 7, 1, 1], 4, heads, 32, seed=31).compare(backend)
    assert decoded == [3] and extended == []
    Step([0, 21, 3, 9], [16, 1, 5, 1], 4, heads, 32, seed=32).compare(backend)
    assert decoded == [3] and extended == [7]  # the decodes and the 5-token chunk together


@pytest.mark.parametrize("heads", HEADS)
def test_library_paths_at_padded_shapes(monkeypatch: pytest.MonkeyPatch, heads: tuple[int, int]) -> None:
    """The cuDNN paths run at grid shapes (sdpa_shapes.py): new tokens padded with zero rows, a prefix read up
    to a multiple of PREFIX_GRANULE keys and its tail put in front of the new tokens in the causal part.
    Exact: equal to the reference for tails of 0..granule-1 keys, prefixes shorter than a granule, new
    tokens of every remainder."""
    import longserve.attention.sdpa_shapes as shapes
    import longserve.attention.triton_backend as tb

    monkeypatch.setattr(shapes, "Q_GRANULE", 8)
    monkeypatch.setattr(shapes, "PREFIX_GRANULE", 16)
    monkeypatch.setattr(tb, "SPLIT_SDPA_MIN_QUERY", 1)
    assert shapes.split_shape(40, 9) == shapes.SplitShape(
        prefix_keys=32, tail=8, query_rows=16, causal_rows=24, pieces=(16,)
    )
    assert shapes.split_shape(3, 16) == shapes.SplitShape(
        prefix_keys=0, tail=3, query_rows=16, causal_rows=24, pieces=(16,)
    )
    assert shapes.split_shape(40, 20, (8, 8, 8)).query_rows == 24
    calls = []
    real = tb.prefix_split_sdpa
    monkeypatch.setattr(tb, "prefix_split_sdpa", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for contiguous in (False, True):
        step = Step(
            [0, 3, 16, 17, 40, 70], [5, 16, 7, 9, 8, 13], 4, heads, 32, seed=21, contiguous=contiguous
        )
        step.compare(TritonAttentionBackend(cold_path="sdpa"))
    assert calls == [1, 1]
    Step([0, 0, 0], [16, 5, 13], 4, heads, 16, seed=22).compare(TritonAttentionBackend(cold_path="sdpa"))
    # a chunk padded past its own rows, up to a built row count (a long prompt's last chunk): still exact
    rows_asked: list[int] = []

    def padded_further(self, model, prefix_len, query_len, device):  # noqa: ANN001, ANN202
        rows_asked.append(query_len)
        return (shapes.pad_rows(query_len) + 2 * shapes.Q_GRANULE,)

    monkeypatch.setattr(shapes.PlanRegistry, "split_rows", padded_further)
    calls.clear()
    Step([3, 16, 40, 70], [16, 7, 8, 13], 4, heads, 32, seed=23).compare(
        TritonAttentionBackend(cold_path="sdpa")
    )
    assert rows_asked == [16, 7, 8, 13] and calls == [1]

    # ... or in pieces of a granule (a lone prompt's chunk past its first): each piece's rows over the whole prefix,
    # merged into its own rows; the last piece padded. Still exact.
    from longserve.attention import sdpa

    pieces_run: list[int] = []
    real_call = sdpa.attention_with_lse

    def counting(q, k, v, causal, scale):  # noqa: ANN001, ANN202
        if not causal:
            pieces_run.append(q.shape[2])
        return real_call(q, k, v, causal, scale)

    monkeypatch.setattr(sdpa, "attention_with_lse", counting)
    monkeypatch.setattr(
        shapes.PlanRegistry, "split_rows", lambda self, model, p, n, device: (shapes.Q_GRANULE,) * -(-n // 8)
    )
    calls.clear()
    Step([3, 16, 40, 70], [16, 7, 8, 21], 4, heads, 32, seed=24).compare(
        TritonAttentionBackend(cold_path="sdpa")
    )
    # prefix keys 0, 16, 32, 64: 7 new tokens over 16 keys in one piece, 8 over 32 in one, 21 over 64 in three
    assert calls == [1] and pieces_run == [8, 8, 8, 8, 8]


def test_routing_is_decided_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer asks which requests go to the library calls; the registry is consulted once per step."""
    import longserve.attention.triton_backend as tb
    from longserve.attention import sdpa_shapes as shapes

    asked: list[int] = []

    class Counting(shapes.PlanRegistry):
        def cold_ready(self, model, query_len, device):  # noqa: ANN001, ANN202
            asked.append(query_len)
            return super().cold_ready(model, query_len, device)

    monkeypatch.setattr(tb, "PLANS", Counting())
    meta = build_metadata([0, 0, 30], [700, 9, 1], [[1] * 44, [2], [3, 4]], 16, "cpu")
    backend = TritonAttentionBackend(cold_path="sdpa")
    q = torch.zeros(710, 8, 16)
    first = backend.library_requests(q, 2, meta)
    assert first == (0, 1) and asked == [700, 9]  # on the CPU every cold prompt goes to torch's SDPA
    for _ in range(3):
        assert backend.library_requests(q, 2, meta) == first
    assert asked == [700, 9]
    fresh = build_metadata([0, 0, 30], [700, 9, 1], [[1] * 44, [2], [3, 4]], 16, "cpu")
    assert backend.library_requests(q, 2, fresh) == first and len(asked) == 4  # a new step decides anew


def test_plan_registry_is_per_thread_and_covers_a_long_prompts_chunks(monkeypatch) -> None:
    """On CUDA a shape is ready only once built on the calling thread (torch keeps cuDNN plans per thread);
    the start-up set covers every chunk of a lone long prompt; the CPU builds nothing, so all is ready. (Without
    the short-suffix plans, whose padding the next test checks.)"""
    import threading

    from longserve.attention import sdpa_shapes as shapes

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    model = shapes.ModelShape(32, 8, 128, torch.bfloat16)
    registry = shapes.PlanRegistry()
    assert registry.cold_ready(model, 100, cpu) and registry.cold_ready(model, 3000, cpu)
    assert registry.split_rows(model, 5000, 700, cpu) is not None
    assert not registry.cold_ready(model, 3000, cuda)
    registry.mark(model, 3072, 3072, True)
    assert registry.cold_ready(model, 3000, cuda) and registry.cold_ready(
        model, 2817, cuda
    )  # both pad to 3072
    # up to 4 granules a cold prompt pads to a quarter granule (the padding rows are the causal call's costliest)
    assert not registry.cold_ready(model, 2049, cuda) and shapes.pad_cold_rows(2049) == 2304
    registry.mark(model, 2304, 2304, True)
    assert registry.cold_ready(model, 2049, cuda) and registry.cold_ready(model, 2304, cuda)
    assert shapes.pad_cold_rows(4097) == 5120 and shapes.pad_cold_rows(512) == 512
    assert not registry.cold_ready(model, 100, cuda)  # a short prompt: not worth cuDNN
    assert not registry.cold_ready(shapes.ModelShape(32, 8, 128, torch.float16), 3000, cuda)
    other: list[bool] = []
    thread = threading.Thread(target=lambda: other.append(registry.cold_ready(model, 3000, cuda)))
    thread.start()
    thread.join()
    assert other == [False]

    # a chunk whose padded rows have no plan pads up to a built row count it fills at least 0.6 of
    monkeypatch.setattr(shapes, "SHORT_QUERY_ROWS", ())
    for q_rows, kv_rows, causal in shapes.warm_up_shapes(8192, 65536):
        registry.mark(model, q_rows, kv_rows, causal)
    assert registry.split_rows(model, 20000, 8100, cuda) == (8192,)  # a full chunk (prefix keys 18432)
    assert registry.split_rows(model, 20000, 6000, cuda) == (
        8192,
    )  # 6144 and 7168 not built; 6000 >= 0.6 x 8192
    assert registry.split_rows(model, 20000, 4000, cuda) is None  # 4000 < 0.6 x 8192: Triton
    assert registry.split_rows(model, 1000, 6000, cuda) == (
        6144,
    )  # a prefix under a granule: causal part only
    assert registry.split_rows(model, 32768, 1024, cuda) is None  # a hit with 1K new tokens: no plan, Triton
    chunk, longest = 8192, 131072
    built = set(shapes.warm_up_shapes(chunk, longest))
    # causal 1K..10K, short cold prompts' 512..3840 rows between them, 8K new tokens over 2K..120K of prefix
    assert len(built) == 10 + 11 + 60
    # chunks of `chunk - decodes` tokens: the decodes beside a long prompt take their tokens from the budget,
    # so after its first chunk the prefix is no multiple of the chunk (nor of the prefix granule)
    for decodes in (0, 1, 7, 300):
        step = chunk - decodes
        for prompt in (131072 - decodes * 16, 131071, 65536, 32768 + 1000, 20000, 8192 * 3 + 1):
            for done in range(0, prompt, step):
                s = shapes.split_shape(done, min(step, prompt - done))
                full_chunk = prompt - done >= chunk - shapes.Q_GRANULE + 1
                assert ((s.causal_rows, s.causal_rows, True) in built) or not full_chunk
                if s.prefix_keys and full_chunk:
                    assert (s.query_rows, s.prefix_keys, False) in built, (prompt, done, decodes)


def test_a_lone_prompts_chunks_run_at_built_shapes() -> None:
    """A lone prompt's steps (sched/chunk_size.py: 32K, then chunks shrinking from 12K to the usual 8K) at the shapes
    warm-up builds for them: causal up to the lone step, the usual chunk's rows over every prefix. Every chunk's
    causal part is built, and its prefix part runs in pieces at built row counts that pad it by less than a
    granule. (When warm-up built the lone step's rows over every prefix instead, no chunk past the first had a
    plan and all ran in Triton: the 8B's cold 128K 16.05 s against 10.21 s in 8K chunks on an H100.)"""
    from longserve.attention import sdpa_shapes as shapes
    from longserve.sched.chunk_size import bounded_lone_chunk

    cuda = torch.device("cuda")
    model = shapes.ModelShape(32, 8, 128, torch.bfloat16)
    chunk, lone, prompt = 8192, 32768, 131072
    built = set(shapes.warm_up_shapes(chunk, prompt + 16, lone))
    assert (pad := shapes.pad_rows(lone + shapes.PREFIX_GRANULE - 1), pad, True) in built
    assert not any(rows > chunk for rows, _, causal in built if not causal)
    registry = shapes.PlanRegistry()
    for shape in built:
        registry.mark(model, *shape)
    for cached in (0, 1000, 5000, 40000):  # a prompt behind a cached prefix too
        done, sizes = cached, []
        while done < prompt:
            n = prompt - done
            n = bounded_lone_chunk(n, done, lone, chunk, shapes.PREFIX_GRANULE) if n > chunk else n
            sizes.append(n)
            if not done:
                assert registry.cold_ready(model, n, cuda)
            else:
                pieces = registry.split_rows(model, done, n, cuda)
                assert pieces is not None, (cached, done, n)
                s = shapes.split_shape(done, n, pieces)
                assert (s.causal_rows, s.causal_rows, True) in built
                assert s.tail == 0 or done == cached  # past the first, each chunk starts on the granule
                if s.prefix_keys:
                    assert all((rows, s.prefix_keys, False) in built for rows in pieces)
                    assert 0 <= sum(pieces) - n < shapes.Q_GRANULE, (done, n, pieces)
            done += n
        assert max(sizes) > chunk and sizes[-1] <= chunk  # lone steps first, the usual chunks last
    assert registry.split_rows(model, 32768, 13573, cuda) == (8192, 4096, 2048)


def test_chunks_ending_on_the_granule_pad_no_attention() -> None:
    """The 8B's cold 128K in lone steps of 32K holds the attention of its 8K chunks, padded rows counted (query rows
    x prefix keys, causal rows^2 / 2), when each lone chunk ends on the backend's granule (the cuDNN path's
    PREFIX_GRANULE); ending anywhere (32768 + 13572 + 10415 + 8780 = 65535), each later chunk's prefix tail joined
    its causal call behind empty rows: 3% more, and 1.9% slower end to end on an H100 (RESULTS.md forty-second
    session). Usual chunks behind a cached prefix off the granule: the first ends on it, the rest pad nothing."""
    from longserve.attention import sdpa_shapes as shapes
    from longserve.attention.triton_backend import TritonAttentionBackend
    from longserve.bench.roofline import prefill_steps

    assert TritonAttentionBackend(cold_path="triton").chunk_granule == shapes.PREFIX_GRANULE

    def padded_work(steps: list[tuple[int, int, bool]]) -> int:
        work = 0
        for done, n, _ in steps:
            s = shapes.split_shape(done, n)
            work += s.query_rows * s.prefix_keys + s.causal_rows**2 // 2
        return work

    prompt, chunk, lone = 131072, 8192, 32768
    chunks = prefill_steps(0, prompt, chunk)
    aligned = prefill_steps(0, prompt, chunk, lone, shapes.PREFIX_GRANULE)
    anywhere = prefill_steps(0, prompt, chunk, lone)
    assert [n for _, n, _ in aligned][:4] == [32768, 12288, 10240, 8192] and len(aligned) == 13 < len(chunks)
    assert all(done % shapes.PREFIX_GRANULE == 0 for done, _, _ in aligned)
    assert padded_work(aligned) == padded_work(chunks) == prompt**2 // 2
    assert padded_work(anywhere) > 1.03 * padded_work(chunks)
    # usual chunks behind a cached prefix off the granule (a conversation's long next turn): the first ends on it
    cached, new = 16400, 40000
    on_granule = prefill_steps(cached, new, chunk, None, shapes.PREFIX_GRANULE)
    as_given = prefill_steps(cached, new, chunk)
    assert [n for _, n, _ in on_granule] == [8176, 8192, 8192, 8192, 7248] and len(as_given) == len(
        on_granule
    )
    assert all(done % shapes.PREFIX_GRANULE == 0 for done, _, _ in on_granule[1:])
    assert padded_work(as_given) - padded_work(on_granule) > 4 * 8.9e6  # each later chunk's 1,024 causal rows


def test_a_long_chunk_without_a_plan_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """A chunk of 4K+ new tokens over a prefix that meets no built shape (it runs in Triton, at ~60% of cuDNN's rate)
    is logged once a process; shorter ones (a long prompt's last chunk) are not."""
    from longserve.attention import sdpa_shapes as shapes

    cuda = torch.device("cuda")
    model = shapes.ModelShape(32, 8, 128, torch.bfloat16)
    registry = shapes.PlanRegistry()
    with caplog.at_level("WARNING", logger="longserve.attention"):
        assert registry.split_rows(model, 20000, 3000, cuda) is None
        assert not caplog.records
        assert registry.split_rows(model, 20000, 8192, cuda) is None
        assert registry.split_rows(model, 40000, 9000, cuda) is None
    assert len(caplog.records) == 1 and "8192 new tokens over 20000 cached" in caplog.text


def test_short_cold_prompts_run_at_their_fine_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold prompt under 4 granules runs its library call at pad_cold_rows (a quarter granule), one over at
    whole granules; the result equal to causal attention over its own rows."""
    from longserve.attention import sdpa

    rows: list[int] = []
    real = sdpa.attention_with_lse
    monkeypatch.setattr(sdpa, "attention_with_lse", lambda q, *a: rows.append(q.shape[2]) or real(q, *a))
    gen = torch.Generator().manual_seed(41)
    for n, want in ((600, 768), (4100, 5120)):
        q, k, v = (torch.randn(n, h, 16, generator=gen) for h in (4, 2, 2))
        out = sdpa.cold_sdpa(q, k, v, [n], 0.25)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
            is_causal=True, scale=0.25,
        ).transpose(0, 1)  # fmt: skip
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert rows[-1] == want


def test_padded_calls_read_a_lending_buffers_next_rows_in_place() -> None:
    """sdpa.allow_padding_rows: a prompt's q/k/v in a buffer that lends its later rows (the piecewise graphs'
    static qkv) run their padded cuDNN call on views over those rows (no copy), whatever finite values lie there,
    with the result of the copied, zero-padded call; a buffer that does not lend them, or holds too few rows,
    is copied as before."""
    from longserve.attention import sdpa

    hq, hkv, d, n = 4, 2, 16, 600
    width = (hq + 2 * hkv) * d
    gen = torch.Generator().manual_seed(43)

    def views(buf: torch.Tensor, start: int, length: int) -> list[torch.Tensor]:
        qkv = buf[start : start + length]
        return [t.view(length, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=1)]

    lent = torch.randn(1100, width, generator=gen) * 50  # finite rows of other requests / stale steps
    plain = lent.clone()
    sdpa.allow_padding_rows(lent)
    q, k, v = views(lent, 100, n)
    got = sdpa.fused_rows(q, k, v, 768)
    assert all(a.data_ptr() == b.data_ptr() and a.shape[0] == 768 for a, b in zip(got, (q, k, v)))
    copied = sdpa.fused_rows(*views(plain, 100, n), 768)
    assert copied[0].data_ptr() != plain[100:].data_ptr() and not copied[0][n:].any()
    assert (
        sdpa.fused_rows(*views(lent, 400, n), 768)[0].data_ptr() != lent[400:].data_ptr()
    )  # 1,168 > 1,100 rows
    out = sdpa.cold_sdpa(q, k, v, [n], 0.25)
    torch.testing.assert_close(out, sdpa.cold_sdpa(*views(plain, 100, n), [n], 0.25), atol=1e-6, rtol=1e-6)


def test_short_query_plans_serve_hits_with_short_suffixes(monkeypatch: pytest.MonkeyPatch) -> None:
    """SHORT_QUERY_ROWS: each row count's plans over every 2K of prefix below the context; a hit's new tokens pad
    to the next built row count they fill 0.6 of, else run in pieces that they fill 0.6 of, else (and below
    SPLIT_SDPA's minimum) Triton."""
    from longserve.attention import sdpa_shapes as shapes
    from longserve.attention.triton_backend import use_split_sdpa

    monkeypatch.setattr(shapes, "SHORT_QUERY_ROWS", (1024, 2048, 4096, 8192))
    built = shapes.warm_up_shapes(8192, 65536)
    assert len(built) == len(set(built)) == 10 + 11 + 28 + 3 * 31  # 8192 rows are the full chunk's already
    assert (1024, 63488, False) in built and (4096, 65536, False) not in built  # prefixes below the context
    cuda = torch.device("cuda")
    model = shapes.ModelShape(32, 8, 128, torch.bfloat16)
    registry = shapes.PlanRegistry()
    for shape in built:
        registry.mark(model, *shape)
    assert registry.split_rows(model, 32768, 1024, cuda) == (1024,)
    assert registry.split_rows(model, 32768, 1500, cuda) == (2048,)
    assert registry.split_rows(model, 40000, 3000, cuda) == (4096,)  # 3072 not built; 3000 >= 0.6 x 4096
    # 3072 not built, 2100 < 0.6 x 4096: in pieces of 2048 and 1024 rows, which it fills 0.68 of
    assert registry.split_rows(model, 32768, 2100, cuda) == (2048, 1024)
    assert not use_split_sdpa(64, 32768)  # a short suffix stays in Triton whatever is built


def test_warm_up_writes_only_the_reserved_page() -> None:
    """The backend's warm-up runs its forward passes over page 0 (reserved, never handed out): every other
    page of the pool keeps its bytes, on every layer."""
    backend = TritonAttentionBackend()
    cache = KVCache(2, 9, 4, 2, 16, torch.float32, "cpu")
    for t in (*cache.k, *cache.v):
        t.normal_()
    before = [t.clone() for t in (*cache.k, *cache.v)]
    shape = GraphShape(max_seq_len=600, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                       device=torch.device("cpu"))  # fmt: skip
    backend.warm_up(shape, 64, cache)
    after = [*cache.k, *cache.v]
    assert not torch.equal(after[0][0], before[0][0])  # layer 0's page 0 was the target
    for b, a in zip(before, after):
        assert torch.equal(b[1:], a[1:])


def test_split_sdpa_rule_follows_the_measured_crossovers() -> None:
    """The H200 measurements behind the rule: Triton wins 256 new over 32K and 512 over 8K; the split cuDNN
    path wins 512 over 32K and 1024+ over any prefix."""
    from longserve.attention.triton_backend import use_split_sdpa

    assert not use_split_sdpa(256, 32768) and not use_split_sdpa(512, 8192) and not use_split_sdpa(64, 131072)
    assert use_split_sdpa(512, 32768) and use_split_sdpa(1024, 8192) and use_split_sdpa(2048, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_two_matches_reference_and_full_attention(dtype: torch.dtype) -> None:
    """The one-pass merge of two partials equals the torch merge, and merging attention over two disjoint
    key halves equals attention over all keys; partials laid out [L, H, D] (as cuDNN returns them) work."""
    from longserve.kernels.merge_attention import merge_two, merge_two_ref

    torch.manual_seed(3)
    h, n, d, s = 3, 37, 24, 50
    q, k, v = torch.randn(h, n, d), torch.randn(h, s, d), torch.randn(h, s, d)

    def part(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = q @ k[:, lo:hi].transpose(1, 2) / d**0.5  # [H, L, S']
        lse = torch.logsumexp(logits, -1)  # [H, L]
        o = torch.softmax(logits, -1) @ v[:, lo:hi]  # [H, L, D]
        o_strided = o.transpose(0, 1).contiguous().transpose(0, 1)  # [H, L, D] view of [L, H, D] memory
        return o_strided.to(dtype), lse

    (o_a, lse_a), (o_b, lse_b) = part(0, 20), part(20, s)
    lse_b[1, 5] = float("-inf")  # a row that saw no key in the second half: weight 0, not NaN
    o_b[1, 5] = 0
    got = merge_two(o_a, lse_a, o_b, lse_b, torch.empty(n, h, d, dtype=dtype))
    ref = merge_two_ref(o_a, lse_a, o_b, lse_b, torch.empty(n, h, d, dtype=dtype))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    full = torch.softmax(q @ k.transpose(1, 2) / d**0.5, -1) @ v  # [H, L, D]
    full[1, 5] = part(0, 20)[0][1, 5].float()  # that row: the first half alone
    torch.testing.assert_close(got.float(), full.transpose(0, 1), atol=tol, rtol=tol)


def test_a_serving_mix_of_batches_keys_few_kernel_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    """What Triton would compile for a stream of mixed steps (1-9 requests, decodes beside chunks, contexts
    long enough for key splits): each launch's specialization key (constexprs, pointer alignment, the class
    of each int: 1, a multiple of 16, other), less the arguments a kernel declares unspecialized, takes at
    most two values a kernel: split or not. Keyed on the split count, or on alignments that followed the
    batch size, a server compiled a variant mid-step, a second or more each, every running request stalled
    (RESULTS.md, 2026-12-02, third session)."""
    from collections import defaultdict

    import longserve.kernels.decode_attention as dec
    import longserve.kernels.extend_attention as ext

    keys: dict[str, set] = defaultdict(set)

    def record(module: object, name: str) -> None:
        kernel = getattr(module, name)
        unspecialized = set(kernel.kwargs.get("do_not_specialize") or ())

        def key_of(args: tuple, kwargs: dict) -> tuple:
            spec = []
            for arg_name, a in zip(kernel.arg_names, args):
                if arg_name in unspecialized:
                    continue
                if isinstance(a, torch.Tensor):
                    spec.append((a.dtype, a.data_ptr() % 16 == 0))
                elif isinstance(a, int) and not isinstance(a, bool):
                    spec.append((a == 1, a % 16 == 0))
            return tuple(spec), tuple(sorted(kwargs.items()))

        class Recorder:  # the keys only: the outputs are not read (running the interpreted kernels took 18 s)
            def __getitem__(self, grid: tuple) -> object:
                def launch(*args: object, **kwargs: object) -> None:
                    keys[name].add(key_of(args, kwargs))

                return launch

        monkeypatch.setattr(module, name, Recorder())

    record(ext, "_extend_kernel")
    record(ext, "_merge_splits_kernel")
    record(dec, "_decode_split_kernel")
    backend = TritonAttentionBackend(cold_path="triton", num_sms=4)
    rng = random.Random(5)
    splits_seen = set()
    for i in range(16):
        num_reqs = rng.randint(1, 9)
        decode_only = i % 3 == 0
        prefix_lens = [rng.choice([0, rng.randint(1, 300), rng.randint(900, 1600)]) for _ in range(num_reqs)]
        query_lens = [1 if decode_only or rng.random() < 0.5 else rng.randint(2, 24) for _ in range(num_reqs)]
        if decode_only:
            prefix_lens = [max(p, 1) for p in prefix_lens]
        step = Step(prefix_lens, query_lens, 16, (4, 2), 16, seed=i)
        seq_lens = [p + n for p, n in zip(prefix_lens, query_lens)]
        if decode_only:
            splits_seen.add(choose_num_splits(max(seq_lens), num_reqs, 2, 4) > 1)
        else:
            splits_seen.add(choose_extend_splits(query_lens, seq_lens, 4, 2, 16, 4) > 1)
        step.run(backend)
    assert splits_seen == {False, True}  # the mix covered both kinds of launch
    assert len(keys["_extend_kernel"]) <= 2 and len(keys["_decode_split_kernel"]) <= 2, dict(keys)
    assert len(keys["_merge_splits_kernel"]) <= 1, keys["_merge_splits_kernel"]


def test_start_up_plans_have_the_layouts_of_the_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch keys a cuDNN plan on sizes and strides: the calls a long prompt's chunks make (q/k/v views of a
    model's fused qkv projection, padded or not, a prefix from the pages) must have exactly the sizes and
    strides of the start-up calls (`plan_calls`), or every plan built at start-up is built again mid-step.
    And fused_rows returns views already in that layout as they are, pads into it, and lays out others."""
    import longserve.attention.sdpa as sdpa
    import longserve.attention.sdpa_shapes as shapes
    import longserve.attention.triton_backend as tb

    monkeypatch.setattr(shapes, "Q_GRANULE", 8)
    monkeypatch.setattr(shapes, "PREFIX_GRANULE", 16)
    monkeypatch.setattr(tb, "SPLIT_SDPA_MIN_QUERY", 8)
    hq, hkv, d, chunk, longest = 4, 2, 16, 16, 80

    def key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple:
        return tuple((t.shape, t.stride()) for t in (q, k, v)) + (causal,)

    model = shapes.ModelShape(hq, hkv, d, torch.float32)
    todo = shapes.warm_up_shapes(chunk, longest)
    built = {key(*call) for call in sdpa.plan_calls(model, torch.device("cpu"), todo)}
    assert len(built) == len(todo)
    made: list[tuple] = []
    real = sdpa.attention_with_lse
    monkeypatch.setattr(
        sdpa, "attention_with_lse", lambda q, k, v, c, s: made.append(key(q, k, v, c)) or real(q, k, v, c, s)
    )
    for prompt in (longest, longest - 3, 3 * chunk + 2):  # chunk-aligned, a padded last chunk, a short one
        for done in range(0, prompt, chunk):
            n = min(chunk, prompt - done)
            step = Step([done], [n], 4, (hq, hkv), d, seed=done)
            qkv = torch.randn(n, (hq + 2 * hkv) * d)  # what a model's projection gives the backend: views
            q, k, v = (t.view(n, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=1))
            step.q, step.k, step.v = q, k, v
            made.clear()
            step.compare(TritonAttentionBackend(cold_path="sdpa"))
            if n > chunk - shapes.Q_GRANULE:  # a full chunk (its padding within a granule): at built shapes
                assert made and set(made) <= built, (prompt, done, set(made) - built)

    qkv = torch.randn(5, (hq + 2 * hkv) * d)
    q, k, v = (t.view(5, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=1))
    assert all(a is b for a, b in zip(sdpa.fused_rows(q, k, v, 5), (q, k, v)))  # no copy
    front = (torch.randn(3, hkv, d), torch.randn(3, hkv, d))
    pq, pk, pv = sdpa.fused_rows(q.clone(), k.clone(), v.clone(), 16, front)  # not views: laid out anew
    assert all(t.stride() == q.stride() and t.shape[0] == 16 for t in (pq, pk, pv))
    assert torch.equal(pq[3:8], q) and not pq[:3].any() and not pq[8:].any()
    assert torch.equal(pk[:3], front[0]) and torch.equal(pk[3:8], k) and torch.equal(pv[:3], front[1])


def test_the_decode_tile_of_wide_heads_is_its_own_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU (the interpreter's own tile aside) heads over 128 wide take WIDE_HEAD_CONFIG (what
    `gpu_check.sh decode-wide` sets from its sweep), a copy the caller may change; fp32 and 128-wide heads are
    not affected by it."""
    from longserve.kernels import decode_attention as dec

    monkeypatch.setattr(dec, "interpreting", lambda: False)
    tile = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    monkeypatch.setattr(dec, "WIDE_HEAD_CONFIG", tile)
    got = dec.decode_config(256, torch.bfloat16, 4)
    assert got == tile and got is not tile
    assert dec.decode_config(256, torch.float32, 4) == {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    assert dec.decode_config(128, torch.bfloat16, 4)["BLOCK_N"] == dec.DECODE_BLOCK_N
