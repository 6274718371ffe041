"""Fused MoE on the GPU at real shapes (Qwen3-30B-A3B, Mixtral-8x7B; bf16) vs. the torch reference, free of
host syncs, deterministic, and under CUDA-graph capture/replay with routing that changes between replays; the
one-launch Triton alignment (kernels/moe_align.py) against the torch one, alone and in the MoE layer."""

from __future__ import annotations

import pytest
import torch

from longserve.platform import capture_cuda_graph

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# name: (E, top_k, hidden, expert intermediate, weights rounded to bf16 as Qwen-MoE's router does)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768, True), "mixtral-8x7b": (8, 2, 4096, 14336, False)}
TOKENS = [1, 7, 64, 1000, 8192]
TOL = 3e-2  # elementwise, values are O(1): a few bf16 ulps of rounding flips between GEMM orders
NORM_TOL = 1e-2  # whole-output relative error


@pytest.fixture(scope="module", params=list(SHAPES))
def experts(request):
    num_experts, top_k, hidden, inter, round_weights = SHAPES[request.param]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen).mul_(hidden**-0.5)
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", generator=gen).mul_(inter**-0.5)
    yield request.param, w13.bfloat16(), w2.bfloat16(), top_k, round_weights  # [E, 2I, H], [E, H, I]
    torch.cuda.empty_cache()


def route(num_tokens: int, num_experts: int, top_k: int, round_weights: bool, seed: int):
    from longserve.kernels.moe_reference import route_topk

    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)  # [T, E]
    weights, ids = route_topk(logits.bfloat16(), top_k, renormalize=True)
    return (weights.bfloat16() if round_weights else weights), ids


def assert_close_rel(out: torch.Tensor, ref: torch.Tensor) -> None:
    out, ref = out.float(), ref.float()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < NORM_TOL, f"relative error {rel:.2e}"
    torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("num_tokens", TOKENS)
def test_fused_moe_matches_reference(experts, num_tokens: int) -> None:
    from longserve.kernels.fused_moe import fused_moe, fused_moe_ref

    _, w13, w2, top_k, round_weights = experts
    x = torch.randn(num_tokens, w13.shape[2], device="cuda", dtype=torch.bfloat16)  # [T, H]
    weights, ids = route(num_tokens, w13.shape[0], top_k, round_weights, seed=num_tokens)
    out = fused_moe(x, w13, w2, weights, ids)  # [T, H]
    assert_close_rel(out, fused_moe_ref(x, w13, w2, weights, ids))
    assert torch.equal(fused_moe(x, w13, w2, weights, ids), out)  # deterministic: no atomics


def test_no_host_sync(experts) -> None:
    """Routing, alignment and both GEMMs never wait for the GPU (what CUDA graphs and overlap need)."""
    from longserve.kernels.fused_moe import fused_moe, route_topk

    _, w13, w2, top_k, _ = experts
    x = torch.randn(64, w13.shape[2], device="cuda", dtype=torch.bfloat16)  # [T, H]
    logits = torch.randn(64, w13.shape[0], device="cuda")  # [T, E]
    fused_moe(x, w13, w2, *route_topk(logits, top_k, True))  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(x, w13, w2, *route_topk(logits, top_k, True))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("num_tokens", [1, 32])
