"""The lone chunk's packed graph (attention/packed_graph.py) on the CPU, its cuDNN call answered by its torch reference
and the Triton kernels interpreted: a short chunk over a long cached prefix, replayed through ExtendGraphRunner's
packed bucket, gives the hidden states of a plain step; a short prefix takes the plain bucket; the splits never
leave one empty; every per-step input reaches the device in one buffer."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from longserve.attention import (  # noqa: E402
    ForwardContext,
    GraphShape,
    KVCache,
    build_metadata,
    packed_graph,
    sdpa_shapes,
)
from longserve.attention.packed_graph import PackedPrefixBackend, prefix_attention_ref, split_pages  # noqa: E402
from longserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from longserve.models import load_hf_config, load_model  # noqa: E402
from longserve.runner.cuda_graph import ExtendGraphRunner  # noqa: E402
from longserve.testing.checkpoints import make_tiny_checkpoint  # noqa: E402

PAGE = 16


@pytest.fixture(scope="module")
def model_and_config(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("pg"), "qwen3", num_layers=2)  # 4 q heads, 2 kv heads
    hf = load_hf_config(path)
    return load_model(path, hf, torch.float32, torch.device("cpu")), hf


@pytest.fixture
def packed_on(monkeypatch):
    monkeypatch.setattr(packed_graph, "PACKED_GRAPHS", True)
    monkeypatch.setattr(packed_graph, "PACKED_GRAPH_SPLITS", 3)
    monkeypatch.setattr(sdpa_shapes, "PACKED_MIN_PREFIX", 48)


def test_split_pages_cover_the_prefix_with_no_empty_split():
    for num_pages in (3, 4, 17, 512, 2048, 2049):
        for splits in (3, 16):
            if num_pages < splits:
                continue
            runs = split_pages(num_pages, splits)
            assert runs[0][0] == 0 and runs[-1][1] == num_pages and len(runs) == splits
            assert all(a < b for a, b in runs) and all(b == c for (_, b), (c, _) in zip(runs, runs[1:]))
            assert max(b - a for a, b in runs) <= -(-num_pages // splits)  # within the plan's table width


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("pgw"), "mistral", num_layers=2)  # a window of 8 keys
    hf = load_hf_config(path)
    return load_model(path, hf, torch.float32, torch.device("cpu")), hf


@pytest.mark.parametrize(
    "which,prefix_len,new",
    # windowed: a sliding-window model, whose layers take the plain backend's kernel in the packed bucket; fused:
    # the causal part and the merge in one op (PACKED_TAIL_FUSED; its reference here, the kernel in test_packed_tail);
    # placed: that, and the rotary kernel (interpreted, as on a GPU; the qwen3 model's q/k norms in it) writes q
    # into the packed rows itself (PACKED_Q_BY_ROPE)
    [
        ("plain", 70, 7),
        ("plain", 64, 16),
        ("plain", 100, 9),
        ("windowed", 70, 7),
        ("fused", 70, 7),
        ("fused", 64, 16),
        ("placed", 70, 7),
        ("placed", 64, 16),
    ],
)
def test_packed_bucket_equals_plain_step(request, packed_on, monkeypatch, which, prefix_len, new):
    monkeypatch.setattr(packed_graph, "PACKED_TAIL_FUSED", which in ("fused", "placed"))
    placed = []
    if which == "placed":
        from longserve.models import rope

        monkeypatch.setattr(packed_graph, "PACKED_Q_BY_ROPE", True)
        monkeypatch.setattr(rope, "use_triton", lambda x: True)  # the fused rotary kernel, as on CUDA
        forward = PackedPrefixBackend.forward

        def spy(self, *args, **kwargs):
            placed.append(kwargs.get("q_placed"))
            return forward(self, *args, **kwargs)

        monkeypatch.setattr(PackedPrefixBackend, "forward", spy)
    model, hf = request.getfixturevalue("windowed_model" if which == "windowed" else "model_and_config")
    torch.manual_seed(prefix_len + new)
    max_pages = 12
    cache = KVCache(model.num_layers, 40, PAGE, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    # scattered pages, never page 0 or 1
    pages = (torch.randperm(38)[: -(-(prefix_len + new) // PAGE)] + 2).tolist()
    ids = torch.randint(5, hf.vocab_size, (prefix_len + new,))
    backend = TritonAttentionBackend(cold_path="triton")
    shape = GraphShape(
        max_pages * PAGE,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
        torch.float32,
        torch.device("cpu"),
    )
    with torch.inference_mode():
        # the cached prefix: its K/V in the pages
        meta = build_metadata([0], [prefix_len], [pages], PAGE, "cpu")
        model(ids[:prefix_len], torch.arange(prefix_len), ForwardContext(meta, cache, backend))
        meta = build_metadata([prefix_len], [new], [pages], PAGE, "cpu")
        positions = torch.arange(prefix_len, prefix_len + new)
        plain = model(ids[prefix_len:], positions, ForwardContext(meta, cache, backend))  # [n, H]

        runner = ExtendGraphRunner(
            model, cache, TritonAttentionBackend(cold_path="triton"), shape, max_tokens=32
        )
        runner.eager = True
        assert sorted(runner.packed) == [16, 32] and all(
            isinstance(b, PackedPrefixBackend) for b in runner.packed.values()
        )
        packed = runner.packed[16]
        packed.table.fill_(7)  # stale entries from an earlier, longer request must not matter
        got = runner.run(ids[prefix_len:], positions, meta)
        assert runner.num_packed_runs == 1
        # every split holds keys, the causal part starts at the prefix's last whole page
        prefix_pages = prefix_len // PAGE
        assert packed.len_kv.flatten().tolist() == [(b - a) * PAGE for a, b in split_pages(prefix_pages, 3)]
        qsl, pre, seq, causal_pages = packed.causal
        tail = prefix_len - prefix_pages * PAGE
        assert (qsl.tolist(), pre.item(), seq.item()) == ([0, 16], tail, tail + new)
        assert causal_pages[0, : len(pages) - prefix_pages].tolist() == pages[prefix_pages:]
    torch.testing.assert_close(got, plain, atol=1e-4, rtol=1e-4)
    if which == "placed":  # every layer's q came through the rotary kernel, none copied by the backend
        assert placed == [True] * model.num_layers


def test_short_prefix_takes_the_plain_bucket(model_and_config, packed_on):
    model, _ = model_and_config
    cache = KVCache(model.num_layers, 16, PAGE, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    shape = GraphShape(
        8 * PAGE, model.num_heads, model.num_kv_heads, model.head_dim, torch.float32, torch.device("cpu")
    )
    runner = ExtendGraphRunner(model, cache, TritonAttentionBackend(cold_path="triton"), shape, max_tokens=16)
    runner.eager = True
    ids = torch.randint(5, 100, (8,))
    with torch.inference_mode():
        runner.run(ids, torch.arange(32, 40), build_metadata([32], [8], [[1, 2, 3]], PAGE, "cpu"))  # 32 < 48
    assert runner.num_runs == 1 and runner.num_packed_runs == 0


def test_on_by_default_and_only_for_16_bit_caches(model_and_config, monkeypatch):
    model, _ = model_and_config
    shape = GraphShape(
        8 * PAGE, model.num_heads, model.num_kv_heads, model.head_dim, torch.float32, torch.device("cpu")
    )
    cache = KVCache(model.num_layers, 16, PAGE, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    assert packed_graph.PACKED_GRAPHS  # on since the thirty-fifth session's A/B (RESULTS.md)
    assert packed_graph.packs(16, shape, cache)
    assert not packed_graph.packs(256, shape, cache)  # 512 rows a kv head: over PACKED_ROWS
    fp8 = KVCache(model.num_layers, 16, PAGE, model.num_kv_heads, model.head_dim, torch.float8_e4m3fn, "cpu")
    assert not packed_graph.packs(16, shape, fp8)
    assert ExtendGraphRunner(model, cache, TritonAttentionBackend(), shape, max_tokens=16).packed
    monkeypatch.setattr(packed_graph, "PACKED_GRAPHS", False)
    assert ExtendGraphRunner(model, cache, TritonAttentionBackend(), shape, max_tokens=16).packed == {}


def test_reference_split_attention_merges_to_full_attention():
    """prefix_attention_ref's splits, merged by their log-sum-exps, are attention over the whole prefix."""
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(20, PAGE, 2, 8), torch.randn(20, PAGE, 2, 8)
    q_rows = torch.randn(2, 6, 8)
    pages = [3, 9, 1, 12, 5, 7]
    table = torch.zeros(3, 1, 2, 1, dtype=torch.int32)
    lens = torch.zeros(3, 1, 1, 1, dtype=torch.int32)
    for s, (a, b) in enumerate(split_pages(len(pages), 3)):
        table[s, 0, : b - a, 0] = torch.tensor(pages[a:b])
        lens[s] = (b - a) * PAGE
    o, lse = prefix_attention_ref(q_rows, k_cache, v_cache, table, lens, 0.3)
    w = torch.softmax(lse, 0)  # [S, Hkv, R]
    merged = (o * w[..., None]).sum(0)
    k = k_cache[pages].flatten(0, 1).transpose(0, 1)  # [Hkv, P, D]
    v = v_cache[pages].flatten(0, 1).transpose(0, 1)
    full = torch.softmax(torch.einsum("hrd,hkd->hrk", q_rows, k) * 0.3, -1) @ v
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        torch.logsumexp(lse, 0), torch.logsumexp(torch.einsum("hrd,hkd->hrk", q_rows, k) * 0.3, -1)
    )


