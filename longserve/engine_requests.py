"""How an accepted prompt becomes the engine's requests (Engine.add_request, after its checks): the members of
its group (one request, n siblings or best_of candidates: siblings.candidate_params), each with a grammar
matcher of its own, the first member's prompt-logprob entries, and each member's text assembler."""

from __future__ import annotations

from typing import Any

import numpy as np

from longserve.engine_outputs import Group
from longserve.pooling_params import PoolingParams
from longserve.request import Request
from longserve.runner import prompt_logprobs
from longserve.sampling_params import SamplingParams
from longserve.siblings import candidate_params
from longserve.structured.grammar import GrammarMatcher
from longserve.tokenization.detokenizer import DeferredText, IncrementalDetokenizer, TextAssembler


def new_group(
    request_id: str,
    prompt: str | None,
    token_ids: list[int],
    token_array: np.ndarray | None,
    params: SamplingParams,
    pooling: PoolingParams | None,
    grammar: Any,
    eos_token_ids: frozenset[int],
    arrival_time: float,
) -> Group:
    """The group of a checked request, its members not yet queued; ValueError (nothing to undo) when its
    prompt logprobs start outside the prompt."""
    all_params = candidate_params(params)  # n siblings, or best_of candidates
    group_id = request_id if len(all_params) > 1 else (pooling.prefix_group if pooling is not None else None)
    members = []
    for i, member_params in enumerate(all_params):
        members.append(
            Request(
                request_id=request_id if len(all_params) == 1 else f"{request_id}#{i}",
                prompt_token_ids=token_ids,
                prompt_array=token_array,  # read only, shared by siblings
                sampling_params=member_params,
                eos_token_ids=eos_token_ids,
                group_id=group_id,
                arrival_time=arrival_time,
                pooling_params=pooling,
                grammar=GrammarMatcher(grammar) if grammar is not None else None,  # one per sibling
            )
        )
    if params.prompt_logprobs is not None:
        prompt_logprobs.start_entries(members[0])  # ValueError: logprob_start_len outside the prompt
    return Group(request_id, prompt, members, params)


def assemble_text(req: Request, detokenizer: IncrementalDetokenizer) -> None:
    """The request's text, assembled as its tokens come (ended at its stop strings)."""
    p = req.sampling_params
    text = TextAssembler(
        detokenizer, req.prompt_token_ids, p.stop, p.skip_special_tokens, keep_stop=p.no_stop_trim
    )
    # without stop strings nothing here depends on the text: decode it when it is read
    req.text = text if p.stop else DeferredText(text, req.output_token_ids)
