"""Two runs' greedy steps compared where bf16 sums in another order may swap a near tie: each run's steps as
(token, {token: logprob} of its top 2) per sequence."""

from __future__ import annotations

Steps = list[list[tuple[int, dict]]]


def sequences_agreeing(got: Steps, want: Steps, tol: float = 0.1) -> int:
    """How many sequences agree whole. Step by step while a sequence's tokens agree, each greedy token must be one
    of the other run's top 2 and their shared logprobs agree to `tol` (asserted); after a near tie taken the other
    way the rest follows another token, so the comparison of that sequence stops there."""
    whole = 0
    for steps, ref_steps in zip(got, want, strict=True):
        for (tok, lps), (ref_tok, ref_lps) in zip(steps, ref_steps):
            assert tok in ref_lps and ref_tok in lps, (tok, lps, ref_tok, ref_lps)
            for t in lps.keys() & ref_lps.keys():
                assert abs(lps[t] - ref_lps[t]) < tol, (t, lps[t], ref_lps[t])
            if tok != ref_tok:
                break
        else:
            whole += 1
    return whole


def greedy_steps(path, prompts: list[list[int]], params) -> Steps:
    """One engine's run of `prompts` on CUDA in bf16 (pages checked after), as the steps above."""
    from longserve import LLM

    with LLM(path, device="cuda", dtype="bfloat16", max_total_tokens=4096) as llm:
        outs = llm.generate(prompts, params)
        llm.engine.check_integrity()
    return [list(zip(o.token_ids, (dict(t) for t in o.outputs[0].top_logprobs))) for o in outs]
