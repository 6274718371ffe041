"""The engine requests of one user request, and which of them it gets back.

A request with n completions runs as n sibling engine requests; with best_of > n (vLLM's completions
parameter) as best_of candidates, of which the n with the highest cumulative logprob are returned, best
first, once all have finished (so a best_of request reports nothing before it ends). The cumulative logprob
is the sum of the returned tokens' logprobs under the model's own distribution (the `logprobs` the caller
sees), so every candidate samples with logprobs on, and they are hidden again unless the caller asked.

Only the first sibling computes the prompt's logprobs: the others take the prompt's pages from the prefix
cache (or their leader) as usual, and the user request reports the leader's.
"""

from __future__ import annotations

from collections.abc import Sequence

from longserve.request import Request
from longserve.sampling_params import SamplingParams, wrap_seed


def num_candidates(params: SamplingParams) -> int:
    """Engine requests run for one user request."""
    return max(params.best_of or 0, params.n)


def candidate_params(params: SamplingParams) -> list[SamplingParams]:
    """The SamplingParams of each engine request of a user request (the first is the leader's)."""
    count = num_candidates(params)
    ranked = count > params.n  # best_of: the candidates are ranked by their logprobs
    out = []
    for i in range(count):
        changes: dict = {}
        if count > 1 and params.seed is not None:
            changes["seed"] = wrap_seed(params.seed + i)  # siblings must differ
        if ranked and params.logprobs is None:
            changes["logprobs"] = 0
        if i > 0 and params.prompt_logprobs is not None:
            changes["prompt_logprobs"] = None  # the leader's serve the user request
        out.append(params.clone(**changes) if changes else params)
    return out


def cumulative_logprob(req: Request) -> float:
    return float(sum(req.logprobs))


def chosen_members(members: Sequence[Request], n: int) -> list[int]:
    """Indices of the members whose completions are returned: all of them, or for best_of the n with the
    highest cumulative logprob, best first (ties: the earlier candidate)."""
    if len(members) <= n:
        return list(range(len(members)))
    order = sorted(range(len(members)), key=lambda i: (-cumulative_logprob(members[i]), i))
    return order[:n]
