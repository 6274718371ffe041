"""Fused Triton ops (norm, residual-add norm, SiLU-and-mul, RoPE) under TRITON_INTERPRET=1 on the CPU vs.
their torch references, plus a tiny model run with every fused path forced on vs. the reference path."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from longserve.kernels.activation import (  # noqa: E402
    sigmoid_gated_add,
    sigmoid_gated_add_ref,
    sigmoid_mul,
    sigmoid_mul_ref,
    silu_and_mul,
    silu_and_mul_ref,
)
from longserve.kernels.norm import (  # noqa: E402
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from longserve.kernels.rope import rotary_embedding, rotary_embedding_ref  # noqa: E402
from longserve.kernels.rope_reference import apply_rotary  # noqa: E402
from longserve.models.rope import RotaryEmbedding  # noqa: E402

ATOL = 1e-5
TOKENS = [1, 7]
HIDDEN = [16, 48]  # 48: not a power of two
HEAD_DIMS = [16, 32]


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_rms_norm(num_tokens: int, hidden: int) -> None:
    x, w = randn(num_tokens, hidden, seed=1), randn(hidden, seed=2)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_fused_add_rms_norm(num_tokens: int, hidden: int) -> None:
    x, res, w = randn(num_tokens, hidden, seed=1), randn(num_tokens, hidden, seed=3), randn(hidden, seed=2)
    x_before, res_before = x.clone(), res.clone()
    y, new_res = fused_add_rms_norm(x, res, w, 1e-5)
    y_ref, new_res_ref = fused_add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(new_res, x_before + res_before)  # the residual stream is exact
    assert torch.equal(new_res_ref, x_before + res_before)
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(y, rms_norm_ref(x + res, w, 1e-5), atol=ATOL, rtol=ATOL)
    assert torch.equal(x, x_before) and torch.equal(res, res_before)  # out of place


def test_rms_norm_strided_3d_rows() -> None:
    """Per-head q norm (Qwen3) on a view of the fused qkv output: [T, H, D] with a token stride > H*D."""
    qkv = randn(7, 4 * 16 + 2 * 2 * 16, seed=6)
    q = qkv[:, : 4 * 16].view(7, 4, 16)  # [T, 4, 16], non-contiguous
    w = randn(16, seed=7)
    torch.testing.assert_close(rms_norm(q, w, 1e-6), rms_norm_ref(q, w, 1e-6), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("inter", HIDDEN)
def test_silu_and_mul(num_tokens: int, inter: int) -> None:
    x = randn(num_tokens, 2 * inter, seed=8) * 3
    out = silu_and_mul(x)  # [T, I]
    assert out.shape == (num_tokens, inter)
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=ATOL, rtol=ATOL)
    gate, up = x[:, :inter], x[:, inter:]  # gate first, as gate_up_proj stacks them
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sigmoid_gated_add(dtype: torch.dtype) -> None:
    """out += sigmoid(gate) * shared in place: the gate a strided column (the stacked MoE inputs' last), hidden
    1,100 (two blocks, the second ragged), against torch's three ops: float32 to rounding, bf16 within a rounding
    of each op (the interpreter rounds toward zero where torch rounds to nearest)."""
    num_tokens, hidden = 3, 1100
    out = (randn(num_tokens, hidden, seed=30) * 2).to(dtype)
    gate = (randn(num_tokens, 9, seed=31) * 4).to(dtype)[:, -1:]  # [T, 1], row stride 9
    shared = randn(num_tokens, hidden, seed=32).to(dtype)
    want = sigmoid_gated_add_ref(out, gate, shared)
    got = sigmoid_gated_add(out, gate, shared)
    assert got.data_ptr() == out.data_ptr()  # in place
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    else:
        # each of the three roundings off by at most one bf16 step (2^-7 relative) of its own value
        bound = (want.float().abs() + 2 * shared.float().abs()) * 2**-7 + 1e-6
        assert ((got.float() - want.float()).abs() <= bound).all()
    assert sigmoid_gated_add(out[:0], gate[:0], shared[:0]).shape == (0, hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sigmoid_mul(dtype: torch.dtype) -> None:
    """x *= sigmoid(gate) in place, the gate [T, H, D] the second half of each head's [q | gate] rows (as Qwen3.5's
    q_proj yields it; D = 48, H * D = 1,440 over two blocks) against torch: float32 to rounding, bf16 within a
    rounding of each op."""
    num_tokens, heads, head_dim = 3, 30, 48
    x = (randn(num_tokens, heads, head_dim, seed=33) * 2).to(dtype)
    gate = (randn(num_tokens, heads, 2 * head_dim, seed=34) * 4).to(dtype)[..., head_dim:]
    want = sigmoid_mul_ref(x, gate)
    got = sigmoid_mul(x, gate)
    assert got.data_ptr() == x.data_ptr()  # in place
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    else:
        bound = 2 * want.float().abs() * 2**-7 + 1e-6
        assert ((got.float() - want.float()).abs() <= bound).all()


@pytest.mark.parametrize(
    ("num_tokens", "inter", "group", "column_major", "dtype"),
    [(3, 256, 128, False, torch.float32), (5, 200, 64, True, torch.bfloat16), (2, 1152, 128, False, torch.bfloat16),
     (1, 128, 128, True, torch.float32), (4, 48, 16, False, torch.bfloat16)],
)  # fmt: skip
def test_silu_and_mul_quant_equals_the_two_kernels(num_tokens, inter, group, column_major, dtype) -> None:
    """The fused SiLU-and-mul + per-token-group e4m3 quantization: bit-equal to silu_and_mul then
    per_token_group_quant (ragged last groups, 9 groups over two programs, column-major scales as cuBLAS takes
    them), and in fp32 to the torch reference exactly; bf16 within the interpreter's bf16 rounding of it."""
    from longserve.kernels.activation import silu_and_mul_quant, silu_and_mul_quant_ref
    from longserve.kernels.quant_fp8 import per_token_group_quant

    x = (randn(num_tokens, 2 * inter, seed=9) * 3).to(dtype)
    q, s = silu_and_mul_quant(x, group, column_major_scales=column_major)
    q2, s2 = per_token_group_quant(silu_and_mul(x), group, column_major_scales=column_major)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (num_tokens, inter) and s.shape == s2.shape
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    assert s.stride() == s2.stride()
    q_ref, s_ref = silu_and_mul_quant_ref(x, group)
    if dtype == torch.float32:
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    else:  # the interpreter rounds fp32 -> bf16 its own way (kernels/activation.py, test_silu_and_mul)
        torch.testing.assert_close(s, s_ref, rtol=0.02, atol=0)


