"""Tensor parallelism on GPUs (NCCL): TP=2 gives the same greedy tokens as TP=1 for every architecture
(fp32), with CUDA graphs for decode under TP equal to eager, and a prefix-cache hit computing only the rest.
Needs two GPUs (`nvidia-h200-x2`); skipped otherwise."""

from __future__ import annotations

import pytest
import torch

from longserve import LLM, SamplingParams
from longserve.distributed import get_tp_group
from longserve.testing.checkpoints import ARCHS, make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def prompts(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(10, 500, (48,), generator=g).tolist()
    return [head + torch.randint(10, 500, (5 + 23 * i,), generator=g).tolist() for i in range(n)]


def run(path, **kw):
    """(tokens of a batch, tokens of a follow-up hitting the prefix cache, tokens that follow-up computed,
    whether decode ran CUDA graphs)."""
    ps = prompts()
    with LLM(path, dtype="float32", device="cuda", max_total_tokens=8192, chunked_prefill_size=64, **kw) as m:
        batch = [o.token_ids for o in m.generate(ps[:-1], GREEDY)]
        before = m.engine.runner.num_tokens_computed
        hit = m.generate(ps[-1], GREEDY)[0].token_ids
        computed = m.engine.runner.num_tokens_computed - before
        m.engine.check_integrity()
        graphs = m.engine.runner.graph_runner is not None
    assert get_tp_group() is None
    return batch, hit, computed, graphs


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_equals_tp1_on_gpus(tmp_path, arch):
    path = make_tiny_checkpoint(tmp_path, arch, tie_word_embeddings=arch == "qwen2", num_layers=3)
    ref = run(path, attention_backend="triton")
    tp2 = run(path, attention_backend="triton", tp_size=2)
    assert ref[3] and tp2[3], "decode should replay CUDA graphs at TP=1 and TP=2"
    assert tp2[:3] == ref[:3]
    assert len(set(ref[1])) > 3


def test_tp2_overlapped_halves_equal_tp1(tmp_path):
    """Steps of >= 8 tokens as two halves with overlapped NCCL all-reduces give TP=1's tokens."""
    path = make_tiny_checkpoint(tmp_path, "qwen3", num_layers=3)
    ref = run(path, attention_backend="triton")
    got = run(path, attention_backend="triton", tp_size=2, tp_overlap_min_tokens=8)
    assert got[:3] == ref[:3]


def test_tp2_cuda_graphs_equal_eager(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama", num_layers=3)
    eager = run(path, attention_backend="triton", tp_size=2, enforce_eager=True)
    graphs = run(path, attention_backend="triton", tp_size=2)
    assert not eager[3] and graphs[3]
    assert graphs[:3] == eager[:3]
