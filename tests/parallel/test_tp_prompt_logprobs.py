"""Prompt logprobs under tensor parallelism (gloo on the CPU): every rank projects the same rows to its vocab
slice and the slices are gathered, in one pass or in two overlapped halves; the result equals TP=1."""

from __future__ import annotations

import torch

from longserve import LLM, SamplingParams
from longserve.testing.checkpoints import make_tiny_checkpoint


def test_prompt_logprobs_tp2_equal_tp1(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    ids = torch.randint(10, 500, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_new_tokens=3, prompt_logprobs=2, temperature=0, ignore_eos=True)

    def run(**kw):
        kw = (
            dict(dtype="float32", device="cpu", max_total_tokens=2048, page_size=16, chunked_prefill_size=16)
            | kw
        )
        with LLM(path, **kw) as m:
            out = m.generate([ids], params)[0]
            m.engine.check_integrity()
            return out, m.engine.runner.num_overlapped_passes

    expected, _ = run()
    # 60 tokens in chunks of 16: three chunks run as overlapped halves (>= 14 tokens), the last 12 in one pass
    got, overlapped = run(tensor_parallel_size=2, tp_overlap_min_tokens=14)
    assert overlapped >= 3
    assert got.token_ids == expected.token_ids
    assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(ids)
    torch.testing.assert_close(
        torch.tensor(got.prompt_logprobs[1:]), torch.tensor(expected.prompt_logprobs[1:]), atol=1e-4, rtol=0
    )
    assert [[t for t, _ in top] for top in got.prompt_top_logprobs[1:]] == [
        [t for t, _ in top] for top in expected.prompt_top_logprobs[1:]
    ]
