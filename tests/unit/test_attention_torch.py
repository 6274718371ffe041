"""The torch backends and build_metadata vs. an independent dense attention over contiguous K/V: the reference
(TorchAttentionBackend, the oracle), and the fused-SDPA backend the registry runs as "torch" (each test runs
both), which is also compared with the reference on larger ragged batches."""

from __future__ import annotations

import math
import random

import pytest
import torch

from longserve.attention import (
    AttentionMetadata,
    KVCache,
    TorchAttentionBackend,
    TorchSDPABackend,
    build_metadata,
    get_attention_backend,
)

PREFIX_LENS = [0, 1, 5, 17, 40]
QUERY_LENS = [1, 3, 16]
HEADS = [(4, 2), (4, 1), (2, 2)]  # (Hq, Hkv)
BACKENDS = [TorchAttentionBackend, TorchSDPABackend]


@pytest.fixture(params=BACKENDS, ids=["reference", "sdpa"])
def backend_cls(request: pytest.FixtureRequest) -> type[TorchAttentionBackend]:
    return request.param


def dense_attention(
    q: torch.Tensor,  # [L, Hq, D] new tokens at positions prefix_len .. S-1
    k: torch.Tensor,  # [S, Hkv, D] the whole sequence, contiguous
    v: torch.Tensor,  # [S, Hkv, D]
    prefix_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain softmax(QK^T * scale + mask) V in float64, kv head of q head h = h // (Hq // Hkv)."""
    num_q, num_kv = q.shape[1], k.shape[1]
    kv_head = torch.tensor([h // (num_q // num_kv) for h in range(num_q)])  # [Hq]
    qd = q.double().transpose(0, 1)  # [Hq, L, D]
    kd = k.double()[:, kv_head].transpose(0, 1)  # [Hq, S, D]
    vd = v.double()[:, kv_head].transpose(0, 1)  # [Hq, S, D]
    seq_len = k.shape[0]
    allowed = torch.zeros(q.shape[0], seq_len, dtype=torch.bool)  # [L, S]
    for i in range(q.shape[0]):
        pos = prefix_len + i
        lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
        allowed[i, lo : pos + 1] = True
    scores = qd @ kd.transpose(1, 2) * scale  # [Hq, L, S]
    scores = scores.masked_fill(~allowed, -math.inf)  # [Hq, L, S]
    return (scores.softmax(-1) @ vd).transpose(0, 1)  # [L, Hq, D]


class Case:
    """A random ragged batch: contiguous per-request K/V/Q plus shuffled, non-contiguous page ids."""

    def __init__(
        self,
        prefix_lens: list[int],
        query_lens: list[int],
        page_size: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        seed: int,
        backend_cls: type[TorchAttentionBackend] = TorchAttentionBackend,
    ) -> None:
        self.backend = backend_cls()
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.prefix_lens, self.query_lens, self.page_size = prefix_lens, query_lens, page_size
        seq_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
        pages_needed = [-(-s // page_size) for s in seq_lens]
        num_pages = sum(pages_needed) + 7  # spare pages full of noise catch wrong-page reads
        pool = list(range(num_pages))
        rng.shuffle(pool)
        self.page_tables: list[list[int]] = []
        for n in pages_needed:
            self.page_tables.append(pool[:n])
            pool = pool[n:]

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype)

        self.k = [randn(s, num_kv_heads, head_dim) for s in seq_lens]  # each [S, Hkv, D]
        self.v = [randn(s, num_kv_heads, head_dim) for s in seq_lens]  # each [S, Hkv, D]
        self.q = [randn(s, num_q_heads, head_dim) for s in seq_lens]  # each [S, Hq, D]
        self.scale = head_dim**-0.5
        self.cache = KVCache(2, num_pages, page_size, num_kv_heads, head_dim, dtype, "cpu")
        for layer in range(2):
            self.cache.k[layer].copy_(randn(num_pages, page_size, num_kv_heads, head_dim))
            self.cache.v[layer].copy_(randn(num_pages, page_size, num_kv_heads, head_dim))

    def write_prefix_directly(self, layer: int) -> None:
        """Put each request's prefix K/V in its pages by hand (independent of store/slot_mapping)."""
        for r, pages in enumerate(self.page_tables):
            for pos in range(self.prefix_lens[r]):
                page, off = pages[pos // self.page_size], pos % self.page_size
                self.cache.k[layer][page, off] = self.k[r][pos]
                self.cache.v[layer][page, off] = self.v[r][pos]

    def new_tokens(self, lo: list[int], hi: list[int], reqs: list[int]) -> tuple[torch.Tensor, ...]:
        """Flattened q/k/v of positions [lo[i], hi[i]) of requests reqs[i]."""
        q = torch.cat([self.q[r][a:b] for r, a, b in zip(reqs, lo, hi)])  # [T, Hq, D]
        k = torch.cat([self.k[r][a:b] for r, a, b in zip(reqs, lo, hi)])  # [T, Hkv, D]
        v = torch.cat([self.v[r][a:b] for r, a, b in zip(reqs, lo, hi)])  # [T, Hkv, D]
        return q, k, v

    def expected(
        self, lo: list[int], hi: list[int], sliding_window: int | None = None, reqs: list[int] | None = None
    ) -> torch.Tensor:
        reqs = list(range(len(lo))) if reqs is None else reqs
        outs = [
            dense_attention(self.q[r][a:b], self.k[r][:b], self.v[r][:b], a, self.scale, sliding_window)
            for r, a, b in zip(reqs, lo, hi)
        ]
        return torch.cat(outs)  # [T, Hq, D] float64

    def run(
        self,
        lo: list[int],
        hi: list[int],
        layer: int = 0,
        sliding_window: int | None = None,
        reqs: list[int] | None = None,
    ) -> torch.Tensor:
        """One step computing positions [lo[i], hi[i]) of requests reqs[i] (default: all, in order)."""
        reqs = list(range(len(lo))) if reqs is None else reqs
        page_tables = [self.page_tables[r] for r in reqs]
        meta = build_metadata(lo, [b - a for a, b in zip(lo, hi)], page_tables, self.page_size, "cpu")
        q, k, v = self.new_tokens(lo, hi, reqs)
        out = self.backend.forward(q, k, v, layer, meta, self.cache, self.scale, sliding_window)
        assert out.shape == q.shape and out.dtype == q.dtype
        return out  # [T, Hq, D]


def random_batch(seed: int, num_reqs: int = 5) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    prefix_lens = [rng.choice(PREFIX_LENS) for _ in range(num_reqs)]
    query_lens = [rng.choice(QUERY_LENS) for _ in range(num_reqs)]
    return prefix_lens, query_lens


def seq_ends(prefix_lens: list[int], query_lens: list[int]) -> list[int]:
    return [p + q for p, q in zip(prefix_lens, query_lens)]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_matches_dense_float32(
    page_size: int, heads: tuple[int, int], head_dim: int, backend_cls: type[TorchAttentionBackend]
) -> None:
    seed = page_size * 1000 + heads[0] * 100 + heads[1] * 10 + head_dim
    prefix_lens, query_lens = random_batch(seed)
    case = Case(prefix_lens, query_lens, page_size, *heads, head_dim, torch.float32, seed, backend_cls)
    case.write_prefix_directly(layer=1)
    hi = seq_ends(prefix_lens, query_lens)
    out = case.run(prefix_lens, hi, layer=1)
    torch.testing.assert_close(out.double(), case.expected(prefix_lens, hi), atol=1e-5, rtol=1e-5)
    # the new tokens' K/V landed in their pages
    for r, pages in enumerate(case.page_tables):
        for pos in range(prefix_lens[r], hi[r]):
            page, off = pages[pos // page_size], pos % page_size
            assert torch.equal(case.cache.k[1][page, off], case.k[r][pos])
            assert torch.equal(case.cache.v[1][page, off], case.v[r][pos])


def test_all_lengths_in_one_batch(backend_cls: type[TorchAttentionBackend]) -> None:
    prefix_lens = [p for p in PREFIX_LENS for _ in QUERY_LENS]
    query_lens = [q for _ in PREFIX_LENS for q in QUERY_LENS]
    case = Case(prefix_lens, query_lens, 4, 4, 2, 16, torch.float32, 7, backend_cls)
    case.write_prefix_directly(layer=0)
    hi = seq_ends(prefix_lens, query_lens)
    out = case.run(prefix_lens, hi)
    torch.testing.assert_close(out.double(), case.expected(prefix_lens, hi), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", HEADS)
def test_matches_dense_bfloat16(heads: tuple[int, int], backend_cls: type[TorchAttentionBackend]) -> None:
    prefix_lens, query_lens = random_batch(seed=3, num_reqs=6)
    case = Case(prefix_lens, query_lens, 16, *heads, 64, torch.bfloat16, 3, backend_cls)
    case.write_prefix_directly(layer=0)
    hi = seq_ends(prefix_lens, query_lens)
    out = case.run(prefix_lens, hi)
    torch.testing.assert_close(out.double(), case.expected(prefix_lens, hi), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("sliding_window", [1, 4, 8])
def test_sliding_window(sliding_window: int, backend_cls: type[TorchAttentionBackend]) -> None:
    prefix_lens, query_lens = [0, 17, 40, 5], [16, 3, 16, 1]
    case = Case(prefix_lens, query_lens, 4, 4, 2, 16, torch.float32, 11, backend_cls)
    case.write_prefix_directly(layer=0)
    hi = seq_ends(prefix_lens, query_lens)
    out = case.run(prefix_lens, hi, sliding_window=sliding_window)
    expected = case.expected(prefix_lens, hi, sliding_window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # the window really changes the answer (so this test can tell a backend that ignores it)
    assert not torch.allclose(expected, case.expected(prefix_lens, hi), atol=1e-3)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_prefill_then_extend_equals_one_shot(
    page_size: int, sliding_window: int | None, backend_cls: type[TorchAttentionBackend]
) -> None:
    prefix_lens, query_lens = [1, 5, 17, 40, 0], [3, 16, 1, 16, 3]
    hi = seq_ends(prefix_lens, query_lens)
    zeros = [0] * len(prefix_lens)

    # prefill: the prefixes are the new tokens of an earlier step (requests with no prefix sit it out)
    staged = Case(prefix_lens, query_lens, page_size, 4, 1, 16, torch.float32, 5, backend_cls)
    keep = [r for r, p in enumerate(prefix_lens) if p > 0]
    prefix_kept = [prefix_lens[r] for r in keep]
    prefill = staged.run([0] * len(keep), prefix_kept, sliding_window=sliding_window, reqs=keep)
    expected_prefill = staged.expected([0] * len(keep), prefix_kept, sliding_window, reqs=keep)
    torch.testing.assert_close(prefill.double(), expected_prefill, atol=1e-5, rtol=1e-5)
    # extend: the new tokens read the prefix K/V the prefill step stored
    extend = staged.run(prefix_lens, hi, sliding_window=sliding_window)
    expected_extend = staged.expected(prefix_lens, hi, sliding_window)
    torch.testing.assert_close(extend.double(), expected_extend, atol=1e-5, rtol=1e-5)

    # one shot: the whole sequences in one step, in a fresh cache; its tail equals the extend step
    one_shot = Case(prefix_lens, query_lens, page_size, 4, 1, 16, torch.float32, 5, backend_cls)
    out = one_shot.run(zeros, hi, sliding_window=sliding_window)  # [sum(S), Hq, D]
    starts = [0, *torch.tensor(hi).cumsum(0).tolist()]
    tail = torch.cat([out[starts[r] + prefix_lens[r] : starts[r + 1]] for r in range(len(hi))])
    torch.testing.assert_close(extend, tail, atol=1e-5, rtol=1e-5)


# chunks longer than the CPU flash kernel's blocks, over prefixes that end mid-page: cold chunks, chunks
# over a prefix, decodes at long and short contexts and a one-token cold prompt, all in one step
LONG_BATCH = ([0, 530, 1100, 3, 0, 257], [700, 300, 1, 1, 1, 64])


@pytest.mark.parametrize(
    "page_size, heads, dtype, sliding_window",
    [
        (1, (4, 2), torch.float32, None),
        (16, (4, 1), torch.float32, 100),
        (16, (4, 2), torch.bfloat16, None),
        (1, (4, 1), torch.bfloat16, 100),
    ],
)
def test_sdpa_backend_matches_reference_on_long_ragged_batch(
    page_size: int,
    heads: tuple[int, int],
    dtype: torch.dtype,
    sliding_window: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from longserve.attention import torch_sdpa_backend

    # windowed requests run in blocks of max(window, this) queries: several blocks per chunk here
    monkeypatch.setattr(torch_sdpa_backend, "_WINDOW_QUERY_BLOCK", 64)
    prefix_lens, query_lens = LONG_BATCH
    hi = seq_ends(prefix_lens, query_lens)
    cases = [Case(prefix_lens, query_lens, page_size, *heads, 32, dtype, 13, cls) for cls in BACKENDS]
    outs = []
    for case in cases:
        case.write_prefix_directly(layer=0)
        outs.append(case.run(prefix_lens, hi, sliding_window=sliding_window))
    reference, sdpa = outs
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(sdpa.float(), reference.float(), atol=tol, rtol=tol)
    # both stored the new tokens' K/V alike
    assert torch.equal(cases[0].cache.k[0], cases[1].cache.k[0])
    assert torch.equal(cases[0].cache.v[0], cases[1].cache.v[0])


@pytest.mark.parametrize("sliding_window", [None, 100])
def test_sdpa_backend_uses_the_fused_kernel(sliding_window: int | None) -> None:
    """No explicit boolean mask: CPU SDPA's math path would materialize the [Hq, L, S] scores (the reason
    this backend exists); every step kind reaches the flash kernel."""
    from torch.profiler import profile

    prefix_lens, query_lens = LONG_BATCH
    case = Case(prefix_lens, query_lens, 16, 4, 2, 32, torch.float32, 17, TorchSDPABackend)
    with profile() as prof:
        case.run(prefix_lens, seq_ends(prefix_lens, query_lens), sliding_window=sliding_window)
    ops = [e.name for e in prof.events()]
    assert "aten::_scaled_dot_product_attention_math" not in ops
    # one call per request, two for each chunk over a prefix (2 of them) unless the window reaches it
    expected_calls = 8 if sliding_window is None else 6
    assert ops.count("aten::_scaled_dot_product_flash_attention_for_cpu") == expected_calls


def test_build_metadata_exact_values() -> None:
    # r0: page_size 4, prefix 3, 3 new tokens at positions 3, 4, 5 on pages [7, 2] -> slots 31, 8, 9
    # r1: no prefix, 2 new tokens on page [5] -> slots 20, 21; its page_table row is padded with 0
    meta = build_metadata([3, 0], [3, 2], [[7, 2], [5]], 4, "cpu")
    assert isinstance(meta, AttentionMetadata)
    assert meta.page_size == 4
    assert meta.slot_mapping.tolist() == [31, 8, 9, 20, 21]
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc.tolist() == [0, 3, 5]
    assert meta.seq_lens.tolist() == [6, 2]
    assert meta.prefix_lens.tolist() == [3, 0]
    assert meta.page_table.tolist() == [[7, 2], [5, 0]]
    for t in (meta.query_start_loc, meta.seq_lens, meta.prefix_lens, meta.page_table):
        assert t.dtype == torch.int32
    assert (meta.query_lens_cpu, meta.seq_lens_cpu, meta.prefix_lens_cpu) == ([3, 2], [6, 2], [3, 0])
    assert (meta.num_reqs, meta.num_tokens, meta.max_query_len, meta.max_seq_len) == (2, 5, 3, 6)


def test_step_tensors_start_16_byte_aligned_whatever_the_batch() -> None:
    """Triton specializes pointers on 16-byte alignment: the packed step tensors each start aligned for every
    batch size and token count (their values unchanged), so a kernel compiles once, not once per mix.
    (Unpadded, the page table of B requests started at (3B + 1) int32s: aligned only when B % 4 == 1.)"""
    from longserve.attention.metadata import build_step_tensors

    for num_reqs in range(1, 9):
        for first in (1, 3, 8):
            query_lens = [first] + [1] * (num_reqs - 1)
            tokens = sum(query_lens)
            meta, (ids, pos) = build_step_tensors(
                [16] * num_reqs, query_lens, [[1, 2]] * num_reqs, 16, "cpu",
                extra=(list(range(tokens)), [7] * tokens),
            )  # fmt: skip
            tensors = (
                meta.query_start_loc,
                meta.seq_lens,
                meta.prefix_lens,
                meta.page_table,
                meta.slot_mapping,
            )
            assert all(t.data_ptr() % 16 == 0 for t in (*tensors, ids, pos)), (num_reqs, first)
            assert meta.page_table.tolist() == [[1, 2]] * num_reqs and ids.tolist() == list(range(tokens))
            assert meta.seq_lens.tolist() == [16 + n for n in query_lens] and pos.tolist() == [7] * tokens


def test_build_metadata_rejects_too_few_pages() -> None:
    with pytest.raises(ValueError, match="pages"):
        build_metadata([4], [1], [[3]], 4, "cpu")


def test_registry() -> None:
    from longserve.platform import ATTENTION_BACKEND_CHOICES

    cpu = torch.device("cpu")
    assert isinstance(get_attention_backend("torch", cpu), TorchAttentionBackend)
    assert isinstance(get_attention_backend("auto", cpu), TorchAttentionBackend)
    assert get_attention_backend("torch", cpu).name == "torch"
    # on the CPU every spelling runs the fused-SDPA backend, never the masked reference
    for spelling in ATTENTION_BACKEND_CHOICES:
        assert type(get_attention_backend(spelling, cpu)) is TorchSDPABackend, spelling
    with pytest.raises(ValueError, match="nope") as err:
        get_attention_backend("nope", cpu)
    assert "torch" in str(err.value) and "auto" in str(err.value)
