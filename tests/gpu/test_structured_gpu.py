"""Structured outputs on a GPU: the grammar mask is filled on the host, copied and applied on the device and
the rows sampled with no host sync (torch.cuda.set_sync_debug_mode("error") around the masker and the
sampler, one row by one and in a batch large enough for the threaded fill), the masked logits equal to the
CPU reference; constrained outputs through the CUDA engine (graphs on) all validate."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from longserve import LLM, SamplingParams
from longserve.request import Request
from longserve.runner.grammar_mask import BATCH_FILL_MIN_ROWS
from longserve.runner.sampler import SamplingInfo
from longserve.structured.grammar import GrammarMatcher, TokenBitmask, apply_token_bitmask_torch
from longserve.structured.spec import GrammarSpec
from tests.fixtures.tool_checkpoints import make_tool_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "n"],
    "additionalProperties": False,
}
STARTS = ["", '{"city": "Pa', '{"city": "Paris", "n": ', "{"]  # matcher states along the way


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tool_checkpoint(tmp_path_factory.mktemp("gpu-structured"), "qwen25")
    with LLM(path, dtype="float32", device="cuda", max_total_tokens=16384) as m:
        yield m


def requests(llm, num_rows: int, constrained: set[int]) -> list[Request]:
    compiled = llm.engine.grammar_compiler.compile(GrammarSpec.json_schema(SCHEMA))
    reqs = []
    for i in range(num_rows):
        req = Request(f"r{i}", [5, 6, 7], SamplingParams(temperature=0.0))
        if i in constrained:
            req.grammar = GrammarMatcher(compiled)
            assert req.grammar._m.accept_string(STARTS[i % len(STARTS)])
        reqs.append(req)
    return reqs


@pytest.mark.parametrize("num_rows", [4, 2 * BATCH_FILL_MIN_ROWS + 3])
def test_mask_fill_copy_apply_and_sample_never_sync(llm, num_rows):
    runner = llm.engine.runner
    constrained = {i for i in range(num_rows) if i % 3 != 1}  # rows without a grammar between them
    reqs = requests(llm, num_rows, constrained)
    vocab = runner.model.vocab_size
    logits = torch.randn(num_rows, vocab, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    infos = [SamplingInfo(r.sampling_params, r.prompt_token_ids, r.output_token_ids, None) for r in reqs]
    runner.step_sampler.grammar_masker.prepare(
        reqs
    )  # first use allocates the buffers (an allocation is not the point)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask, failed = runner.step_sampler.grammar_masker.prepare(reqs)
        out = runner.step_sampler.sampler(logits, infos, token_mask=mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not failed and set(mask.rows) == constrained  # every JSON state restricts the next token
    # the CPU reference: the same matchers' rows, masked in plain torch
    host = TokenBitmask(num_rows, vocab)
    rows = host.fill({i: reqs[i].grammar for i in constrained})
    expected = apply_token_bitmask_torch(logits.cpu().clone(), host.host, rows).argmax(dim=-1)
    assert out.token_ids.cpu().tolist() == expected.tolist()
    for i in constrained:  # every constrained row's token is one its grammar accepts
        assert reqs[i].grammar.fork().accept_token(int(out.token_ids[i]))


def test_constrained_outputs_through_the_cuda_engine(llm):
    assert llm.engine.runner.graph_runner is not None  # decode steps replay CUDA graphs
    spec = GrammarSpec.json_schema(SCHEMA)
    params = [
        SamplingParams(max_new_tokens=800, temperature=1.0, seed=i, structured_outputs=spec)
        for i in range(12)
    ]
    params += [SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)] * 4
    outs = llm.generate(["The weather in Paris is"] * len(params), params)
    for out in outs[:12]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert all(len(o.token_ids) == 16 for o in outs[12:])
    llm.engine.check_integrity()