def make_rope(head_dim: int, max_pos: int = 64) -> RotaryEmbedding:
    params = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    return RotaryEmbedding(head_dim, params, max_pos)  # yarn: attention_scaling != 1 is covered too


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "3d"])
def test_rotary_embedding(num_tokens: int, head_dim: int, flat: bool) -> None:
    rope = make_rope(head_dim)
    cache = rope.cos_sin_cache()  # [64, D]
    positions = torch.randint(0, 64, (num_tokens,), generator=torch.Generator().manual_seed(9))
    num_q, num_kv = 4, 2
    # q, k as views of one fused qkv output, like Attention.forward hands them over
    qkv = randn(num_tokens, (num_q + 2 * num_kv) * head_dim, seed=10)
    q, k, v = qkv.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
    if not flat:
        q, k = q.view(num_tokens, num_q, head_dim), k.view(num_tokens, num_kv, head_dim)
    q_ref, k_ref = q.clone(), k.clone()
    v_before = v.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, cache)
    q_out, k_out = rotary_embedding(positions, q, k, cache)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(q, q_ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(k, k_ref, atol=ATOL, rtol=ATOL)
    assert torch.equal(v, v_before)

    # the cached reference agrees with the per-step cos/sin path the CPU layers use (HF's computation)
    cos, sin = rope(positions, torch.float32)  # [T, D]
    q0 = randn(num_tokens, num_q, head_dim, seed=11)
    torch.testing.assert_close(
        rotary_embedding_ref(positions, q0.clone(), q0.clone()[:, :1], cache)[0],
        apply_rotary(q0, cos, sin),
        atol=ATOL,
        rtol=ATOL,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_stores_keys_and_values(dtype) -> None:
    """The same launch writes the rotated keys and the values into their KV-cache slots: equal to the
    rotation followed by KVCache.store's index_copy; slots out of order, other slots untouched, q/k/v as
    views of one fused qkv output."""
    from longserve.attention.base import KVCache

    head_dim, num_q, num_kv, num_tokens, page_size = 32, 4, 2, 5, 4
    rope = make_rope(head_dim)
    cache = rope.cos_sin_cache()
    positions = torch.randint(0, 64, (num_tokens,), generator=torch.Generator().manual_seed(3))
    qkv = randn(num_tokens, (num_q + 2 * num_kv) * head_dim, seed=4).to(dtype)
    q, k, v = qkv.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
    q, k, v = (x.view(num_tokens, -1, head_dim) for x in (q, k, v))
    slots = torch.tensor([13, 2, 7, 30, 21])
    fused, ref = (KVCache(1, 9, page_size, num_kv, head_dim, dtype, "cpu") for _ in range(2))
    for c in (fused, ref):
        c.k[0].copy_(randn(*c.k[0].shape, seed=5).to(dtype))
        c.v[0].copy_(randn(*c.v[0].shape, seed=6).to(dtype))
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, cache)
    ref.store(0, slots, k_ref, v)
    k_slots, v_slots = fused.slots(0)
    rotary_embedding(positions, q, k, cache, store=(v, slots, k_slots, v_slots))
    tol = ATOL if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q, q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k, k_ref, atol=tol, rtol=tol)
    assert torch.equal(fused.k[0].view(-1, num_kv, head_dim)[slots], k)  # the cache holds the k returned
    torch.testing.assert_close(fused.k[0], ref.k[0], atol=tol, rtol=tol)
    assert torch.equal(fused.v[0], ref.v[0])  # values copied exactly, every other slot untouched


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 2.5)], ids=["unit-scales", "calibrated-scales"])
def test_rotary_embedding_stores_into_an_fp8_cache(scales) -> None:
    """An fp8 (e4m3) cache written by the rotary launch holds exactly what KVCache.store writes (the rotated
    bf16 keys and the values divided by the layer's scale, saturated at +-448, rounded to nearest even),
    with values past 448 and the pages' other slots untouched."""
    from longserve.attention.base import KVCache

    head_dim, num_q, num_kv, num_tokens, page_size = 32, 4, 2, 5, 4
    rope = make_rope(head_dim)
    cache = rope.cos_sin_cache()
    positions = torch.randint(0, 64, (num_tokens,), generator=torch.Generator().manual_seed(13))
    qkv = (40 * randn(num_tokens, (num_q + 2 * num_kv) * head_dim, seed=14)).bfloat16()
    q, k, v = (x.view(num_tokens, -1, head_dim) for x in qkv.split([num_q * head_dim, num_kv * head_dim,
                                                                    num_kv * head_dim], dim=-1))  # fmt: skip
    v[0, 0, 0], v[1, 1, 5], k[2, 0, 3], k[3, 1, 20] = 3000.0, -1500.0, 2000.0, -900.0  # past 448 * scale
    slots = torch.tensor([13, 2, 7, 30, 21])
    fused, ref = (KVCache(1, 9, page_size, num_kv, head_dim, torch.float8_e4m3fn, "cpu") for _ in range(2))
    for c in (fused, ref):
        c.set_scales([scales[0]], [scales[1]])
        c.k[0].copy_(randn(*c.k[0].shape, seed=15).to(torch.float8_e4m3fn))
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, cache)
    k_slots, v_slots = fused.slots(0)
    rotary_embedding(positions, q, k, cache, store=(v, slots, k_slots, v_slots, *scales))
    ref.store(0, slots, k, v)  # the keys the launch rotated, quantized the reference's way
    torch.testing.assert_close(k, k_ref, atol=0.5, rtol=2e-2)
    assert torch.equal(fused.k[0].view(torch.uint8), ref.k[0].view(torch.uint8))
    assert torch.equal(fused.v[0].view(torch.uint8), ref.v[0].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("store", [False, True], ids=["no-store", "store"])
def test_rotary_embedding_applies_the_qk_norms(dtype, store) -> None:
    """Qwen3's per-head q/k RMSNorm in the rotary launch: equal to the norm kernel's output rotated (and
    stored), with different q and k weights."""
    from longserve.attention.base import KVCache
    from longserve.kernels.norm import rms_norm

    head_dim, num_q, num_kv, num_tokens = 32, 4, 2, 6
    rope = make_rope(head_dim)
    cache = rope.cos_sin_cache()
    positions = torch.randint(0, 64, (num_tokens,), generator=torch.Generator().manual_seed(8))
    qkv = (3 * randn(num_tokens, (num_q + 2 * num_kv) * head_dim, seed=9)).to(dtype)
    sizes = [num_q * head_dim, num_kv * head_dim, num_kv * head_dim]
    q, k, v = (x.view(num_tokens, -1, head_dim) for x in qkv.split(sizes, dim=-1))
    qw = (1 + 0.5 * randn(head_dim, seed=21)).to(dtype)
    kw = (1 + 0.5 * randn(head_dim, seed=22)).to(dtype)
    q_ref, k_ref = rms_norm(q, qw, 1e-6), rms_norm(k, kw, 1e-6)  # the norm kernel, then the rotation
    rotary_embedding(positions, q_ref, k_ref, cache)
    q_unnormed = rotary_embedding(positions, q.clone(), k.clone(), cache)[0]
    assert not torch.allclose(q_unnormed.float(), q_ref.float(), atol=0.1)  # the norm matters here
    slots = torch.tensor([5, 0, 9, 3, 12, 7])
    fused = KVCache(1, 4, 4, num_kv, head_dim, dtype, "cpu")
    k_slots, v_slots = fused.slots(0)
    rotary_embedding(positions, q, k, cache, store=(v, slots, k_slots, v_slots) if store else None,
                     qk_norm=(qw, kw, 1e-6))  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the variance sums in another order
    torch.testing.assert_close(q, q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k, k_ref, atol=tol, rtol=tol)
    if store:
        assert torch.equal(k_slots[slots], k) and torch.equal(v_slots[slots], v)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "qk-norm"])
