"""Sampler: exact penalty/truncation values on crafted logits, sampling frequencies, seeding, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from longserve.runner.sampler import (
    Sampler,
    SamplingInfo,
    apply_bans,
    apply_penalties,
    apply_truncation,
)
from longserve.sampling_params import SamplingParams


def info(
    prompt: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
    banned: tuple[int, ...] = (),
    seed: int | None = None,
    **params,
) -> SamplingInfo:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingInfo(SamplingParams(seed=seed, **params), list(prompt), list(output), generator, banned)


def row(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)  # [1, V]


def finite_ids(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())


def frequencies(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab_size).float() / tokens.numel()  # [V]


# ---- greedy ----------------------------------------------------------------------------------------------


def test_all_greedy_equals_argmax() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))  # [8, 50]
    out = Sampler()(logits, [info(temperature=0.0) for _ in range(8)])
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.top_logprobs is None and out.top_token_ids is None


def test_top_k_1_is_argmax() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))  # [8, 50]
    out = Sampler()(logits, [info(temperature=1.0, top_k=1) for _ in range(8)])
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_caller_logits_not_modified() -> None:
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(2))  # [3, 10]
    before = logits.clone()
    infos = [
        info(prompt=(1, 2), output=(3,), banned=(4,), repetition_penalty=1.5, frequency_penalty=0.5),
        info(output=(0,), presence_penalty=1.0, temperature=0.7, top_p=0.5, top_k=3, min_p=0.1),
        info(temperature=0.0, banned=(0, 1)),
    ]
    Sampler()(logits, infos)
    assert torch.equal(logits, before)


# ---- bans and penalties ----------------------------------------------------------------------------------


def test_banned_ids_never_chosen_greedy() -> None:
    logits = row(0.0, 5.0, 1.0, 4.0, 2.0, 3.0)
    out = Sampler()(logits, [info(banned=(1, 3), temperature=0.0)])
    assert out.token_ids.tolist() == [5]
    assert apply_bans(logits, [info(banned=(1, 3))])[0].tolist() == [0.0, -math.inf, 1.0, -math.inf, 2.0, 3.0]


def test_banned_ids_never_chosen_sampling() -> None:
    torch.manual_seed(0)
    logits = row(3.0, 3.0, 0.0, 3.0, 3.0, 0.0).repeat(2000, 1)  # [2000, 6]
    out = Sampler()(logits, [info(banned=(0, 3), temperature=1.5) for _ in range(2000)])
    seen = set(out.token_ids.tolist())
    assert not seen & {0, 3}
    assert {1, 4} <= seen


def test_repetition_penalty_exact_values() -> None:
    logits = row(2.0, 1.5, -0.5, -0.375, 0.125, 0.0)  # dyadic values: exact in float32
    # Token 0 in the prompt, 2 in the output; 4 nowhere. Positive divided, negative multiplied.
    got = apply_penalties(logits, [info(prompt=(0, 0), output=(2,), repetition_penalty=2.0)])
    assert got[0].tolist() == [1.0, 1.5, -1.0, -0.375, 0.125, 0.0]
    out = Sampler()(logits, [info(prompt=(0,), repetition_penalty=2.0, temperature=0.0)])
    assert out.token_ids.tolist() == [1]  # 2.0 / 2 = 1.0 < 1.5
    out = Sampler()(logits, [info(prompt=(0,), repetition_penalty=1.25, temperature=0.0)])
    assert out.token_ids.tolist() == [0]  # 2.0 / 1.25 = 1.6 > 1.5


def test_repetition_penalty_negative_logits_multiplied() -> None:
    logits = row(-1.0, -1.2, -3.0, -4.0, -5.0, -6.0)
    pick = lambda penalty: Sampler()(  # noqa: E731
        logits, [info(output=(0,), repetition_penalty=penalty, temperature=0.0)]
    ).token_ids.item()
    assert pick(1.3) == 1  # -1.3 < -1.2
    assert pick(1.1) == 0  # -1.1 > -1.2
    assert pick(0.5) == 0  # a penalty < 1 encourages: -0.5


def test_frequency_penalty_counts_output_only() -> None:
    logits = row(3.0, 2.5, 2.0, 0.0, 0.0, 0.0)
    got = apply_penalties(logits, [info(prompt=(1, 1, 1), output=(0, 0, 2), frequency_penalty=0.25)])
    assert got[0].tolist() == [2.5, 2.5, 1.75, 0.0, 0.0, 0.0]
    pick = lambda **kw: Sampler()(logits, [info(temperature=0.0, **kw)]).token_ids.item()  # noqa: E731
    assert pick(output=(0, 0), frequency_penalty=0.3) == 1  # 3 - 0.6 = 2.4 < 2.5
    assert pick(output=(0, 0), frequency_penalty=0.2) == 0  # 3 - 0.4 = 2.6 > 2.5
    assert pick(prompt=(0, 0, 0, 0), frequency_penalty=2.0) == 0  # prompt tokens are not counted


def test_presence_penalty_ignores_count() -> None:
    logits = row(3.0, 2.5, 2.0, 0.0, 0.0, 0.0)
    got = apply_penalties(logits, [info(prompt=(1,), output=(0, 0, 0, 2), presence_penalty=0.5)])
    assert got[0].tolist() == [2.5, 2.5, 1.5, 0.0, 0.0, 0.0]
    pick = lambda **kw: Sampler()(logits, [info(temperature=0.0, **kw)]).token_ids.item()  # noqa: E731
    assert pick(output=(0, 0, 0), presence_penalty=0.6) == 1  # 2.4 < 2.5
    assert pick(output=(0, 0, 0), presence_penalty=0.4) == 0  # 2.6 > 2.5


def test_penalty_order_repetition_before_frequency() -> None:
    # Repetition first: 4.0 / 2 - 0.2 = 1.8 < 1.85 -> token 1. Frequency first would give 1.9 -> token 0.
    logits = row(4.0, 1.85, 0.0, 0.0)
    infos = [info(output=(0,), repetition_penalty=2.0, frequency_penalty=0.2, temperature=0.0)]
    assert Sampler()(logits, infos).token_ids.tolist() == [1]


def test_penalties_per_row_and_identity_rows_untouched() -> None:
    logits = torch.tensor([[2.0, 1.0, -1.0], [2.0, 1.0, -1.0], [2.0, 1.0, -1.0]])  # [3, 3]
    infos = [
        info(prompt=(0, 2), output=(0,)),  # no penalty: tokens must not matter
        info(prompt=(2,), output=(0,), repetition_penalty=4.0),
        info(output=(1, 1), frequency_penalty=1.0, presence_penalty=0.5),
    ]
    got = apply_penalties(logits, infos)
    assert got.tolist() == [[2.0, 1.0, -1.0], [0.5, 1.0, -4.0], [2.0, -1.5, -1.0]]
    assert apply_penalties(logits, [info(), info(), info()]) is logits  # no work when nothing to do


# ---- truncation ------------------------------------------------------------------------------------------


def test_top_k_2_only_two_best_tokens() -> None:
    torch.manual_seed(0)
    logits = row(1.0, 3.0, 0.5, 2.9, 2.0, -1.0).repeat(2000, 1)  # [2000, 6]
    out = Sampler()(logits, [info(temperature=1.0, top_k=2) for _ in range(2000)])
    assert set(out.token_ids.tolist()) == {1, 3}


def test_top_p_keeps_smallest_set() -> None:
    logits = row(*(math.log(p) for p in (0.1, 0.4, 0.2, 0.3)))
    assert finite_ids(apply_truncation(logits, [-1], [0.5], [0.0])) == {1, 3}  # 0.4 + 0.3 >= 0.5
    assert finite_ids(apply_truncation(logits, [-1], [0.75], [0.0])) == {1, 3, 2}  # 0.7 < 0.75
    assert finite_ids(apply_truncation(logits, [-1], [0.35], [0.0])) == {1}
    assert finite_ids(apply_truncation(logits, [-1], [0.01], [0.0])) == {1}  # top token always kept
    assert finite_ids(apply_truncation(logits, [-1], [1.0], [0.0])) == {0, 1, 2, 3}
    # Top-p is applied to the top-k-renormalized distribution: {0.4, 0.3} -> {0.571, 0.429}.
    assert finite_ids(apply_truncation(logits, [2], [0.55], [0.0])) == {1}
    torch.manual_seed(0)
    out = Sampler()(logits.repeat(2000, 1), [info(top_p=0.5) for _ in range(2000)])
    assert set(out.token_ids.tolist()) == {1, 3}


def test_min_p_removes_unlikely_tokens() -> None:
    logits = row(*(math.log(p) for p in (0.06, 0.5, 0.1, 0.3, 0.04)))
    assert finite_ids(apply_truncation(logits, [-1], [1.0], [0.25])) == {1, 3}  # threshold 0.125
    assert finite_ids(apply_truncation(logits, [-1], [1.0], [0.15])) == {1, 3, 2}  # threshold 0.075
    assert finite_ids(apply_truncation(logits, [-1], [1.0], [0.0])) == {0, 1, 2, 3, 4}
    truncated = apply_truncation(logits, [-1], [1.0], [0.25])
    assert truncated[0, 1].item() == logits[0, 1].item()  # kept logits keep their values


def test_truncation_mixed_rows() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]])  # [3, 4]
    got = apply_truncation(logits, [2, -1, -1], [1.0, 1e-3, 1.0], [0.0, 0.0, 0.3])
    inf = math.inf
    assert got.tolist() == [[-inf, -inf, 2.0, 3.0], [-inf, -inf, -inf, 3.0], [-inf, -inf, 2.0, 3.0]]


# ---- sampling distribution -------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature: float) -> None:
    torch.manual_seed(1234)
    base = row(1.0, 0.5, 0.0, -1.0, 2.0)
    num_draws = 20000
    out = Sampler()(base.repeat(num_draws, 1), [info(temperature=temperature) for _ in range(num_draws)])
    expected = torch.softmax(base[0] / temperature, dim=-1)  # [5]
    assert (frequencies(out.token_ids, 5) - expected).abs().max().item() < 0.03


def test_top_k_frequencies_renormalized() -> None:
    torch.manual_seed(99)
    base = row(1.0, 0.5, 0.0, -1.0, 2.0)
    num_draws = 20000
    out = Sampler()(base.repeat(num_draws, 1), [info(temperature=0.8, top_k=3) for _ in range(num_draws)])
    expected = torch.softmax(base[0] / 0.8, dim=-1) * torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])  # [5]
    expected = expected / expected.sum()
    assert (frequencies(out.token_ids, 5) - expected).abs().max().item() < 0.03


def test_seeded_rows_follow_distribution() -> None:
    base = row(1.0, 0.5, 0.0, -1.0, 2.0)
    num_draws = 4000
    out = Sampler()(base.repeat(num_draws, 1), [info(seed=s) for s in range(num_draws)])
    expected = torch.softmax(base[0], dim=-1)
    assert (frequencies(out.token_ids, 5) - expected).abs().max().item() < 0.04


# ---- seeds -----------------------------------------------------------------------------------------------


def _seeded_run(seed: int, position: int, neighbours: list[dict], steps: int = 6) -> list[int]:
    """Tokens of one seeded request over several steps, placed at `position` among `neighbours`."""
    target = info(seed=seed, temperature=1.3, top_p=0.95)
    others = [info(**kw) for kw in neighbours]
    rows = others[:position] + [target] + others[position:]
    gen = torch.Generator().manual_seed(1000 + len(neighbours))
    target_logits = torch.randn(steps, 64, generator=torch.Generator().manual_seed(7))  # [steps, 64]
    tokens = []
    for step in range(steps):
        logits = torch.randn(len(rows), 64, generator=gen)  # [N, 64] neighbours' logits differ per run
        logits[position] = target_logits[step]
        tokens.append(Sampler()(logits, rows).token_ids[position].item())
        target.output_token_ids.append(tokens[-1])
    return tokens


def test_same_seed_same_tokens_regardless_of_batch() -> None:
    first = _seeded_run(42, 0, [{}, {"temperature": 0.5}])
    torch.manual_seed(5)  # the default RNG must not matter to a seeded row
    second = _seeded_run(42, 2, [{"temperature": 0.0}, {"seed": 7}, {"top_k": 3}])
    third = _seeded_run(42, 0, [])
    assert first == second == third


def test_different_seeds_differ() -> None:
    runs = {tuple(_seeded_run(seed, 0, [])) for seed in range(10)}
    assert len(runs) >= 8


# ---- logprobs --------------------------------------------------------------------------------------------


def test_logprobs_are_raw_and_top_sorted() -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(11)) * 3  # [4, 20]
    infos = [
        info(logprobs=3, output=(1, 2), repetition_penalty=1.7, frequency_penalty=1.0, temperature=0.6),
        info(),
        info(logprobs=0, temperature=0.0, banned=(int(logits[2].argmax()),)),
        info(logprobs=1, top_k=4, top_p=0.9),
    ]
    out = Sampler()(logits, infos)
    raw = torch.log_softmax(logits, dim=-1)  # [4, 20]
    assert out.logprobs is not None and out.top_logprobs is not None and out.top_token_ids is not None
    assert (
        out.logprobs.shape == (4,) and out.top_logprobs.shape == (4, 3) and out.top_token_ids.shape == (4, 3)
    )
    assert torch.equal(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])
    expected_ids = raw.argsort(dim=-1, descending=True)[:, :3]  # [4, 3]
    assert torch.equal(out.top_token_ids, expected_ids)
    assert torch.equal(out.top_logprobs, raw.gather(1, expected_ids))
    assert out.token_ids[2].item() != logits[2].argmax().item()  # banned still applies with logprobs on


def test_logprobs_zero_gives_no_top() -> None:
    logits = row(0.0, 1.0, 2.0)
    out = Sampler()(logits, [info(logprobs=0, temperature=0.0)])
    assert out.token_ids.tolist() == [2]
    assert out.logprobs is not None
    assert out.logprobs.tolist() == pytest.approx([torch.log_softmax(logits[0], -1)[2].item()])
    assert out.top_logprobs is None and out.top_token_ids is None
