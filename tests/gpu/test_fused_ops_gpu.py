"""Fused Triton ops on the GPU at Llama-3-8B prefill shapes (bf16) vs. their torch references."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

T, H, INTER, HQ, HKV, D = 8192, 4096, 14336, 32, 8, 128
TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-5}  # the references round like HF
DTYPES = [torch.bfloat16, torch.float16]


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm(dtype: torch.dtype) -> None:
    from longserve.kernels.norm import rms_norm, rms_norm_ref

    x, w = randn(T, H, dtype=dtype, seed=1), randn(H, dtype=dtype, seed=2)
    assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm(dtype: torch.dtype) -> None:
    from longserve.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_ref

    x, res, w = randn(T, H, dtype=dtype, seed=1), randn(T, H, dtype=dtype, seed=3), randn(H, dtype=dtype)
    y, new_res = fused_add_rms_norm(x, res, w, 1e-5)
    y_ref, new_res_ref = fused_add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(new_res, new_res_ref)  # float32 sum rounded once to the input dtype
    assert torch.equal(new_res, x + res)
    assert_close(y, y_ref, dtype)


def test_rms_norm_qk_heads() -> None:
    """Qwen3's per-head norm: [T, Hq, D] rows of a fused qkv view, D=128."""
    from longserve.kernels.norm import rms_norm, rms_norm_ref

    qkv = randn(T, (HQ + 2 * HKV) * D, dtype=torch.bfloat16, seed=4)
    q = qkv[:, : HQ * D].view(T, HQ, D)  # [T, Hq, D]
    w = randn(D, dtype=torch.bfloat16, seed=5)
    assert_close(rms_norm(q, w, 1e-6), rms_norm_ref(q, w, 1e-6), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    from longserve.kernels.activation import silu_and_mul, silu_and_mul_ref

    x = randn(T, 2 * INTER, dtype=dtype, seed=6)
    assert_close(silu_and_mul(x), silu_and_mul_ref(x), dtype)


@pytest.mark.parametrize("rows", [1, 64, 8192])
def test_sigmoid_gated_add(rows: int) -> None:
    """The Qwen-MoE shared expert's gated add at the seed's hidden size (2,048), the gate a column of the stacked
    input GEMM's output: each element within a rounding of torch's three ops, nearly all with torch's bits, and on
    average as near the exact value as they are."""
    from longserve.kernels.activation import sigmoid_gated_add, sigmoid_gated_add_ref

    out, shared = (
        randn(rows, 2048, dtype=torch.bfloat16, seed=7),
        randn(rows, 2048, dtype=torch.bfloat16, seed=8),
    )
    gate = (randn(rows, 1281, dtype=torch.bfloat16, seed=9) * 4)[:, -1:]
    want = sigmoid_gated_add_ref(out, gate, shared)
    got = sigmoid_gated_add(out.clone(), gate, shared)
    # each op's rounding may land a bf16 step away (Triton's exp is not torch's): one step of each op's value
    bound = (want.float().abs() + 2 * shared.float().abs()) * 2**-7 + 1e-6
    assert ((got.float() - want.float()).abs() <= bound).all()
    # torch's bits: on an H100 (fiftieth session) only 75-84% had them, the product and the sum compiled into one
    # bf16 FMA; launched with activation.ROUNDED_AS_TORCH (no FP fusion) the product is rounded first, as torch
    # does, and only a row's gate (Triton's exp is not torch's) may round the other way
    assert (got == want).float().mean() > 0.99
    # and on average as near the exact value as torch's three ops
    exact = out.double() + torch.sigmoid(gate.double()) * shared.double()
    err_kernel, err_torch = (got.double() - exact).abs().mean(), (want.double() - exact).abs().mean()
    assert err_kernel <= 1.25 * err_torch, (err_kernel.item(), err_torch.item())


@pytest.mark.parametrize("rows", [1, 64, 8192])
def test_sigmoid_mul(rows: int) -> None:
    """The attention output gate at the seed's attention shape (16 heads of 256), the gate the second half of
    each head's [q | gate] rows: within a rounding of torch's ops, most the same bits."""
    from longserve.kernels.activation import sigmoid_mul, sigmoid_mul_ref

    x = randn(rows, 16, 256, dtype=torch.bfloat16, seed=10)
    gate = randn(rows, 16, 512, dtype=torch.bfloat16, seed=11)[..., 256:]
    want = sigmoid_mul_ref(x, gate)
    got = sigmoid_mul(x.clone(), gate)
    assert ((got.float() - want.float()).abs() <= 2 * want.float().abs() * 2**-7 + 1e-6).all()
    assert (got == want).float().mean() > 0.9


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_embedding(dtype: torch.dtype) -> None:
    from longserve.kernels.rope import rotary_embedding, rotary_embedding_ref
    from longserve.models.rope import RotaryEmbedding

    params = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }  # fmt: skip
    rope = RotaryEmbedding(D, params, 131072).cuda()
    cache = rope.cos_sin_cache()  # [P, D]
    positions = torch.randint(0, 131072, (T,), device="cuda")  # [T], long-context positions
    qkv = randn(T, (HQ + 2 * HKV) * D, dtype=dtype, seed=7)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)  # views, as Attention.forward passes them
    q_ref, k_ref, v_before = q.clone(), k.clone(), v.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, cache)
    rotary_embedding(positions, q, k, cache)
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    assert torch.equal(v, v_before)
    # the cache rows equal the per-step cos/sin HF computes (float32)
    cos, sin = rope(positions, torch.float32)  # [T, D]
    torch.testing.assert_close(cache[positions], torch.cat((cos[:, : D // 2], sin[:, : D // 2]), -1))


def test_bench_fused_ops_runs() -> None:
    from longserve.bench.kernels.fused_ops import bench_fused_ops

    rows = bench_fused_ops(num_tokens=256)
    assert [r["op"] for r in rows] == ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"]
    assert all(float(r["triton_gbps"]) > 0 for r in rows)


def test_fast_launch_equals_triton_launch() -> None:
    """Kernels re-launched directly (FastKernel) give the same bits as Triton's own launch, over shapes and
    views that Triton specializes differently (1 row, 16, 17, a pointer off 16-byte alignment)."""
    from longserve.kernels import norm, rope
    from longserve.kernels.launch import FastKernel

    assert isinstance(norm._rms_norm_kernel, FastKernel) and isinstance(rope._rope_kernel, FastKernel)
    w = randn(H, dtype=torch.bfloat16, seed=2)
    cache = randn(4096, D, dtype=torch.float32, seed=6)
    before = norm._rms_norm_kernel.fast_launches
    for rows in (1, 16, 17, 64, 1, 17, 16):
        flat = randn(2 * (rows + 1) * H, dtype=torch.bfloat16, seed=rows)
        x = flat[: rows * H].view(rows, H)
        res = flat[rows * H + 1 : 2 * rows * H + 1].view(rows, H)  # 2 bytes past 16-byte alignment
        qk = randn(rows, (HQ + HKV) * D, dtype=torch.bfloat16, seed=rows + 1)
        pos = torch.randint(0, 4096, (rows,), device="cuda")
        outs = []
        for enabled in (True, True, False):  # compile (or reuse), reuse, through Triton
            FastKernel.enabled = enabled
            try:
                q, k = qk[:, : HQ * D].clone(), qk[:, HQ * D :].clone()
                rope.rotary_embedding(pos, q, k, cache)
                outs.append((*norm.fused_add_rms_norm(x, res, w, 1e-5), norm.rms_norm(x, w, 1e-5), q, k))
            finally:
                FastKernel.enabled = True
        for fast in outs[:2]:
            for a, b in zip(fast, outs[2]):
                assert torch.equal(a, b), rows
        assert_close(outs[0][0], norm.fused_add_rms_norm_ref(x, res, w, 1e-5)[0], torch.bfloat16)
    assert norm._rms_norm_kernel.fast_launches >= before + 2 * 7
