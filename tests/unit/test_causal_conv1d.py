"""The Gated DeltaNet causal conv (kernels/causal_conv1d.py): the torch references equal transformers' own
`causal_conv1d_fn` / `causal_conv1d_update` (Qwen3.5) per request, and the Triton kernels (interpreted on the
CPU) equal the references on a flattened varlen step over a state pool: lengths shorter and longer than the
conv's W-1 state rows, an empty request, requests with and without state, a padding slot -1, a strided input,
float32 and bfloat16; a prompt run in two calls or as prefill + decodes equals one call; other slots stay
untouched."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from longserve.kernels.causal_conv1d import (  # noqa: E402
    causal_conv1d_decode,
    causal_conv1d_decode_ref,
    causal_conv1d_prefill,
    causal_conv1d_prefill_ref,
)

WIDTH = 4
DIM = 80  # not a multiple of the kernels' channel block
SLOTS = 8
LENS = [1, 2, 3, 0, 17, 40]  # shorter than, equal to and longer than the W-1 state rows; an empty request
SLOT_IDS = [3, 0, 5, 2, -1, 6]  # -1: a padding row
HAS_STATE = [True, True, False, True, True, False]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def step(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def inputs(dtype: torch.dtype, lens: list[int] = LENS, seed: int = 0):
    """x [T, D] as a strided view (a wider row, as a column slice of a projection), weight [D, W], a pool."""
    total = sum(lens)
    x = torch.randn(total, DIM + 16, generator=gen(seed)).to(dtype)[:, 8 : 8 + DIM]
    weight = (torch.randn(DIM, WIDTH, generator=gen(seed + 1)) * 0.5).to(dtype)
    states = torch.randn(SLOTS, WIDTH - 1, DIM, generator=gen(seed + 2)).to(dtype)
    return x, weight, states


def real_rows(lens: list[int], slots: list[int]) -> torch.Tensor:
    """The token rows whose outputs count (those of padding requests are don't-care)."""
    return torch.cat([torch.full((n,), s >= 0) for n, s in zip(lens, slots)])


def test_reference_equals_transformers_per_request() -> None:
    hf = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    x, weight, states = inputs(torch.float32)
    pool = states.clone()
    qsl = step(LENS)
    y = causal_conv1d_prefill_ref(x, weight, pool, qsl, torch.tensor(SLOT_IDS), torch.tensor(HAS_STATE))
    for r, slot in enumerate(SLOT_IDS):
        s, e = qsl[r].item(), qsl[r + 1].item()
        if slot < 0:
            continue
        prev = states[slot] if HAS_STATE[r] else torch.zeros(WIDTH - 1, DIM)
        # HF's prefill with a cache: the cached inputs prepended, the conv over all, their outputs dropped
        full = torch.cat([prev, x[s:e]]).t()[None]  # [1, D, W-1+L]
        want = hf.causal_conv1d_fn(full, weight, None, activation="silu")[0, :, WIDTH - 1 :].t()
        torch.testing.assert_close(y[s:e], want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(pool[slot], full[0, :, -(WIDTH - 1) :].t(), atol=0, rtol=0)
    # decode: HF's update keeps W inputs (the first never read again), ours the last W-1
    xd = torch.randn(3, DIM, generator=gen(9))
    slots = torch.tensor([1, 4, 7])
    hf_state = torch.cat([torch.zeros(3, DIM, 1), states[slots].transpose(1, 2)], dim=2)  # [B, D, W]
    want = hf.causal_conv1d_update(xd[:, :, None], hf_state, weight, None, activation="silu")[:, :, 0]
    pool = states.clone()
    torch.testing.assert_close(causal_conv1d_decode_ref(xd, weight, pool, slots), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pool[slots], hf_state[:, :, 1:].transpose(1, 2), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_equals_reference(dtype: torch.dtype) -> None:
    x, weight, states = inputs(dtype)
    got_pool, want_pool = states.clone(), states.clone()
    args = (step(LENS), torch.tensor(SLOT_IDS, dtype=torch.int32), torch.tensor(HAS_STATE))
    got = causal_conv1d_prefill(x, weight, got_pool, *args)
    want = causal_conv1d_prefill_ref(x, weight, want_pool, *args)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    rows = real_rows(LENS, SLOT_IDS)
    assert got.dtype == dtype and got.shape == (sum(LENS), DIM)
    torch.testing.assert_close(got[rows].float(), want[rows].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got_pool, want_pool, atol=0, rtol=0)  # the states are inputs moved: exact
    unused = [s for s in range(SLOTS) if s not in SLOT_IDS]
    assert torch.equal(got_pool[unused], states[unused])


def test_prefill_kernel_bias_no_activation_and_float32_pool() -> None:
    """The other variants: a bias, no activation, a float32 pool under bfloat16 inputs."""
    x, weight, states = inputs(torch.bfloat16, seed=3)
    states = states.float()
    bias = torch.randn(DIM, generator=gen(7)).bfloat16()
    got_pool, want_pool = states.clone(), states.clone()
    args = (step(LENS), torch.tensor(SLOT_IDS, dtype=torch.int32), torch.tensor(HAS_STATE))
    got = causal_conv1d_prefill(x, weight, got_pool, *args, activation=None, bias=bias)
    want = causal_conv1d_prefill_ref(x, weight, want_pool, *args, activation=None, bias=bias)
    rows = real_rows(LENS, SLOT_IDS)
    torch.testing.assert_close(got[rows].float(), want[rows].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_pool, want_pool, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_equals_reference(dtype: torch.dtype) -> None:
    _, weight, states = inputs(dtype, seed=5)
    x = torch.randn(5, DIM + 8, generator=gen(6)).to(dtype)[:, :DIM]
    slots = torch.tensor([4, -1, 0, 7, 2], dtype=torch.int32)
    got_pool, want_pool = states.clone(), states.clone()
    got = causal_conv1d_decode(x, weight, got_pool, slots)
    want = causal_conv1d_decode_ref(x, weight, want_pool, slots)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[slots >= 0].float(), want[slots >= 0].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got_pool, want_pool, atol=0, rtol=0)
    assert torch.equal(got_pool[[1, 3, 5, 6]], states[[1, 3, 5, 6]])


def test_split_prompts_and_decodes_equal_one_prefill() -> None:
    """Three prompts (20, 4 and 9 tokens) in one call equal: two calls of [13, 1, 5] then [7, 3, 4] tokens (the
    second continuing from the slots), and a prefill of [17, 1, 6] tokens then 3 decode steps."""
    lens = [20, 4, 9]
    slots = torch.tensor([5, 1, 3], dtype=torch.int32)
    x, weight, states = inputs(torch.float32, lens=lens, seed=11)
    one = states.clone()
    want = causal_conv1d_prefill(x, weight, one, step(lens), slots, torch.zeros(3, dtype=torch.bool))
    per_req = list(torch.split(x, lens))

    def prefill(pool: torch.Tensor, cuts: list[tuple[int, int]], has_state: bool) -> list[torch.Tensor]:
        parts = [r[c0:c1] for r, (c0, c1) in zip(per_req, cuts)]
        n = [p.shape[0] for p in parts]
        y = causal_conv1d_prefill(torch.cat(parts), weight, pool, step(n), slots, torch.full((3,), has_state))
        return list(torch.split(y, n))

    two = states.clone()
    first = prefill(two, [(0, 13), (0, 1), (0, 5)], False)
    second = prefill(two, [(13, 20), (1, 4), (5, 9)], True)
    got = torch.cat([torch.cat([a, b]) for a, b in zip(first, second)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(two, one, atol=0, rtol=0)

    dec = states.clone()
    outs = prefill(dec, [(0, 17), (0, 1), (0, 6)], False)
    for i in range(3):
        # [B, D]: one token of each request
        rows = torch.stack([per_req[0][17 + i], per_req[1][1 + i], per_req[2][6 + i]])
        y = causal_conv1d_decode(rows, weight, dec, slots)
        outs = [torch.cat([o, y[r : r + 1]]) for r, o in enumerate(outs)]
    torch.testing.assert_close(torch.cat(outs), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(dec, one, atol=0, rtol=0)
