"""The Gated DeltaNet kernels (kernels/gated_delta.py, gated_delta_chunk.py, gated_norm.py): the torch references
equal transformers' own Qwen3.5 functions per request in float32 (the chunked and the recurrent delta rule, the
gated RMSNorm, the layer's g / beta, and the whole layer composed of our references), and the Triton kernels
(interpreted on the CPU) equal the references on a flattened varlen step over a state pool: lengths around the
64-token chunk (1, 3, 63, 64, 65, 130), GQA, requests with and without state, a padding slot -1, q/k/v as strided
views of one projection, float32 and bfloat16 inputs and pools; a prompt run in two calls, or as a prefill then
decode steps, equals one call; slots no request names stay untouched."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from longserve.kernels.causal_conv1d_reference import causal_conv1d_prefill_ref  # noqa: E402
from longserve.kernels.gated_delta import (  # noqa: E402
    gated_delta_decode,
    gated_delta_decode_gating,
    gated_delta_decode_gating_ref,
    gated_delta_decode_ref,
    gated_delta_prefill,
    gated_delta_prefill_ref,
    gdn_gating,
    gdn_gating_ref,
)
from longserve.kernels.gated_norm import gated_rms_norm, gated_rms_norm_ref  # noqa: E402

HK, HV, K, V = 2, 4, 32, 16  # GQA: each q/k head serves two value heads
SLOTS = 8
LENS = [1, 3, 63, 64, 65, 130]
SLOT_IDS = [3, 0, 5, -1, 1, 7]  # -1: a padding row
HAS_STATE = [True, False, True, True, False, True]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def step(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def qkv_views(tokens: int, dtype: torch.dtype, seed: int):
    """q, k [T, Hk, K] and v [T, Hv, V] as views of one [T, 2*Hk*K + Hv*V] row, as split from the conv output."""
    mixed = torch.randn(tokens, 2 * HK * K + HV * V, generator=gen(seed)).to(dtype)
    q = mixed[:, : HK * K].view(tokens, HK, K)
    k = mixed[:, HK * K : 2 * HK * K].view(tokens, HK, K)
    return q, k, mixed[:, 2 * HK * K :].view(tokens, HV, V)


def gates(tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """g, beta of the layer's formula (decays of a few percent a token, as trained layers have)."""
    a = torch.randn(tokens, HV, generator=gen(seed)).to(dtype)
    b = torch.randn(tokens, HV, generator=gen(seed + 1)).to(dtype)
    a_log = torch.linspace(-3.0, -1.0, HV)
    return gdn_gating_ref(a, b, a_log, torch.full((HV,), -1.0))


def pool(dtype: torch.dtype, seed: int = 3) -> torch.Tensor:
    return (torch.randn(SLOTS, HV, K, V, generator=gen(seed)) * 0.5).to(dtype)


def real_rows(lens: list[int], slots: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), s >= 0) for n, s in zip(lens, slots)])