def test_cuda_graph_replay(experts, num_tokens: int) -> None:
    """A decode batch captured once replays correctly for new hidden states and new routing."""
    from longserve.kernels.fused_moe import fused_moe, fused_moe_ref, route_topk

    _, w13, w2, top_k, _ = experts
    hidden, num_experts = w13.shape[2], w13.shape[0]
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)  # [T, H] static input
    logits = torch.randn(num_tokens, num_experts, device="cuda")  # [T, E] static input
    out = torch.empty_like(x)  # [T, H] static output

    def step() -> None:
        weights, ids = route_topk(logits, top_k, True)
        fused_moe(x, w13, w2, weights, ids, out=out)

    graph = capture_cuda_graph(step)  # its warm-up, off the capture, compiles the kernels
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(100 + seed)
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
        logits.copy_(torch.randn(logits.shape, device="cuda", generator=gen) * 3)  # other experts each time
        graph.replay()
        torch.cuda.synchronize()
        assert_close_rel(out, fused_moe_ref(x, w13, w2, *route_topk(logits, top_k, True)))


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 512])
@pytest.mark.parametrize("block_m", [16, 64])
def test_triton_alignment_equals_torch(experts, num_tokens: int, block_m: int) -> None:
    """The one-launch Triton alignment (kernels/moe_align.py) gives the torch ops' tensors on the GPU, with
    and without an expert-parallel map, eagerly and replayed from a CUDA graph with other routing."""
    from longserve.kernels.moe_align import moe_align
    from longserve.kernels.moe_reference import moe_align_ref

    _, w13, _, top_k, _ = experts
    num_experts = w13.shape[0]
    emap = torch.full((num_experts,), -1, dtype=torch.int32, device="cuda")  # rank 1 of 2
    half = num_experts // 2
    emap[half:] = torch.arange(num_experts - half, dtype=torch.int32, device="cuda")
    for expert_map, local in ((None, num_experts), (emap, num_experts - half)):
        for seed in range(3):
            _, ids = route(num_tokens, num_experts, top_k, False, seed=seed)
            got, ref = (
                moe_align(ids, local, block_m, expert_map),
                moe_align_ref(ids, local, block_m, expert_map),
            )
            for a, b in zip(got, ref, strict=True):
                assert torch.equal(a, b)
        ids = ids.clone()  # static input of the graph
        moe_align(ids, local, block_m, expert_map)  # compiled off the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = moe_align(ids, local, block_m, expert_map)
        for seed in range(10, 13):
            ids.copy_(route(num_tokens, num_experts, top_k, False, seed=seed)[1])
            graph.replay()
            for a, b in zip(outs, moe_align_ref(ids, local, block_m, expert_map), strict=True):
                assert torch.equal(a, b)


@pytest.mark.parametrize("num_tokens", [1, 8, 64, 512])
def test_fused_moe_with_the_triton_alignment(
    experts, monkeypatch: pytest.MonkeyPatch, num_tokens: int
) -> None:
    """MOE_TRITON_ALIGN_MAX_PAIRS on: the MoE layer's output equals the torch alignment's bit for bit, eagerly
    and inside a CUDA graph replayed with new hidden states and routing."""
    from longserve.kernels import moe_align as mod
    from longserve.kernels.fused_moe import fused_moe, fused_moe_ref, route_topk

    _, w13, w2, top_k, _ = experts
    hidden, num_experts = w13.shape[2], w13.shape[0]
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)  # [T, H] static input
    logits = torch.randn(num_tokens, num_experts, device="cuda")  # [T, E] static input
    out = torch.empty_like(x)  # [T, H] static output
    off = fused_moe(x, w13, w2, *route_topk(logits, top_k, True))
    monkeypatch.setattr(mod, "MOE_TRITON_ALIGN_MAX_PAIRS", 8192)
    assert torch.equal(fused_moe(x, w13, w2, *route_topk(logits, top_k, True)), off)

    def step() -> None:
        fused_moe(x, w13, w2, *route_topk(logits, top_k, True), out=out)

    graph = capture_cuda_graph(step)
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(200 + seed)
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
        logits.copy_(torch.randn(logits.shape, device="cuda", generator=gen) * 3)
        graph.replay()
        torch.cuda.synchronize()
        weights, ids = route_topk(logits, top_k, True)
        monkeypatch.setattr(mod, "MOE_TRITON_ALIGN_MAX_PAIRS", 0)
        assert torch.equal(out, fused_moe(x, w13, w2, weights, ids))  # the torch alignment, eagerly
        monkeypatch.setattr(mod, "MOE_TRITON_ALIGN_MAX_PAIRS", 8192)
        assert_close_rel(out, fused_moe_ref(x, w13, w2, weights, ids))


