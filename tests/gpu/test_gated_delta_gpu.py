"""The Gated DeltaNet kernels on the GPU at Qwen3.5's linear-attention shape (16 key / 32 value heads of 128,
conv width 4) against their torch references: a varlen prefill of requests of 1, 700 and 3,000 tokens (one
continuing a state; two saving a state inside the step), then decode steps (the last two also with the gating
inside the decode kernel: the same bits), in bf16 with float32 and bf16 state pools; other slots untouched. The
CPU tests (tests/unit/test_gated_delta.py, test_causal_conv1d.py) run them interpreted at tiny shapes."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HK, HV, K, V, W = 16, 32, 128, 128, 4
D = 2 * HK * K + HV * V
LENS, SLOTS, HAS = [1, 700, 3000], [3, 0, 5], [False, True, False]


def randn(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def inputs(n: int, seed: int):
    qkv = randn(n, D, seed=seed)
    q, k, v = qkv.split([HK * K, HK * K, HV * V], dim=-1)
    a, b = randn(n, HV, seed=seed + 1), randn(n, HV, seed=seed + 2)
    return qkv, q.view(n, HK, K), k.view(n, HK, K), v.view(n, HV, V), a, b


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_then_decode_equal_references(state_dtype: torch.dtype) -> None:
    from longserve.kernels import causal_conv1d as cc
    from longserve.kernels import gated_delta as gd

    n = sum(LENS)
    qsl = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    slots = torch.tensor(SLOTS, dtype=torch.int32, device="cuda")
    has = torch.tensor(HAS, device="cuda")
    weight, a_log, dt_bias = randn(D, W, seed=7, scale=0.5), randn(HV, seed=8).float(), randn(HV, seed=9)
    conv0, ssm0 = randn(8, W - 1, D, seed=10), randn(8, HV, K, V, dtype=state_dtype, seed=11, scale=0.1)
    pools = {name: (conv0.clone(), ssm0.clone()) for name in ("kernel", "ref")}
    qkv, *_, a, b = inputs(n, seed=1)
    # states saved inside the step (prefix-cache checkpoints): the 700-token request's after 320 tokens into row 7,
    # the 3,000-token one's after 2,560 into row 4
    saves = (
        torch.tensor([-1, 5, 40], dtype=torch.int32, device="cuda"),
        torch.tensor([0, 7, 4], device="cuda"),
    )
    outs = {}
    for name, conv_fn, rule_fn, gating in (
        ("kernel", cc.causal_conv1d_prefill, gd.gated_delta_prefill, gd.gdn_gating),
        ("ref", cc.causal_conv1d_prefill_ref, gd.gated_delta_prefill_ref, gd.gdn_gating_ref),
    ):
        conv, ssm = pools[name]
        mixed = conv_fn(qkv, weight, conv, qsl, slots, has)
        q, k, v = mixed.split([HK * K, HK * K, HV * V], dim=-1)
        g, beta = gating(a, b, a_log, dt_bias)
        outs[name] = (mixed, rule_fn(q.view(n, HK, K), k.view(n, HK, K), v.view(n, HV, V), g, beta, ssm, qsl, slots,
                                     has, saves=saves))  # fmt: skip
    assert rel(outs["kernel"][0], outs["ref"][0]) < 1e-2  # the conv: one rounding of its bf16 output
    assert rel(outs["kernel"][1], outs["ref"][1]) < 3e-2
    for i in range(2):  # the pools after the prefill, then after 4 decode steps of the three requests
        assert rel(pools["kernel"][1][SLOTS], pools["ref"][1][SLOTS]) < 3e-2
        assert rel(pools["kernel"][1][[7, 4]], pools["ref"][1][[7, 4]]) < 3e-2  # the saved states
        assert torch.equal(pools["kernel"][1][[1, 2, 6]], ssm0[[1, 2, 6]])  # no other slot written
        if i:
            break
        for step in range(4):
            x, *_, a1, b1 = inputs(3, seed=20 + step)
            got = {}
            for name, conv_fn, rule_fn, gating in (
                ("kernel", cc.causal_conv1d_decode, gd.gated_delta_decode, gd.gdn_gating),
                ("ref", cc.causal_conv1d_decode_ref, gd.gated_delta_decode_ref, gd.gdn_gating_ref),
            ):
                conv, ssm = pools[name]
                mixed = conv_fn(x, weight, conv, slots)
                q, k, v = mixed.split([HK * K, HK * K, HV * V], dim=-1)
                qkv1 = (q.view(3, HK, K), k.view(3, HK, K), v.view(3, HV, V))
                apart_pool = ssm.clone()
                got[name] = rule_fn(*qkv1, *gating(a1, b1, a_log, dt_bias), apart_pool, slots)
                if name == "kernel" and step >= 2:  # the gating inside the decode kernel: the same bits
                    fused = gd.gated_delta_decode_gating(*qkv1, a1, b1, a_log, dt_bias, ssm, slots)
                    assert torch.equal(fused, got[name]) and torch.equal(ssm, apart_pool), step
                ssm.copy_(apart_pool)
            assert rel(got["kernel"], got["ref"]) < 3e-2, step
