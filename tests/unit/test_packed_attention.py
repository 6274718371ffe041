"""A short chunk over a long cached prefix through the library's packed call (sdpa.packed_prefix_sdpa): the q
heads of a kv head as rows, the prefix's keys split as the batch, merged with the causal part by
`merge_attention.merge_packed` (interpreted on the CPU) or its reference. Equal to the torch reference backend;
taken only for short chunks over long prefixes on consecutive pages of a 16-bit cache (any dtype on the CPU),
and the lone chunk's CUDA graphs step aside for it; an engine serving hits through it keeps its tokens."""

from __future__ import annotations

import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from test_triton_attention import HEADS, Step  # noqa: E402

from longserve.attention import GraphShape, KVCache, build_metadata  # noqa: E402
from longserve.attention import sdpa_shapes as shapes  # noqa: E402
from longserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from longserve.kernels.attention_reference import merge_packed_ref  # noqa: E402
from longserve.kernels.merge_attention import merge_packed  # noqa: E402


@pytest.mark.parametrize(
    "splits,group,tail,log2", [(1, 4, 0, False), (3, 4, 5, False), (5, 1, 2, True), (2, 4, 0, True)]
)
def test_merge_packed_equals_its_reference(splits: int, group: int, tail: int, log2: bool) -> None:
    """The kernel against the torch reference: prefix partials in cuDNN's [S, Hkv, R, D] with permuted
    strides (rows past the tokens' are padding, never read), the causal part's token rows after `tail`, as
    [Hq, L, D] / [Hq, L] views of [L, Hq, ...] partials and with log2 LSEs where the extend kernel gives them."""
    gen = torch.Generator().manual_seed(splits * 10 + group + tail)
    tokens, hkv, d, rows = 6, 2, 32, 32
    hq = hkv * group
    part = torch.randn(splits, rows, hkv, d, generator=gen).permute(0, 2, 1, 3)  # [S, Hkv, R, D], strided
    part_lse = torch.randn(splits, hkv, rows, generator=gen) * 3
    o_c = torch.randn(tail + tokens + 3, hq, d, generator=gen).transpose(0, 1)  # [Hq, Lc, D]
    lse_c = (torch.randn(tail + tokens + 3, hq, generator=gen) * 3).t()  # [Hq, Lc]
    out = merge_packed(part, part_lse, o_c, lse_c, torch.empty(tokens, hq, d), tail, log2)
    expected = merge_packed_ref(part, part_lse, o_c, lse_c, torch.empty(tokens, hq, d), tail, log2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # the reference itself: one token's head against a direct softmax over the S + 1 partials
    t, h = 4, hq - 1
    j, g = divmod(h, group)
    causal_lse = lse_c[h, tail + t : tail + t + 1] * (math.log(2) if log2 else 1.0)
    lse = torch.cat([part_lse[:, j, t * group + g], causal_lse])
    o = torch.cat([part[:, j, t * group + g], o_c[h, tail + t : tail + t + 1]])
    torch.testing.assert_close(
        expected[t, h], (torch.softmax(lse, 0)[:, None] * o).sum(0), atol=1e-5, rtol=1e-5
    )


@pytest.fixture
def small_packing(monkeypatch: pytest.MonkeyPatch):
    """The packed path's constants at a test's size (prefixes read in granules of 16 keys, packed from 32 keys of
    prefix, 8 padded rows a kv head; causal parts padded to 16 rows), and a record of each packed request's
    split count, one dict a forward that ran any."""
    monkeypatch.setattr(shapes, "PACKED_PREFIX_CALLS", True)
    monkeypatch.setattr(shapes, "PREFIX_GRANULE", 16)
    monkeypatch.setattr(shapes, "PACKED_MIN_PREFIX", 32)
    monkeypatch.setattr(shapes, "PACKED_ROWS", 8)
    monkeypatch.setattr(shapes, "Q_GRANULE", 16)
    calls: list[dict[int, int]] = []
    real = TritonAttentionBackend._packed

    def packed(self, q, k_cache, v_cache, meta, r, splits, *args):
        if not calls or r in calls[-1]:
            calls.append({})
        calls[-1][r] = splits
        return real(self, q, k_cache, v_cache, meta, r, splits, *args)

    monkeypatch.setattr(TritonAttentionBackend, "_packed", packed)
    return calls


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("contiguous", [False, True], ids=["scattered", "consecutive"])
def test_short_chunks_over_long_prefixes_run_packed(
    small_packing, heads: tuple[int, int], contiguous: bool
) -> None:
    """Chunks of 3-4 tokens over 40 / 75 cached keys (tails of 8 and 11 keys in the causal part) run packed on
    consecutive pages, beside a chunk over a short prefix and a decode over a long one in the Triton kernel;
    scattered pages and chunks with more rows than PACKED_ROWS stay in Triton. All equal to the torch reference."""
    group = heads[0] // heads[1]
    step = Step([40, 75, 9, 50], [3, 4, 4, 1], 4, heads, 32, seed=21, contiguous=contiguous)
    step.compare(TritonAttentionBackend(cold_path="sdpa"))
    assert small_packing == ([{0: 2, 1: 4}] if contiguous else [])
    # 5 tokens x 2 q heads a kv head = 10 rows: over PACKED_ROWS (8), so the Triton kernel; with one, packed
    wide = Step([40], [5], 4, heads, 32, seed=22, contiguous=contiguous)
    wide.compare(TritonAttentionBackend(cold_path="sdpa"))
    assert small_packing[1:] == ([{0: 2}] if contiguous and group == 1 else [])


def test_no_packing_for_an_fp8_cache_or_the_triton_cold_path(small_packing) -> None:
    """cuDNN reads no e4m3 pages (a gather and dequantization of the whole prefix would cost more than the call
    saves): an fp8 cache's chunk stays in Triton; so does every chunk of a backend whose cold path is Triton."""
    step = Step([40], [3], 4, (4, 2), 32, seed=23, contiguous=True)
    backend = TritonAttentionBackend(cold_path="sdpa")
    q, meta = step.q, step.meta
    assert backend._library_plan(q, 2, meta, kv_fp8=False).packed == {0: 2}
    assert backend._library_plan(q, 2, meta, kv_fp8=True).requests == ()
    assert backend.library_requests(q, 2, meta) == (0,)
    step.compare(TritonAttentionBackend(cold_path="triton"))
    assert small_packing == []


def test_lone_chunk_graphs_step_aside_for_a_packed_chunk(small_packing) -> None:
    """graph_defers: True exactly when the lone chunk would run packed (the graphs' Triton kernel otherwise)."""
    cache = KVCache(1, 40, 4, 2, 32, torch.float32, "cpu")
    shape = GraphShape(160, 4, 2, 32, torch.float32, torch.device("cpu"))
    backend = TritonAttentionBackend()  # cold_path None: "triton" on the CPU, so nothing defers there
    sdpa = TritonAttentionBackend(cold_path="sdpa")
    consecutive = build_metadata([40], [3], [list(range(2, 13))], 4, "cpu")
    scattered = build_metadata([40], [3], [[2, 5, 3, 7, 9, 4, 6, 8, 10, 11, 12]], 4, "cpu")
    short_prefix = build_metadata([12], [3], [list(range(2, 6))], 4, "cpu")
    assert not backend.graph_defers(consecutive, shape, cache)
    assert sdpa.graph_defers(consecutive, shape, cache)
    assert not sdpa.graph_defers(scattered, shape, cache) and not sdpa.graph_defers(
        short_prefix, shape, cache
    )


def test_packed_splits_and_warm_up_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split counts: one per PREFIX_GRANULE of prefix; built from PACKED_MIN_PREFIX to the context; none
    with the packed calls off."""
    monkeypatch.setattr(shapes, "PACKED_PREFIX_CALLS", False)
    assert shapes.packed_splits(32768, 64, 4) is None and shapes.warm_up_packed_splits(32768) == []
    monkeypatch.setattr(shapes, "PACKED_PREFIX_CALLS", True)
    assert shapes.packed_splits(32768, 64, 4) == 16 and shapes.packed_splits(33000, 64, 4) == 16
    assert shapes.packed_splits(32768, 65, 4) is None  # 260 rows: over PACKED_ROWS
    assert shapes.packed_splits(8191, 64, 4) is None and shapes.packed_splits(8192, 256, 1) == 4
    assert shapes.warm_up_packed_splits(32768) == list(range(4, 16))  # a 32K context's prefix stops below 32K
    assert shapes.warm_up_packed_splits(8192) == []
    registry = shapes.PlanRegistry()
    model = shapes.ModelShape(32, 8, 128, torch.bfloat16)
    cuda = torch.device("cuda")
    assert not registry.packed_ready(model, 16, cuda) and registry.packed_ready(
        model, 16, torch.device("cpu")
    )
    registry.mark_packed(model, 16)
    assert registry.packed_ready(model, 16, cuda) and not registry.packed_ready(model, 15, cuda)


def test_an_engine_serving_prefix_hits_packed_gives_the_plain_tokens(
    small_packing, monkeypatch, tmp_path
) -> None:
    """Questions over a cached head (32 tokens on two consecutive pages, hit by every later prompt) through an
    engine on the Triton backend (the CPU's default is torch's) taking the library paths: its hits run packed (3
    of 4 prompts: the first computes the head), with the Triton-only engine's greedy tokens, every page back."""
    from longserve import LLM, SamplingParams
    from longserve.testing.checkpoints import make_tiny_checkpoint

    monkeypatch.setattr(shapes, "PACKED_ROWS", 64)  # 12 new tokens (8 of the head's tail, 4 asked) x 2 heads
    ckpt = make_tiny_checkpoint(tmp_path, "qwen3", num_layers=2)
    g = torch.Generator().manual_seed(5)
    head = torch.randint(10, 500, (40,), generator=g).tolist()
    prompts = [head + torch.randint(10, 500, (4,), generator=g).tolist() for _ in range(4)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = []
    for cold_path in ("triton", "sdpa"):
        llm = LLM(ckpt, dtype="float32", device="cpu", max_total_tokens=1024)
        llm.engine.runner.backend = TritonAttentionBackend(cold_path=cold_path)
        tokens.append([llm.generate([p], params)[0].token_ids for p in prompts])
        llm.engine.check_integrity()
    assert tokens[1] == tokens[0]
    assert small_packing == [{0: 2}] * 3 * 2  # three hits, two layers each; none in the Triton-only engine