@pytest.mark.parametrize("num_tokens", [1, 64, 512])
def test_fused_routing_matches_route_topk(experts, num_tokens: int) -> None:
    """The one-launch router top-k (kernels/moe_routing.py) on the GPU: the experts torch.topk picks (as a set
    per token: the order of exactly tied scores is open), weights equal to fp32 rounding, bf16 weights within
    one ulp; inside a CUDA graph too."""
    from longserve.kernels.moe_reference import route_topk
    from longserve.kernels.moe_routing import route_topk_fused

    _, w13, _, top_k, round_weights = experts
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    logits = torch.randn(num_tokens, w13.shape[0], device="cuda", generator=gen).bfloat16()  # [T, E]
    dtype = torch.bfloat16 if round_weights else torch.float32

    def check(got_w, got_ids):
        ref_w, ref_ids = route_topk(logits, top_k, True)
        assert torch.equal(got_ids.sort(1).values, ref_ids.sort(1).values)
        scores = logits.float()
        assert torch.equal(scores.gather(1, got_ids.long()), scores.gather(1, ref_ids.long()))
        ref_w = ref_w.to(dtype)
        torch.testing.assert_close(
            got_w.float(), ref_w.float(), atol=1e-6, rtol=2**-7 if round_weights else 1e-6
        )

    check(*route_topk_fused(logits, top_k, True, weights_dtype=dtype))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = route_topk_fused(logits, top_k, True, weights_dtype=dtype)
    logits.copy_(torch.randn(logits.shape, device="cuda", generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    check(*outs)


@pytest.mark.parametrize("num_tokens", [1, 2, 4, 16])
def test_small_batch_kernels_match_reference(experts, num_tokens: int) -> None:
    """kernels/moe_gemv.py (gate+up per pair, down with the sum over k per token) at real shapes: equal to
    the reference, deterministic, and its time beside fused_moe's printed (the evidence for
    MOE_GEMV_MAX_TOKENS, 0 since measured slower at one token)."""
    from longserve.kernels.fused_moe import fused_moe, fused_moe_ref
    from longserve.kernels.moe_gemv import moe_gemv
    from longserve.platform import cuda_graph_time_ms

    name, w13, w2, top_k, round_weights = experts
    x = torch.randn(num_tokens, w13.shape[2], device="cuda", dtype=torch.bfloat16)  # [T, H]
    weights, ids = route(num_tokens, w13.shape[0], top_k, round_weights, seed=num_tokens + 1)
    out = moe_gemv(x, w13, w2, weights, ids, torch.empty_like(x))
    assert_close_rel(out, fused_moe_ref(x, w13, w2, weights, ids))
    assert torch.equal(moe_gemv(x, w13, w2, weights, ids, torch.empty_like(x)), out)
    buf = torch.empty_like(x)
    gemv = cuda_graph_time_ms(lambda: moe_gemv(x, w13, w2, weights, ids, buf), warmup=2, iters=20, repeats=5)
    gemm = cuda_graph_time_ms(
        lambda: fused_moe(x, w13, w2, weights, ids, out=buf), warmup=2, iters=20, repeats=5
    )
    print(f"\n{name} T={num_tokens}: moe_gemv {gemv * 1e3:.1f} us, fused_moe {gemm * 1e3:.1f} us")


@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_sum_over_k_kernel(num_tokens: int) -> None:
    """kernels/moe_sum.py at the A3B shape (k = 8, H = 2048): torch.sum's result to one bf16 ulp, and its time
    beside torch.sum's (the evidence for fused_moe.MOE_SUM_TRITON_MAX_TOKENS)."""
    from longserve.kernels.moe_sum import moe_sum
    from longserve.platform import cuda_graph_time_ms

    x = torch.randn(num_tokens, 8, 2048, device="cuda").bfloat16()
    want = torch.empty(num_tokens, 2048, device="cuda", dtype=torch.bfloat16)
    torch.sum(x, dim=1, out=want)
    got = moe_sum(x, torch.empty_like(want))
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)
    ours = cuda_graph_time_ms(lambda: moe_sum(x, got), warmup=2, iters=20, repeats=5)
    torch_ms = cuda_graph_time_ms(lambda: torch.sum(x, dim=1, out=want), warmup=2, iters=20, repeats=5)
    print(f"\nsum over k, T={num_tokens}: moe_sum {ours * 1e3:.1f} us, torch.sum {torch_ms * 1e3:.1f} us")


@pytest.mark.parametrize("num_tokens", [1, 8])
def test_sum_over_k_with_a_shared_experts_addend(num_tokens: int) -> None:
    """moe_sum's addend at the seed's shape (k = 8, H = 2048; the gate a column of the stacked input GEMM's
    output): the sum, then + sigmoid(gate) * shared, each element within a bf16 step of each of torch's ops, nearly
    all with their bits."""
    from longserve.kernels.activation_reference import sigmoid_gated_add_ref
    from longserve.kernels.moe_sum import moe_sum

    x = torch.randn(num_tokens, 8, 2048, device="cuda").bfloat16()
    gate = (torch.randn(num_tokens, 1281, device="cuda") * 3).bfloat16()[:, -1:]
    shared = torch.randn(num_tokens, 2048, device="cuda").bfloat16()
    plain = moe_sum(x, torch.empty(num_tokens, 2048, device="cuda", dtype=torch.bfloat16))
    want = sigmoid_gated_add_ref(plain, gate, shared)
    got = moe_sum(x, torch.empty_like(plain), addend=(gate, shared))
    bound = (want.float().abs() + 2 * shared.float().abs()) * 2**-7 + 1e-6
    assert ((got.float() - want.float()).abs() <= bound).all()
    # the product rounded before the sum, as torch rounds (activation.ROUNDED_AS_TORCH)
    assert (got == want).float().mean() > 0.99
