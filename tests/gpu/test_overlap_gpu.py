"""The overlapped schedule on a GPU: a step is planned, launched and sampled without waiting for the device
(so the host's work hides behind the step before), and its tokens equal the plain schedule's."""

from __future__ import annotations

import pytest
import torch

from longserve import LLM, SamplingParams
from longserve.testing.checkpoints import make_tiny_checkpoint
from tests.gpu.test_engine_gpu import prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("overlap"), "qwen3", num_layers=3)


# every sampler path that moves host data to the device: a pageable copy would drain the stream
PARAMS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8, top_k=30, top_p=0.9, min_p=0.02, seed=3),
    "penalties": dict(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.1),
    "bans_and_bias": dict(temperature=0.0, min_new_tokens=40, stop_token_ids=[7], logit_bias={11: 2.0}),
    "logprobs": dict(temperature=0.0, logprobs=3),
}


@pytest.mark.parametrize("kind", sorted(PARAMS))
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_a_step_is_queued_behind_the_running_one(ckpt, kind, graphs):
    """With the device held busy (a ~1 s spin kernel queued after the step in flight), step() still
    returns: it read the step before (done before the spin) and queued the next one without any sync."""
    llm = LLM(ckpt, dtype="bfloat16", device="cuda", max_total_tokens=8192, overlap_schedule=True,
              enforce_eager=not graphs)  # fmt: skip
    engine = llm.engine
    params = SamplingParams(max_new_tokens=64, ignore_eos=True, **PARAMS[kind])
    for i, p in enumerate(prompts(6)):
        engine.add_request(p, params, request_id=f"r{i}")
    for _ in range(6):  # prefill, then decodes
        engine.step()
    assert engine._in_flight is not None and engine.last_step_stats.num_decode_tokens == 6
    torch.cuda.synchronize()
    engine.step()  # one decode step queued behind one in flight
    torch.cuda._sleep(2_000_000_000)  # ~1 s at H200 clocks
    engine.step()
    assert not torch.cuda.current_stream().query(), "a step waited for the device to drain"
    torch.cuda.synchronize()
    for i in range(6):
        engine.abort(f"r{i}")
    engine.check_integrity()


def test_a_prefill_chunk_is_queued_behind_the_running_one(ckpt):
    """A long prompt's chunks: the host prepares and launches chunk k+1 while chunk k runs (what the
    overlap buys a cold long prompt), which holds only if the extend path never syncs either."""
    llm = LLM(ckpt, dtype="bfloat16", device="cuda", max_total_tokens=16384, overlap_schedule=True,
              chunked_prefill_size=512, context_length=8192)  # fmt: skip
    engine = llm.engine
    g = torch.Generator().manual_seed(2)
    engine.add_request(
        torch.randint(10, 500, (4000,), generator=g).tolist(), SamplingParams(max_new_tokens=2)
    )
    engine.step()
    engine.step()
    assert engine._in_flight is not None and engine.last_step_stats.num_prefill_tokens == 512
    torch.cuda._sleep(2_000_000_000)
    engine.step()  # the third chunk, queued behind the spin
    assert not torch.cuda.current_stream().query(), "a prefill chunk's launch waited for the device"
    torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()


def test_overlapped_tokens_equal_plain_ones_on_the_gpu(ckpt):
    """Greedy and seeded sampling rows, requests ending at a stop token mid-batch and by length."""
    ps = prompts(8, seed=1)
    params = [
        SamplingParams(max_new_tokens=8 + 5 * i, temperature=0.0 if i % 2 else 0.7, seed=i, ignore_eos=True)
        for i in range(8)
    ]
    outs = {}
    for overlap in (False, True):
        llm = LLM(ckpt, dtype="float32", device="cuda", max_total_tokens=8192, overlap_schedule=overlap)
        outs[overlap] = [o.token_ids for o in llm.generate(ps, params)]
        llm.engine.check_integrity()
        assert llm.engine.overlap == overlap
    assert outs[True] == outs[False]
