"""Hybrid models (Qwen3.5-MoE, Qwen3-Next; tiny) under tensor parallelism on the CPU (gloo): the key and value heads of its
linear-attention layers split over the ranks (each rank its heads' conv channels, states, dt_bias and A_log),
out_proj row-parallel. TP=2 greedy tokens equal TP=1's, in chunks and in steps cut in two halves (a request cut
mid-chunk continues in the second half from the state the first left); dummy weights are the same model at
either size; the state slots travel with a cut step."""

from __future__ import annotations

import pytest

from longserve import LLM, SamplingParams
from longserve.runner.inputs import StepInputs, split_step
from longserve.testing.checkpoints import make_tiny_checkpoint
from tests.parallel.test_tensor_parallel import prompts

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_5_moe"), "qwen3_5_moe", seed=9)


def run(path: str, **kw) -> list[list[int]]:
    with LLM(path, dtype="float32", device="cpu", max_total_tokens=2048, page_size=16, chunked_prefill_size=16,
             **kw) as m:  # fmt: skip
        out = [o.token_ids for o in m.generate(prompts(), GREEDY)]
        m.engine.check_integrity()
        assert m.engine.kv.states.num_free == m.engine.kv.states.num_total
        overlapped = m.engine.runner.num_overlapped_passes
    assert overlapped > 0 if kw.get("tp_overlap_min_tokens") else overlapped == 0
    return out


def test_tp2_equals_tp1_plain_and_in_halves(ckpt):
    expected = run(ckpt)
    assert len(set(expected[2])) > 3, "degenerate output: the test would prove little"
    assert run(ckpt, tensor_parallel_size=2) == expected
    assert run(ckpt, tensor_parallel_size=2, tp_overlap_min_tokens=6) == expected


def test_dummy_weights_do_not_depend_on_tp(ckpt):
    expected = run(ckpt, load_format="dummy")
    assert run(ckpt, load_format="dummy", tensor_parallel_size=2) == expected


def test_split_step_carries_the_state_slots():
    step = StepInputs(
        input_ids=[1, 2, 3, 4, 5, 6, 7], positions=[10, 11, 12, 0, 1, 2, 3], prefix_lens=[10, 0],
        query_lens=[3, 4], page_tables=[[7, 8], [9]], logits_indices=[2, 6], state_slots=[5, 2],
    )  # fmt: skip
    a, b = split_step(step, 5)
    assert (a.prefix_lens, a.query_lens, a.state_slots) == ([10, 0], [3, 2], [5, 2])
    assert (b.prefix_lens, b.query_lens, b.state_slots) == ([2], [2], [2])  # continues its state: prefix 2
    plain = StepInputs([1], [0], [0], [1], [[1]], [0])
    assert split_step(plain, 0)[1].state_slots == []  # attention-only models carry none


def test_qwen3_next_tp2_equals_tp1(tmp_path):
    """Qwen3-Next's fused per-key-head projections, regrouped at load, then split over the ranks."""
    from longserve.testing.checkpoints import QWEN3_NEXT

    path = make_tiny_checkpoint(tmp_path, QWEN3_NEXT, seed=9)
    expected = run(path)
    assert len(set(expected[2])) > 3
    assert run(path, tensor_parallel_size=2) == expected


def test_tp2_prefix_hits_restore_each_ranks_states(tmp_path):
    """With prefix caching, each rank copies its own heads' states into and out of the checkpoints the one
    allocator (rank 0) names: a repeated long prompt and a second question over the same document hit, and
    every token equals TP=1 without the cache, in steps cut in two halves too."""
    from longserve.cache.manager import MIN_CHECKPOINT_TOKENS

    path = make_tiny_checkpoint(tmp_path, "qwen3_5_moe", seed=9, max_position_embeddings=2048)
    doc = (prompts()[0] * (MIN_CHECKPOINT_TOKENS // len(prompts()[0]) + 2))[: MIN_CHECKPOINT_TOKENS + 64]
    q = list(range(20, 40))  # past a page: the first prompt's last full page lies past the document's end
    ps = [doc + q, doc + q, doc + q[::-1], doc + q[1:]]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)

    def each(**kw) -> tuple[list[list[int]], list[int]]:
        with LLM(path, dtype="float32", device="cpu", max_total_tokens=4096, page_size=16,
                 chunked_prefill_size=256, **kw) as m:  # fmt: skip
            outs = [m.generate([p], params)[0] for p in ps]  # one after another: each can hit the last
            m.engine.check_integrity()
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], [
            o.cached_tokens for o in outs
        ]

    expected, cached = each(enable_prefix_caching=False)
    assert cached == [0, 0, 0, 0]
    got, cached = each(tensor_parallel_size=2, tp_overlap_min_tokens=6)
    # tokens, and their logprobs up to float32 rounding (a state lost or mixed up moves them by far more)
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert all(abs(a - b) < 1e-3 for (_, g), (_, e) in zip(got, expected) for a, b in zip(g, e))
    mark = (len(ps[0]) - 1) // 16 * 16  # the first prompt's last full page, inside its third chunk (from 512)
    # that chunk saves each rank's states inside itself, two 64-token chunks of the kernels in: at the document's
    # end (cache/manager.py IN_STEP_SAVES), where the others resume
    saved = 512 + (mark - 512) // 64 * 64
    assert cached == [0, saved, saved, saved] and saved == len(doc) < mark
