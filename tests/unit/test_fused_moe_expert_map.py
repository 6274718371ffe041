"""Expert parallelism in the fused MoE (`expert_map`): under TRITON_INTERPRET=1 each rank's kernel output
equals the reference's with the same map, the ranks' outputs sum to the whole layer's, and a rank none of
whose experts is picked (every pair remote: the real padded length is zero) returns zeros."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from longserve.kernels.fused_moe import fused_moe, fused_moe_ref, route_topk  # noqa: E402

CFG = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)  # tiny: many blocks


def rank_map(num_experts: int, ranks: int, rank: int) -> torch.Tensor:
    per = num_experts // ranks
    emap = torch.full((num_experts,), -1, dtype=torch.int32)
    emap[rank * per : (rank + 1) * per] = torch.arange(per, dtype=torch.int32)
    return emap


@pytest.mark.parametrize(("num_tokens", "top_k", "ranks"), [(1, 1, 2), (9, 2, 2), (13, 3, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ranks_sum_to_the_whole(num_tokens: int, top_k: int, ranks: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(num_tokens)
    e, h, inter = 6, 32, 20  # I not a multiple of the block: masked tails
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype)
    x = torch.randn(num_tokens, h, generator=g).to(dtype)
    weights, ids = route_topk(torch.randn(num_tokens, e, generator=g), top_k, renormalize=True)
    whole = fused_moe_ref(x, w13, w2, weights, ids).float()
    per = e // ranks
    total = torch.zeros_like(whole)
    for r in range(ranks):
        emap = rank_map(e, ranks, r)
        local13, local2 = w13[r * per : (r + 1) * per].contiguous(), w2[r * per : (r + 1) * per].contiguous()
        out = fused_moe(x, local13, local2, weights, ids, config=CFG, expert_map=emap)
        ref = fused_moe_ref(x, local13, local2, weights, ids, expert_map=emap)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
        total += out.float()
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(total, whole, atol=tol, rtol=tol)


def test_a_rank_with_no_routed_pair_returns_zeros() -> None:
    g = torch.Generator().manual_seed(0)
    e, h, inter = 4, 16, 8
    w13, w2 = torch.randn(2, 2 * inter, h, generator=g), torch.randn(2, h, inter, generator=g)
    x = torch.randn(5, h, generator=g)
    ids = torch.tensor([[0, 1]] * 5, dtype=torch.int32)  # every token picks experts 0 and 1
    weights = torch.full((5, 2), 0.5)
    emap = rank_map(e, 2, 1)  # this rank holds experts 2 and 3
    out = fused_moe(x, w13, w2, weights, ids, config=CFG, expert_map=emap)
    assert torch.equal(out, torch.zeros_like(x))
    assert torch.equal(fused_moe_ref(x, w13, w2, weights, ids, expert_map=emap), torch.zeros_like(x))
