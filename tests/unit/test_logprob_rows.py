"""logit_bias in the sampler (exact values, per row of a batch) and the planning of prompt-logprob rows: which
hidden rows a chunk computes, what each predicts, and the prefix limit that keeps them from being cached."""

from __future__ import annotations

import pytest
import torch

from longserve.request import Request
from longserve.runner.prompt_logprobs import PromptLogprobRows, PromptLogprobs, record, start_entries
from longserve.runner.sampler import Sampler, SamplingInfo, apply_logit_bias
from longserve.sampling_params import SamplingParams


def info(**params) -> SamplingInfo:
    return SamplingInfo(SamplingParams(**params), [], [], None)


def test_logit_bias_adds_to_its_own_rows_only():
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    logits[0, 5] = -10.0  # row 0's least likely token: only the bias can make it the greedy one
    infos = [info(logit_bias={2: 5.0, 7: -1.5}), info(), info(logit_bias={0: -100.0})]
    out = apply_logit_bias(logits, infos)
    expected = logits.clone()
    expected[0, 2] += 5.0
    expected[0, 7] -= 1.5
    expected[2, 0] -= 100.0
    assert torch.equal(out, expected)  # the untouched row is bit for bit the same
    assert apply_logit_bias(logits, [info()] * 3) is logits  # nothing asked: no work
    greedy = Sampler()(logits[:2], [info(temperature=0, logit_bias={5: 100.0}), info(temperature=0)])
    assert greedy.token_ids.tolist() == [5, int(logits[1].argmax())]


def request(prompt_len: int, k: int | None = 0, start: int = 0) -> Request:
    params = SamplingParams(prompt_logprobs=k, logprob_start_len=start)
    req = Request("r", list(range(100, 100 + prompt_len)), params)
    if k is not None:
        start_entries(req)
    return req


def test_rows_of_each_chunk_and_the_prefix_limit():
    req = request(10, start=3)
    assert req.prompt_logprob_start == 3 and req.prompt_logprobs == [None]
    assert req.next_prompt_logprob_row == 3 and req.max_prefix_len == 3  # rows 3..8 are still to compute
    plan = PromptLogprobRows()
    plan.add(req, start=0, end=6, first_row=4)  # positions 0..5 in hidden rows 4..9 of the step
    assert plan.rows == [7, 8, 9] and plan.targets == [104, 105, 106]  # positions 3, 4, 5 predict 4, 5, 6
    assert plan.owners == [("r", 3)]
    record(req, _result(3))
    assert req.next_prompt_logprob_row == 6 and req.max_prefix_len == 6
    plan = PromptLogprobRows()
    plan.add(req, start=6, end=10, first_row=0)  # the last chunk: row 9 samples, it predicts no prompt token
    assert plan.rows == [0, 1, 2] and plan.targets == [107, 108, 109]
    record(req, _result(3))
    assert len(req.prompt_logprobs) == 7 and req.max_prefix_len == 9  # done: only the sampled row is left
    plan = PromptLogprobRows()
    plan.add(req, start=0, end=10, first_row=0)  # recomputed after a preemption: nothing is asked twice
    assert plan.rows == []
    with pytest.raises(AssertionError, match="cached prefix"):
        PromptLogprobRows().add(request(10), start=8, end=10, first_row=0)
    assert request(10, k=None).max_prefix_len == 9  # no prompt logprobs: the usual limit
    with pytest.raises(ValueError, match="logprob_start_len=-11 is outside the prompt of 10 tokens"):
        request(10, start=-11)


def _result(n: int) -> PromptLogprobs:
    return PromptLogprobs([-1.0] * n, [1] * n, [[]] * n)
