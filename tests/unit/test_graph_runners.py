"""The static-buffer forwards that CUDA graphs replay (runner/cuda_graph.py), run eagerly on the CPU with the
Triton kernels interpreted: a short chunk over a cached prefix (ExtendGraphRunner) or a decode batch
(DecodeGraphRunner), padded to its bucket, gives the same hidden states as a plain step, padding writes K/V
only into page 0, and the graphs capture with the backends the attention backend's hooks return."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from longserve.attention import ForwardContext, GraphShape, KVCache, build_metadata  # noqa: E402
from longserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from longserve.kernels.decode_attention import choose_num_splits  # noqa: E402
from longserve.models import load_hf_config, load_model  # noqa: E402
from longserve.runner.cuda_graph import DecodeGraphRunner, ExtendGraphRunner, graph_token_buckets  # noqa: E402
from longserve.testing.checkpoints import make_tiny_checkpoint  # noqa: E402

PAGE = 16


@pytest.fixture(scope="module")
def model_and_dir(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("xg"), "qwen3", num_layers=2)
    hf = load_hf_config(path)
    return load_model(path, hf, torch.float32, torch.device("cpu")), hf


def graph_shape(model, max_seq_len: int) -> GraphShape:
    return GraphShape(
        max_seq_len, model.num_heads, model.num_kv_heads, model.head_dim, torch.float32, torch.device("cpu")
    )


def test_token_buckets():
    assert graph_token_buckets(256) == [16, 32, 64, 128, 256]
    assert graph_token_buckets(100) == [16, 32, 64, 100]
    assert graph_token_buckets(8) == [8]
    assert graph_token_buckets(1) == []


@pytest.mark.parametrize("prefix_len,new", [(40, 7), (32, 16), (0, 5), (70, 33)])
def test_padded_static_forward_equals_plain_step(model_and_dir, prefix_len, new):
    model, hf = model_and_dir
    torch.manual_seed(prefix_len + new)
    max_pages = 12
    cache = KVCache(model.num_layers, 40, PAGE, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    pages = (torch.randperm(38)[: -(-(prefix_len + new) // PAGE)] + 2).tolist()  # never page 0 or 1
    ids = torch.randint(5, hf.vocab_size, (prefix_len + new,))
    backend = TritonAttentionBackend(cold_path="triton")
    with torch.inference_mode():
        if prefix_len:  # the cached prefix: its K/V in the pages
            meta = build_metadata([0], [prefix_len], [pages], PAGE, "cpu")
            model(ids[:prefix_len], torch.arange(prefix_len), ForwardContext(meta, cache, backend))
        meta = build_metadata([prefix_len], [new], [pages], PAGE, "cpu")
        positions = torch.arange(prefix_len, prefix_len + new)
        plain = model(ids[prefix_len:], positions, ForwardContext(meta, cache, backend))  # [n, H]
        k_real = cache.k[0][pages].clone()

        runner = ExtendGraphRunner(
            model, cache, TritonAttentionBackend(cold_path="triton", extend_splits=2),
            graph_shape(model, max_pages * PAGE), max_tokens=64,
        )  # fmt: skip
        runner.eager = True
        runner.page_table.fill_(1)  # stale entries from an earlier, longer request must not matter
        assert runner.can_run(meta)
        cache.k[0][0].zero_()
        got = runner.run(ids[prefix_len:], positions, meta)
    torch.testing.assert_close(got, plain, atol=1e-4, rtol=1e-4)
    # the real pages hold the K/V of the plain step (same values, up to the GEMM's rounding at another M)
    torch.testing.assert_close(cache.k[0][pages], k_real, atol=1e-5, rtol=1e-5)
    bucket = next(b for b in runner.buckets if b >= new)
    assert cache.k[0][0].abs().sum() > 0 or bucket == new  # padding wrote into page 0


def test_can_run_limits(model_and_dir):
    model, _ = model_and_dir
    cache = KVCache(model.num_layers, 8, PAGE, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    runner = ExtendGraphRunner(
        model, cache, TritonAttentionBackend(cold_path="triton"), graph_shape(model, 4 * PAGE), max_tokens=32
    )
    runner.eager = True
    assert runner.can_run(build_metadata([16], [20], [[1, 2, 3]], PAGE, "cpu"))
    assert not runner.can_run(
        build_metadata([16], [33], [[1, 2, 3, 4]], PAGE, "cpu")
    )  # over the largest bucket
    assert not runner.can_run(build_metadata([40], [1], [[1, 2, 3]], PAGE, "cpu"))  # one token: decode's
    assert not runner.can_run(build_metadata([50], [8], [[1, 2, 3, 4]], PAGE, "cpu"))  # 50 + bucket 16 > 64
    assert not runner.can_run(build_metadata([0, 0], [4, 4], [[1], [2]], PAGE, "cpu"))  # two requests


def test_the_lone_chunk_graphs_step_aside_only_for_the_pieces(model_and_dir):
    """A chunk whose attention the backend runs outside graphs (graph_defers: the packed cuDNN call) is left to the
    piecewise graphs when there are pieces for it (`defers`, set by build_graphs); without them the graph still
    runs it (the backend's graph variant), as an eager step would be slower than either."""
    model, _ = model_and_dir

    class Deferring(TritonAttentionBackend):
        def graph_defers(self, meta, shape, kv_cache):
            return meta.prefix_lens_cpu[0] >= 32

    cache = KVCache(model.num_layers, 8, PAGE, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    runner = ExtendGraphRunner(
        model, cache, Deferring(cold_path="triton"), graph_shape(model, 4 * PAGE), max_tokens=16
    )
    runner.eager = True
    long_prefix = build_metadata([32], [8], [[1, 2, 3]], PAGE, "cpu")
    short_prefix = build_metadata([16], [8], [[1, 2]], PAGE, "cpu")
    assert runner.can_run(long_prefix) and runner.can_run(short_prefix)  # no pieces: the graph runs both
    runner.defers = True
    assert not runner.can_run(long_prefix) and runner.can_run(short_prefix)


def test_buckets_never_exceed_the_page_table(model_and_dir):
    """A pool smaller than the largest bucket (192 tokens, buckets up to 512): capturing a 512-token bucket
    would make its padding rows read page-table entries past the table's end (an illegal address on a GPU)."""
    model, _ = model_and_dir
    cache = KVCache(model.num_layers, 13, PAGE, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    runner = ExtendGraphRunner(
        model, cache, TritonAttentionBackend(cold_path="triton"), graph_shape(model, 192), max_tokens=512
    )
    assert runner.buckets == [16, 32, 64, 128, 192] and runner.max_tokens == 192
    assert runner.buckets[-1] <= runner.page_table.shape[1] * PAGE


def test_decode_static_forward_equals_plain_step(model_and_dir):
    """Three requests decode through the bucket of 4 (one padding row at page 0) with the split count the
    backend fixed for that bucket; the backend's replay hook sees the step's own metadata."""
    model, hf = model_and_dir
    torch.manual_seed(3)
    prefix_lens = [17, 3, 40]
    cache = KVCache(model.num_layers, 40, PAGE, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    free = (torch.randperm(38) + 2).tolist()  # never page 0 or 1
    tables = []
    for p in prefix_lens:
        n = -(-(p + 1) // PAGE)
        tables.append(free[:n])
        free = free[n:]
    ids = [torch.randint(5, hf.vocab_size, (p + 1,)) for p in prefix_lens]
    backend = TritonAttentionBackend()
    with torch.inference_mode():
        meta = build_metadata([0] * 3, prefix_lens, tables, PAGE, "cpu")  # the prefixes' K/V into the pages
        positions = torch.cat([torch.arange(p) for p in prefix_lens])
        model(torch.cat([x[:-1] for x in ids]), positions, ForwardContext(meta, cache, backend))
        meta = build_metadata(prefix_lens, [1, 1, 1], tables, PAGE, "cpu")
        last_ids, positions = torch.stack([x[-1] for x in ids]), torch.tensor(prefix_lens)
        plain = model(last_ids, positions, ForwardContext(meta, cache, backend))  # [3, H]

        shape = graph_shape(model, 12 * PAGE)
        runner = DecodeGraphRunner(model, cache, backend, shape, max_bs=4)
        assert runner.batch_sizes == [1, 2, 4]
        assert runner.backends[4].num_splits == choose_num_splits(12 * PAGE, 4, model.num_kv_heads, 4)
        seen = []
        runner.backends[4].prepare_for_replay = lambda m: seen.append(m.seq_lens_cpu)
        runner.eager = True
        runner.page_table.fill_(1)  # stale entries from an earlier, longer batch must not matter
        assert runner.can_run(meta)
        cache.k[0][0].zero_()
        got = runner.run(last_ids, positions, meta)
    torch.testing.assert_close(got, plain, atol=1e-4, rtol=1e-4)
    assert seen == [[p + 1 for p in prefix_lens]]
    assert cache.k[0][0, 0].abs().sum() > 0  # the padding row wrote its K/V into page 0
    assert not runner.can_run(build_metadata([4], [2], [[2]], PAGE, "cpu"))  # two new tokens: not decode


@pytest.mark.parametrize("splits", [1, 2])
def test_windowed_padding_rows_write_no_nan(tmp_path, splits):
    """A sliding-window model's padding rows (past the window of any key) see no key: their attention is 0, not NaN,
    so the K/V the next layer stores into the reserved page 0 stay finite (NaN there before, with one split or the
    merge of all-empty splits); the real rows equal a plain step's."""
    path = make_tiny_checkpoint(tmp_path, "mistral", num_layers=2)  # a window of 8 keys
    hf = load_hf_config(path)
    model = load_model(path, hf, torch.float32, torch.device("cpu"))
    cache = KVCache(model.num_layers, 40, PAGE, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    prefix_len, new = 70, 7
    pages = list(range(2, 2 + -(-(prefix_len + new) // PAGE)))
    ids = torch.randint(5, hf.vocab_size, (prefix_len + new,), generator=torch.Generator().manual_seed(0))
    backend = TritonAttentionBackend(cold_path="triton")
    positions = torch.arange(prefix_len, prefix_len + new)
    with torch.inference_mode():
        meta = build_metadata([0], [prefix_len], [pages], PAGE, "cpu")
        model(ids[:prefix_len], torch.arange(prefix_len), ForwardContext(meta, cache, backend))
        meta = build_metadata([prefix_len], [new], [pages], PAGE, "cpu")
        plain = model(ids[prefix_len:], positions, ForwardContext(meta, cache, backend))
        runner = ExtendGraphRunner(
            model, cache, TritonAttentionBackend(cold_path="triton", extend_splits=splits),
            graph_shape(model, 12 * PAGE), max_tokens=16,
        )  # fmt: skip
        runner.eager = True
        for layer in range(model.num_layers):
            cache.k[layer][0].zero_()
            cache.v[layer][0].zero_()
        got = runner.run(ids[prefix_len:], positions, meta)
    assert all(torch.isfinite(c[0]).all() for c in (*cache.k, *cache.v))
    torch.testing.assert_close(got, plain, atol=1e-4, rtol=1e-4)


def test_hybrid_decode_static_forward_equals_plain_step(tmp_path):
    """A hybrid model's decode batch through the static buffers (the decode graphs a GPU replays): three requests in
    the bucket of 4, its padding row at slot -1 (a zero state, nothing written: every slot but the three keeps its
    contents), the same hidden states and states as a plain step; a one-token prompt (no history) runs eagerly."""
    from longserve.attention.recurrent_state import RecurrentStates

    path = make_tiny_checkpoint(tmp_path, "qwen3_5_moe", seed=2)
    hf = load_hf_config(path)
    model = load_model(path, hf, torch.float32, torch.device("cpu"))
    num_layers, spec = model.recurrent_states()
    prefix_lens, slots = [17, 3, 40], [4, 0, 2]
    cache = KVCache(model.num_layers, 40, PAGE, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    tables = [[2, 3], [4], [5, 6, 7]]
    ids = [
        torch.randint(5, hf.vocab_size, (p + 1,), generator=torch.Generator().manual_seed(p))
        for p in prefix_lens
    ]
    backend = TritonAttentionBackend()
    states = RecurrentStates(num_layers, spec, 6, torch.float32, torch.float32, "cpu")
    with torch.inference_mode():
        meta = build_metadata([0] * 3, prefix_lens, tables, PAGE, "cpu")
        meta.state_slots = torch.tensor(slots)
        positions = torch.cat([torch.arange(p) for p in prefix_lens])
        model(torch.cat([x[:-1] for x in ids]), positions, ForwardContext(meta, cache, backend, states))
        before = [t.clone() for t in (*states.conv, *states.ssm)]
        meta = build_metadata(prefix_lens, [1, 1, 1], tables, PAGE, "cpu")
        meta.state_slots = torch.tensor(slots)
        last_ids, positions = torch.stack([x[-1] for x in ids]), torch.tensor(prefix_lens)
        plain = model(last_ids, positions, ForwardContext(meta, cache, backend, states))  # [3, H]
        after = [t.clone() for t in (*states.conv, *states.ssm)]
        for t, b in zip((*states.conv, *states.ssm), before):  # back to the states before the decode
            t.copy_(b)

        runner = DecodeGraphRunner(
            model, cache, backend, graph_shape(model, 12 * PAGE), max_bs=4, states=states
        )
        runner.eager = True
        runner.state_slots.fill_(5)  # stale slots from an earlier batch must not matter
        assert runner.can_run(meta)
        got = runner.run(last_ids, positions, meta)
        fresh = build_metadata([0], [1], [[8]], PAGE, "cpu")
        assert not runner.can_run(fresh)  # a one-token prompt starts its state eagerly
    torch.testing.assert_close(got, plain, atol=1e-4, rtol=1e-4)
    for t, a in zip((*states.conv, *states.ssm), after):
        torch.testing.assert_close(
            t, a, atol=1e-5, rtol=1e-5
        )  # slots 1, 3, 5 untouched (zeros), the rest stepped
    assert all(float(t[[1, 3, 5]].abs().sum()) == 0 for t in (*states.conv, *states.ssm))
