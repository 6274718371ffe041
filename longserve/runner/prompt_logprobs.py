"""Logprobs of the prompt's tokens (vLLM's prompt_logprobs, SGLang's input_token_logprobs), chunk by chunk.

The logprob of prompt token p comes from the logits at position p - 1, so a request asking for the entries of
positions [s, L) (s = its resolved logprob_start_len, L its prompt length; the entry of s is None) needs the
logits of rows s .. L-2; row L-1 samples the first output token as usual. Each step computes only the rows
of its own chunk that are still missing, and never the whole [L, vocab] logits: `compute` projects at most
`ROW_BUDGET // vocab` rows at a time and keeps, per row, the chosen token's logprob, its rank and the top-k.

    prompt   t0    t1    t2   ...  t(L-2)  t(L-1)
    rows     r0 -> t1's logprob ...  r(L-2) -> t(L-1)'s     r(L-1) samples the first output token
    entries  [None, lp(t1), ..., lp(t(L-1))]  for s = 0

A cached prefix must not hide a row that is asked for: Request.max_prefix_len caps the prefix match at the
next missing row (runner side: `plan` asserts it), so positions inside the cache are recomputed, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longserve.request import Request

ROW_BUDGET = 2**25  # logits elements per slice (128 MiB of fp32): ~220 rows of a 152K vocab


@dataclass
class PromptLogprobRows:
    """One step's rows whose next-token logprobs are asked for: plain data, identical on every tp rank (the
    vocab-parallel logits are gathered collectively, so every rank projects the same rows)."""

    rows: list[int] = field(default_factory=list)  # [P] rows of the step's hidden states
    targets: list[int] = field(default_factory=list)  # [P] the prompt token each row predicts
    num_top: int = 0  # top-k per row: the largest prompt_logprobs among the step's requests
    owners: list[tuple[str, int]] = field(default_factory=list)  # (request id, rows) in row order

    def add(self, req: Request, start: int, end: int, first_row: int) -> None:
        """The missing rows of positions [start, end), which this step computes from hidden row first_row."""
        want = req.next_prompt_logprob_row
        last = min(end, req.num_prompt_tokens - 1)  # rows [lo, last); row L-1 samples
        if want >= last:
            return
        # a prefix hit past the next missing row would skip logprobs: max_prefix_len forbids it
        assert start <= want, f"request {req.request_id}: prompt logprob row {want} lies in its cached prefix"
        lo = max(start, want)
        self.rows.extend(range(first_row + lo - start, first_row + last - start))
        self.targets.extend(req.prompt_token_ids[lo + 1 : last + 1])
        self.num_top = max(self.num_top, req.sampling_params.prompt_logprobs or 0)
        self.owners.append((req.request_id, last - lo))


@dataclass
class PromptLogprobs:
    """Results for one request's rows of one step, in position order (host lists)."""

    logprobs: list[float]
    ranks: list[int]  # 1 + the number of tokens more likely than the prompt's own
    top: list[list[tuple[int, float]]]  # [(token id, logprob)] * num_top per row, most likely first


def compute(model, hidden: torch.Tensor, plan: PromptLogprobRows | None) -> dict[str, PromptLogprobs] | None:
    """hidden [T, H] of a step -> each owner's PromptLogprobs (None: no rows asked for); projects the rows
    to logits slice by slice. Every tp rank calls it (the logits' vocab gather is a collective)."""
    if plan is None or not plan.rows:
        return None
    device = hidden.device
    rows = torch.tensor(plan.rows, dtype=torch.long, device=device)  # [P]
    targets = torch.tensor(plan.targets, dtype=torch.long, device=device)  # [P]
    step = max(1, ROW_BUDGET // model.vocab_size)
    logprobs, ranks, top_vals, top_ids = [], [], [], []
    for lo in range(0, len(plan.rows), step):
        logits = model.compute_logits(hidden[rows[lo : lo + step]])  # [S, V] fp32
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [S, 1]
        chosen = logits.gather(1, targets[lo : lo + step, None])  # [S, 1]
        logprobs.append((chosen - lse).squeeze(1))  # [S]
        ranks.append((logits > chosen).sum(dim=-1) + 1)  # [S]
        if plan.num_top:
            values, ids = logits.topk(min(plan.num_top, logits.shape[1]), dim=-1)  # [S, K] sorted desc
            top_vals.append(values - lse)
            top_ids.append(ids)
    # one host transfer per kind for the whole step
    lp = torch.cat(logprobs).tolist()
    rk = torch.cat(ranks).tolist()
    tv = torch.cat(top_vals).tolist() if top_vals else None
    ti = torch.cat(top_ids).tolist() if top_ids else None
    out: dict[str, PromptLogprobs] = {}
    pos = 0
    for request_id, count in plan.owners:
        span = range(pos, pos + count)
        top = [list(zip(ti[i], tv[i])) for i in span] if ti is not None and tv is not None else [[]] * count
        out[request_id] = PromptLogprobs(lp[pos : pos + count], rk[pos : pos + count], top)
        pos += count
    return out


def start_entries(req: Request) -> None:
    """Resolve the request's logprob_start_len against its prompt and put in the first entry (None: no
    logits predict it). ValueError for a start outside the prompt."""
    params = req.sampling_params
    num = req.num_prompt_tokens
    start = params.logprob_start_len + (num if params.logprob_start_len < 0 else 0)
    if not 0 <= start < num:
        raise ValueError(
            f"logprob_start_len={params.logprob_start_len} is outside the prompt of {num} tokens "
            f"(give a value in [{-num}, {num - 1}])"
        )
    req.prompt_logprob_start = start
    req.prompt_logprobs[:] = [None]
    req.prompt_top_logprobs[:] = [None]
    req.prompt_logprob_ranks[:] = [None]


def record(req: Request, result: PromptLogprobs) -> None:
    """Append a step's results to the request (they continue its entries: see PromptLogprobRows.add)."""
    k = req.sampling_params.prompt_logprobs or 0
    req.prompt_logprobs.extend(result.logprobs)
    req.prompt_logprob_ranks.extend(result.ranks)
    req.prompt_top_logprobs.extend(top[:k] for top in result.top)


def is_complete(req: Request) -> bool:
    return req.prompt_logprob_start + len(req.prompt_logprobs) >= req.num_prompt_tokens