def test_a_failed_packed_capture_leaves_the_plain_buckets(model_and_config, packed_on, monkeypatch, caplog):
    """The packed graphs are an optimisation: when their capture raises (a cuDNN build the GPU refuses), the runner
    logs why and replays the plain buckets for every step; the server still starts."""
    from longserve.runner import cuda_graph

    model, _ = model_and_config
    cache = KVCache(model.num_layers, 16, PAGE, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    shape = GraphShape(
        8 * PAGE, model.num_heads, model.num_kv_heads, model.head_dim, torch.float32, torch.device("cpu")
    )
    runner = ExtendGraphRunner(model, cache, TritonAttentionBackend(cold_path="triton"), shape, max_tokens=16)
    assert runner.packed

    def capture(sizes, forward, pool, graphs, outputs, what):
        if "cuDNN" in what:
            raise RuntimeError("cudnn: no plan for this graph")
        graphs.update({n: f"graph {n}" for n in sizes})

    monkeypatch.setattr(cuda_graph, "capture_graphs", capture)
    with caplog.at_level("WARNING", logger="longserve.runner.cuda_graph"):
        runner.capture(pool=object())
    assert runner.packed == {} and runner.packed_graphs == {} and runner.graphs == {16: "graph 16"}
    assert "no plan for this graph" in caplog.text