def assert_near(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    """float32: to float32 rounding. bfloat16: the kernels round the dot operands to bf16 (and the interpreter
    rounds toward zero, a biased error that compounds: ~1.5% in norm where an sm90 build rounds to nearest), so
    the error's norm within 3% of the result's, no element off by 5% of the largest."""
    got, want = got.float(), want.float()
    if exact:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    assert (got - want).norm() <= 0.03 * want.norm(), ((got - want).norm() / want.norm()).item()
    torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("l2norm", [True, False])
def test_references_equal_transformers_rules_per_request(l2norm: bool) -> None:
    hf = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    total = sum(LENS)
    q, k, v = qkv_views(total, torch.float32, seed=1)
    if not l2norm:  # unnormalized keys: keep the delta rule stable (|k|^2 beta < 2)
        q, k = q * K**-0.5, k * K**-0.5
    g, beta = gates(total, torch.float32, seed=2)
    states = pool(torch.float32)
    got_pool = states.clone()
    qsl = step(LENS)
    flags = (torch.tensor(SLOT_IDS), torch.tensor(HAS_STATE))
    o = gated_delta_prefill_ref(q, k, v, g, beta, got_pool, qsl, *flags, use_qk_l2norm=l2norm)
    for r, slot in enumerate(SLOT_IDS):
        s, e = qsl[r].item(), qsl[r + 1].item()
        init = states[slot][None] if slot >= 0 and HAS_STATE[r] else None
        for rule in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
            want, final = rule(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e],
                               initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)  # fmt: skip
            torch.testing.assert_close(o[s:e], want[0], atol=2e-6, rtol=1e-5)
            if slot >= 0:
                torch.testing.assert_close(got_pool[slot], final[0], atol=2e-6, rtol=1e-5)
    # decode: one recurrent step of each request
    dq, dk, dv = (x[:4] for x in qkv_views(4, torch.float32, seed=4))
    dg, dbeta = gates(4, torch.float32, seed=5)
    slots = torch.tensor([2, 6, 0, 4])
    dec_pool = states.clone()
    got = gated_delta_decode_ref(dq, dk, dv, dg, dbeta, dec_pool, slots, use_qk_l2norm=l2norm)
    want, final = hf.torch_recurrent_gated_delta_rule(
        dq[:, None], dk[:, None], dv[:, None], dg[:, None], dbeta[:, None], initial_state=states[slots],
        output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
    )  # fmt: skip
    torch.testing.assert_close(got, want[:, 0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(dec_pool[slots], final, atol=2e-6, rtol=1e-5)


def test_references_compose_the_transformers_layer() -> None:
    """Qwen3.5's GatedDeltaNet layer (no cache) equals in_proj -> our conv -> gating -> delta rule -> gated norm ->
    out_proj, each request of a flattened step against the layer run on it alone."""
    hf = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        hidden_size=64, linear_num_value_heads=HV, linear_num_key_heads=HK, linear_key_head_dim=K,
        linear_value_head_dim=V, linear_conv_kernel_dim=4, num_hidden_layers=1, layer_types=["linear_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=32, moe_intermediate_size=16,
        num_experts=2, num_experts_per_tok=1, vocab_size=32,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = hf.Qwen3_5MoeGatedDeltaNet(config, 0).eval()
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
    lens = [5, 70]
    x = torch.randn(sum(lens), 64, generator=gen(8))
    qsl = step(lens)
    with torch.no_grad():
        mixed = layer.in_proj_qkv(x)
        conv_pool = torch.zeros(2, 3, mixed.shape[1])
        slots, fresh = torch.tensor([0, 1]), torch.zeros(2, dtype=torch.bool)
        mixed = causal_conv1d_prefill_ref(mixed, layer.conv1d.weight[:, 0], conv_pool, qsl, slots, fresh)
        q, k, v = torch.split(mixed, [HK * K, HK * K, HV * V], dim=-1)
        g, beta = gdn_gating_ref(layer.in_proj_a(x), layer.in_proj_b(x), layer.A_log, layer.dt_bias)
        state_pool = torch.zeros(2, HV, K, V)
        o = gated_delta_prefill_ref(q.reshape(-1, HK, K), k.reshape(-1, HK, K), v.reshape(-1, HV, V), g, beta,
                                    state_pool, qsl, slots, fresh)  # fmt: skip
        z = layer.in_proj_z(x).reshape(-1, V)
        y = layer.out_proj(
            gated_rms_norm_ref(o.reshape(-1, V), z, layer.norm.weight, 1e-6).reshape(-1, HV * V)
        )
        for r in range(2):
            want = layer(x[None, qsl[r] : qsl[r + 1]])[0]
            torch.testing.assert_close(y[qsl[r] : qsl[r + 1]], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gating_and_gated_norm_kernels(dtype: torch.dtype) -> None:
    hf = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    a = torch.randn(37, 2 * HV, generator=gen(1)).to(dtype)[:, :HV] * 4  # strided; softplus's both branches
    a[0, 0] = 30.0
    b = torch.randn(37, HV, generator=gen(2)).to(dtype)
    a_log, dt_bias = torch.linspace(-2.0, 2.0, HV), torch.randn(HV, generator=gen(3)).to(dtype)
    g, beta = gdn_gating(a, b, a_log, dt_bias)
    g_ref, beta_ref = gdn_gating_ref(a, b, a_log, dt_bias)
    # the layer's own lines
    torch.testing.assert_close(g_ref, -a_log.float().exp() * F.softplus(a.float() + dt_bias), atol=0, rtol=0)
    assert torch.equal(beta_ref, b.sigmoid()) and g.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        beta.float(), beta_ref.float(), atol=4e-3 if dtype != torch.float32 else 1e-6, rtol=0
    )

    norm = hf.Qwen3_5MoeRMSNormGated(V, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(V, generator=gen(4)) + 0.5)
    x = torch.randn(37, HV, V, generator=gen(5)).to(dtype)
    z = torch.randn(37, HV, V, generator=gen(6)).to(dtype)
    want = norm(x.reshape(-1, V), z.reshape(-1, V)).detach()
    torch.testing.assert_close(
        gated_rms_norm_ref(x, z, norm.weight, 1e-6).reshape(-1, V), want, atol=0, rtol=0
    )
    got = gated_rms_norm(x, z, norm.weight.detach(), 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.reshape(-1, V).float(), want.float(), atol=tol, rtol=tol)
    # the gate as the layer hands it: [T, Hv, V] columns of a wider projection (no flat [T*Hv, V] view of it
    # exists), read by its strides; and flat rows [T*Hv, V]: the same bits
    wide = torch.zeros(37, 8 + HV * V, dtype=dtype)
    wide[:, 8:] = z.reshape(37, -1)
    z_view = wide[:, 8:].view(37, HV, V)
    assert torch.equal(gated_rms_norm(x, z_view, norm.weight.detach(), 1e-6), got)
    flat = gated_rms_norm(x.reshape(-1, V), z.reshape(-1, V), norm.weight.detach(), 1e-6)
    assert torch.equal(flat.view_as(got), got)


@pytest.mark.parametrize(
    ("dtype", "state_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_prefill_and_decode_kernels_equal_references(dtype: torch.dtype, state_dtype: torch.dtype) -> None:
    total = sum(LENS)
    q, k, v = qkv_views(total, dtype, seed=11)
    g, beta = gates(total, dtype, seed=12)
    states = pool(state_dtype)
    got_pool, want_pool = states.clone(), states.clone()
    args = (step(LENS), torch.tensor(SLOT_IDS, dtype=torch.int32), torch.tensor(HAS_STATE))
    got = gated_delta_prefill(q, k, v, g, beta, got_pool, *args)
    want = gated_delta_prefill_ref(q, k, v, g, beta, want_pool, *args)
    exact = dtype == torch.float32
    rows = real_rows(LENS, SLOT_IDS)
    assert got.dtype == dtype and got.shape == (total, HV, V) and got_pool.dtype == state_dtype
    assert_near(got[rows], want[rows], exact)
    assert_near(got_pool, want_pool, exact)
    unused = [s for s in range(SLOTS) if s not in SLOT_IDS]
    assert torch.equal(got_pool[unused], states[unused])

    dq, dk, dv = qkv_views(5, dtype, seed=13)
    dg, dbeta = gates(5, dtype, seed=14)
    slots = torch.tensor([7, -1, 0, 5, 3], dtype=torch.int32)
    got = gated_delta_decode(dq, dk, dv, dg, dbeta, got_pool, slots)
    want = gated_delta_decode_ref(dq, dk, dv, dg, dbeta, want_pool, slots)
    assert_near(got[slots >= 0], want[slots >= 0], exact)
    assert_near(got_pool, want_pool, exact)
    assert torch.equal(got_pool[[2, 4, 6]], states[[2, 4, 6]])


@pytest.mark.parametrize(
    ("dtype", "state_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]
)
def test_decode_with_gating_inside_equals_gating_then_decode(
    dtype: torch.dtype, state_dtype: torch.dtype
) -> None:
    """gated_delta_decode_gating (the gating in the decode kernel) on the layer's a and b, strided views of one
    z|b|a projection as the model splits it, with a large a (softplus past its threshold 20) and a padding slot:
    the same bits, output and states, as gdn_gating's launch then gated_delta_decode, and the reference's values."""
    batch = 5
    dq, dk, dv = qkv_views(batch, dtype, seed=21)
    zba = torch.randn(batch, HV * V + 2 * HV, generator=gen(22)).to(dtype) * 4
    zba[2, -1] = 30.0  # a of one head past softplus's threshold
    b, a = zba[:, HV * V : HV * V + HV], zba[:, HV * V + HV :]
    a_log, dt_bias = torch.linspace(-3.0, -1.0, HV), torch.linspace(-1.0, 1.0, HV)
    states = pool(state_dtype)
    slots = torch.tensor([7, -1, 0, 5, 3], dtype=torch.int32)
    fused_pool, apart_pool, want_pool = states.clone(), states.clone(), states.clone()
    got = gated_delta_decode_gating(dq, dk, dv, a, b, a_log, dt_bias, fused_pool, slots)
    apart = gated_delta_decode(dq, dk, dv, *gdn_gating(a, b, a_log, dt_bias), apart_pool, slots)
    want = gated_delta_decode_gating_ref(dq, dk, dv, a, b, a_log, dt_bias, want_pool, slots)
    live = slots >= 0
    assert torch.equal(got[live], apart[live]) and torch.equal(fused_pool, apart_pool)
    assert_near(got[live], want[live], dtype == torch.float32)
    assert_near(fused_pool, want_pool, dtype == torch.float32)
    assert torch.equal(fused_pool[[2, 4, 6]], states[[2, 4, 6]])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qwen35_head_dims_equal_references_inside_their_arguments(state_dtype: torch.dtype) -> None:
    """At Qwen3.5's head dims (K = V = 128: the state kernel's 128 x 32 blocks, as on the GPU) with two key / four
    value heads, bf16 inputs: the chunked prefill of a 200-token prompt and a continued one, then a decode step,
    equal the references, and every load and store stays inside the launch's arguments (memcheck). An H100 made an
    illegal memory access here with float32 states (RESULTS.md, forty-sixth session): not in these masks."""
    from longserve.testing.memcheck import bounds_checked

    hk, hv, kd, vd = 2, 4, 128, 128
    lens, slots, has = [200, 70], torch.tensor([0, 3], dtype=torch.int32), torch.tensor([False, True])
    total = sum(lens)
    g = gen(21)
    x = torch.randn(total, (2 * hk + hv) * kd, generator=g).to(torch.bfloat16)
    q, k, v = (t.view(total, -1, kd) for t in x.split([hk * kd, hk * kd, hv * vd], dim=-1))  # strided views
    a, b = (torch.randn(total, hv, generator=g).to(torch.bfloat16) for _ in range(2))
    gate, beta = gdn_gating_ref(a, b, torch.randn(hv, generator=g), torch.randn(hv, generator=g))
    states = (torch.randn(4, hv, kd, vd, generator=g) * 0.1).to(state_dtype)
    got_pool, want_pool = states.clone(), states.clone()
    with bounds_checked():
        got = gated_delta_prefill(q, k, v, gate, beta, got_pool, step(lens), slots, has)
        got_dec = gated_delta_decode(q[:2], k[:2], v[:2], gate[:2], beta[:2], got_pool, slots)
    want = gated_delta_prefill_ref(q, k, v, gate, beta, want_pool, step(lens), slots, has)
    want_dec = gated_delta_decode_ref(q[:2], k[:2], v[:2], gate[:2], beta[:2], want_pool, slots)
    for got_t, want_t in ((got, want), (got_pool, want_pool), (got_dec, want_dec)):
        assert_near(got_t, want_t, exact=False)
    assert torch.equal(got_pool[[1, 2]], states[[1, 2]])


def test_split_prompts_and_decodes_equal_one_prefill() -> None:
    """Two prompts (70 and 130 tokens) in one prefill equal: two calls ([40, 64] then [30, 66] tokens, the second
    continuing from the slots), and a prefill of [66, 127] tokens then decode steps (4 and 3 of them)."""
    lens = [70, 130]
    slots = torch.tensor([6, 2], dtype=torch.int32)
    q, k, v = qkv_views(sum(lens), torch.float32, seed=21)
    g, beta = gates(sum(lens), torch.float32, seed=22)
    states = pool(torch.float32, seed=23)
    one = states.clone()
    want = gated_delta_prefill(q, k, v, g, beta, one, step(lens), slots, torch.tensor([True, False]))
    per_req = [torch.split(x, lens) for x in (q, k, v, g, beta)]

    def tokens(cuts: list[tuple[int, int]]) -> list[torch.Tensor]:
        return [torch.cat([x[r][c0:c1] for r, (c0, c1) in enumerate(cuts)]) for x in per_req]

    two = states.clone()
    cuts = [[(0, 40), (0, 64)], [(40, 70), (64, 130)]]
    first = gated_delta_prefill(*tokens(cuts[0]), two, step([40, 64]), slots, torch.tensor([True, False]))
    second = gated_delta_prefill(*tokens(cuts[1]), two, step([30, 66]), slots, torch.tensor([True, True]))
    got = torch.cat([first[:40], second[:30], first[40:], second[30:]])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(two, one, atol=2e-5, rtol=2e-5)

    dec = states.clone()
    head = gated_delta_prefill(
        *tokens([(0, 66), (0, 127)]), dec, step([66, 127]), slots, torch.tensor([True, False])
    )
    outs = [[head[:66]], [head[66:]]]
    for i in range(4):
        live = [r for r, n in enumerate([66, 127]) if n + i < lens[r]]  # request 1 ends after 3 decodes
        rows = [x[r][[66, 127][r] + i] for x in per_req for r in live]
        dq, dk, dv, dg, dbeta = (torch.stack(rows[j * len(live) : (j + 1) * len(live)]) for j in range(5))
        y = gated_delta_decode(dq, dk, dv, dg, dbeta, dec, slots[live])
        for j, r in enumerate(live):
            outs[r].append(y[j : j + 1])
    torch.testing.assert_close(torch.cat([torch.cat(o) for o in outs]), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(dec, one, atol=2e-5, rtol=2e-5)


def test_kernels_without_qk_l2norm_and_with_a_scale() -> None:
    """use_qk_l2norm=False (q, k taken as they come) and an explicit scale, prefill and decode; a request of no
    tokens (its slot zeroed: no has_state)."""
    lens = [5, 0, 70]
    slots = torch.tensor([4, 2, 1], dtype=torch.int32)
    q, k, v = qkv_views(sum(lens), torch.float32, seed=31)
    q, k = q * K**-0.5, k * K**-0.5  # |k|^2 beta < 2: a stable rule without the norm
    g, beta = gates(sum(lens), torch.float32, seed=32)
    states = pool(torch.float32, seed=33)
    got_pool, want_pool = states.clone(), states.clone()
    args = (step(lens), slots, torch.tensor([True, False, False]))
    got = gated_delta_prefill(q, k, v, g, beta, got_pool, *args, scale=0.3, use_qk_l2norm=False)
    want = gated_delta_prefill_ref(q, k, v, g, beta, want_pool, *args, scale=0.3, use_qk_l2norm=False)
    assert_near(got, want, exact=True)
    assert_near(got_pool, want_pool, exact=True)
    assert not got_pool[2].any()
    one = (q[:3], k[:3], v[:3], g[:3], beta[:3])  # a decode step of the three
    got = gated_delta_decode(*one, got_pool, slots, scale=0.3, use_qk_l2norm=False)
    want = gated_delta_decode_ref(*one, want_pool, slots, scale=0.3, use_qk_l2norm=False)
    assert_near(got, want, exact=True)
    assert_near(got_pool, want_pool, exact=True)


def test_int64_slots_as_the_engine_passes_them() -> None:
    """The engine's slots arrive int64 (the step's packed int64 tensors, the decode graphs' static buffer): every
    kernel reads them as it reads int32 ones (and CI's sm90 compile check builds those variants too)."""
    from longserve.kernels.causal_conv1d import causal_conv1d_decode, causal_conv1d_prefill

    lens, slot_ids, has = [3, 70], [5, -1], [True, False]
    total, width = sum(lens), 4
    q, k, v = qkv_views(total, torch.float32, seed=21)
    g, beta = gates(total, torch.float32, seed=22)
    x = torch.randn(total, 2 * HK * K + HV * V, generator=gen(23))
    weight = torch.randn(x.shape[1], width, generator=gen(24))
    outs = {}
    for dtype in (torch.int32, torch.int64):
        states, conv = pool(torch.float32), torch.randn(SLOTS, width - 1, x.shape[1], generator=gen(25))
        slots = torch.tensor(slot_ids, dtype=dtype)
        args = (step(lens), slots, torch.tensor(has))
        y = causal_conv1d_prefill(x, weight, conv, *args)
        o = gated_delta_prefill(q, k, v, g, beta, states, *args)
        yd = causal_conv1d_decode(x[:2], weight, conv, slots)
        od = gated_delta_decode(q[:2], k[:2], v[:2], g[:2], beta[:2], states, slots)
        outs[dtype] = (y, o, yd[:1], od[:1], states, conv)
    for a, b in zip(outs[torch.int32], outs[torch.int64]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_states_saved_inside_a_step_equal_the_prefix_run_alone(state_dtype: torch.dtype) -> None:
    """`saves`: a request's state before one of its chunks of this step goes to another pool row (a prefix-cache
    checkpoint), unrounded, as the reference saves it; it equals the state a call over only the tokens before that
    chunk leaves in the request's slot. Requests of 70, 200 and 130 tokens save after 64 (row 4), none and 128 (row
    6); the rows nobody names stay untouched."""
    lens, slot_ids, has = [70, 200, 130], [0, 2, 5], torch.tensor([True, False, True])
    slots = torch.tensor(slot_ids, dtype=torch.int32)
    q, k, v = qkv_views(sum(lens), torch.float32, seed=31)
    g, beta = gates(sum(lens), torch.float32, seed=32)
    states = pool(state_dtype, seed=33)
    saves = (torch.tensor([1, -1, 2], dtype=torch.int32), torch.tensor([4, 0, 6]))
    got_pool, want_pool = states.clone(), states.clone()
    got = gated_delta_prefill(q, k, v, g, beta, got_pool, step(lens), slots, has, saves=saves)
    want = gated_delta_prefill_ref(q, k, v, g, beta, want_pool, step(lens), slots, has, saves=saves)
    exact = state_dtype == torch.float32
    assert_near(got, want, exact=True)
    assert_near(got_pool, want_pool, exact)
    untouched = [r for r in range(SLOTS) if r not in (*slot_ids, 4, 6)]
    assert torch.equal(got_pool[untouched], states[untouched])
    # the saved states against the slots a call over only the first 64 / 128 tokens leaves
    heads = [(0, 64), (200, 0), (270, 128)]  # (first row, tokens) of each request
    rows = torch.cat([torch.arange(s, s + n) for s, n in heads])
    alone = states.clone()
    gated_delta_prefill(*(x[rows] for x in (q, k, v, g, beta)), alone, step([64, 0, 128]), slots, has)
    assert_near(got_pool[[4, 6]], alone[[0, 5]], exact)
    assert not torch.equal(got_pool[[4, 6]], got_pool[[0, 5]])  # (not the final states)
