"""The static-buffer forward that prefill CUDA graphs replay (runner/cuda_graph.py ExtendGraphRunner),
run eagerly on the CPU with the Triton kernels interpreted: a short chunk over a cached prefix, padded to
its bucket, gives the same hidden states as a plain step, and padding writes K/V only into page 0."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from longserve.attention import ForwardContext, KVCache, build_metadata  # noqa: E402
from longserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from longserve.models import load_hf_config, load_model  # noqa: E402
from longserve.runner.cuda_graph import ExtendGraphRunner, graph_token_buckets  # noqa: E402
from tests.checkpoints import make_tiny_checkpoint  # noqa: E402

PAGE = 16


@pytest.fixture(scope="module")
def model_and_dir(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("xg"), "qwen3", num_layers=2)
    hf = load_hf_config(path)
    return load_model(path, hf, torch.float32, torch.device("cpu")), hf


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
            model, cache, lambda t: TritonAttentionBackend(cold_path="triton", extend_splits=2),
            max_tokens=64, max_pages_per_req=max_pages, page_size=PAGE, device=torch.device("cpu"),
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
        model, cache, lambda t: TritonAttentionBackend(cold_path="triton"),
        max_tokens=32, max_pages_per_req=4, page_size=PAGE, device=torch.device("cpu"),
    )  # fmt: skip
    runner.eager = True
    assert runner.can_run(build_metadata([16], [20], [[1, 2, 3]], PAGE, "cpu"))
    assert not runner.can_run(
        build_metadata([16], [33], [[1, 2, 3, 4]], PAGE, "cpu")
    )  # over the largest bucket
    assert not runner.can_run(build_metadata([40], [1], [[1, 2, 3]], PAGE, "cpu"))  # one token: decode's
    assert not runner.can_run(build_metadata([50], [8], [[1, 2, 3, 4]], PAGE, "cpu"))  # 50 + bucket 16 > 64
    assert not runner.can_run(build_metadata([0, 0], [4, 4], [[1], [2]], PAGE, "cpu"))  # two requests