def test_rotary_embedding_also_writes_q_into_packed_rows(group: int, norm: bool) -> None:
    """q_dst: the rotated q lands in the packed prefix call's rows too ([kv head, token * G + g] of a rows buffer,
    attention/packed_graph.py), exactly what is written in place, past other rows untouched; k and the cache as
    without it."""
    from longserve.attention.base import KVCache

    head_dim, num_kv, num_tokens, rows_per_head = 32, 2, 5, 16
    num_q = num_kv * group
    rope = make_rope(head_dim)
    cache = rope.cos_sin_cache()
    positions = torch.randint(0, 64, (num_tokens,), generator=torch.Generator().manual_seed(4))
    qkv = randn(num_tokens, (num_q + 2 * num_kv) * head_dim, seed=5)
    sizes = [num_q * head_dim, num_kv * head_dim, num_kv * head_dim]
    q, k, v = (x.view(num_tokens, -1, head_dim) for x in qkv.split(sizes, dim=-1))
    q_ref, k_ref = q.clone(), k.clone()
    weights = (1 + 0.5 * randn(head_dim, seed=6), 1 + 0.5 * randn(head_dim, seed=7), 1e-6) if norm else None
    rotary_embedding(positions, q_ref, k_ref, cache, qk_norm=weights)
    rows = torch.full((num_kv, rows_per_head * group, head_dim), 7.0)  # the packed call's q rows
    by_head = rows.view(num_kv, rows_per_head, group, head_dim)
    q_dst = by_head[:, :num_tokens].permute(1, 0, 2, 3)  # [T, Hkv, G, D]
    slots = torch.tensor([5, 0, 9, 3, 12])
    fused = KVCache(1, 4, 4, num_kv, head_dim, torch.float32, "cpu")
    k_slots, v_slots = fused.slots(0)
    rotary_embedding(positions, q, k, cache, store=(v, slots, k_slots, v_slots), qk_norm=weights, q_dst=q_dst)
    torch.testing.assert_close(q, q_ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(k, k_ref, atol=ATOL, rtol=ATOL)
    assert torch.equal(k_slots[slots], k) and torch.equal(v_slots[slots], v)
    # row t * G + g of kv head j holds q head j * G + g of token t, bit for bit what went in place
    by_token = q.reshape(num_tokens, num_kv, group * head_dim).transpose(0, 1)  # [Hkv, T, G * D]
    packed = rows.view(num_kv, rows_per_head, group * head_dim)
    assert torch.equal(packed[:, :num_tokens], by_token)
    assert torch.all(packed[:, num_tokens:] == 7.0)  # the bucket's other rows untouched


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32-kv", "fp8-kv"])
def test_model_with_fused_ops_matches_reference_path(
    tmp_path, monkeypatch: pytest.MonkeyPatch, kv_dtype
) -> None:
    """Force every fused path on (CPU tensors through the interpreter) in a tiny Qwen3 (q/k norm) and
    compare its hidden states with the reference path's: wiring, residual flow and in-place RoPE; with an
    fp8 cache, the rotary launch's quantized store against KVCache.store's."""
    pytest.importorskip("transformers")
    from longserve.attention.base import ForwardContext, KVCache
    from longserve.attention.torch_backend import TorchAttentionBackend
    from longserve.models import layers as layers_mod
    from longserve.models import load_hf_config, load_model
    from longserve.models import rope as rope_mod
    from longserve.testing.checkpoints import make_tiny_checkpoint
    from tests.model.test_models_vs_hf import NUM_PAGES, PAGE_IDS, PAGE_SIZE, make_meta

    path = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", tie_word_embeddings=False, seed=7)
    model = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"))
    ids = randn(11, seed=12).abs().mul(100).long() % model.vocab_size  # [11]
    ids[0] = 0

    def run() -> torch.Tensor:
        meta, positions = make_meta([0], [len(ids)], [PAGE_IDS])
        cache = KVCache(
            model.num_layers, NUM_PAGES, PAGE_SIZE, model.num_kv_heads, model.head_dim, kv_dtype, "cpu"
        )
        ctx = ForwardContext(meta=meta, kv_cache=cache, backend=TorchAttentionBackend())
        with torch.no_grad():
            return model(ids, positions, ctx)  # [T, hidden]

    ref = run()
    monkeypatch.setattr(layers_mod, "use_triton", lambda x: True)
    monkeypatch.setattr(rope_mod, "use_triton", lambda x: True)
    fused = run()
    torch.testing.assert_close(fused, ref, atol=1e-4, rtol=1e-4)
