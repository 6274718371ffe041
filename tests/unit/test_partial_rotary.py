"""Partial rotary (Qwen3.5, Qwen3-Next: `partial_rotary_factor`, only each head's first R dims rotate) and Qwen3.5's
text mrope: the torch path against transformers' own rotary class and `apply_rotary_pos_emb`, the Triton kernel
(interpreted on the CPU) against the torch reference, alone and with the fused K/V store, q/k norm (Llama's and the
zero-centered one) and q_dst, and the rotary step of a layer on both paths."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import types  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from longserve.kernels.norm_reference import rms_norm_ref  # noqa: E402
from longserve.kernels.rope_reference import apply_rotary, rotary_embedding_ref  # noqa: E402
from longserve.models.rope import RotaryEmbedding, rope_parameters_from_config, rotary_dim  # noqa: E402

# head_dim 48 at a quarter: R = 12 rotate (half 6, not a power of two) and 36 pass through (block 64)
HEAD_DIM, FACTOR, ROT = 48, 0.25, 12
MROPE = {"mrope_interleaved": True, "mrope_section": [2, 2, 2]}  # R / 2 = 6 frequencies: t, h, w interleaved


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def hf_text_config(**rope: object):
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": FACTOR, **rope}
    return Qwen3_5MoeTextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
        max_position_embeddings=64, rope_parameters=rope_parameters,
    )  # fmt: skip


def make_rope() -> RotaryEmbedding:
    return RotaryEmbedding(
        HEAD_DIM, {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": FACTOR}, 64
    )


def test_rope_parameters_take_the_partial_factor_and_text_mrope() -> None:
    pytest.importorskip("transformers")
    params = rope_parameters_from_config(hf_text_config(**MROPE))
    assert params == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": FACTOR}
    assert rotary_dim(HEAD_DIM, params) == ROT and rotary_dim(HEAD_DIM, {}) == HEAD_DIM
    old = types.SimpleNamespace(
        rope_theta=1e6, rope_scaling=None, partial_rotary_factor=0.5, max_position_embeddings=8
    )
    # a top-level factor (older configs)
    assert rope_parameters_from_config(old)["partial_rotary_factor"] == 0.5
    assert RotaryEmbedding.from_config(old, 64).cos_sin_cache().shape == (8, 32)  # [P, R]
    with pytest.raises(ValueError, match="must be even"):
        rotary_dim(HEAD_DIM, {"partial_rotary_factor": 0.3125})  # 15 dims: no two halves
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rope_parameters_from_config(types.SimpleNamespace(rope_parameters={"partial_rotary_factor": 1.5}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_equals_transformers(dtype) -> None:
    """Qwen3_5MoeTextRotaryEmbedding (mrope, text positions: t = h = w) and apply_rotary_pos_emb against
    RotaryEmbedding and apply_rotary: cos/sin [T, R] and the rotated q/k, first R dims rotated, the rest as they
    were. With unequal h/w positions HF's class gives other cos/sin: the mrope sections are live, the equality is
    not vacuous."""
    pytest.importorskip("transformers")
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeTextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    cfg = hf_text_config(**MROPE)
    hf_rope, rope = Qwen3_5MoeTextRotaryEmbedding(cfg), RotaryEmbedding.from_config(cfg, HEAD_DIM)
    assert rope.rotary_dim == ROT
    positions = torch.tensor([0, 1, 5, 17, 40, 63])  # [T]
    x = randn(1, 1, 6, HEAD_DIM).to(dtype)  # dtype carrier only
    hf_cos, hf_sin = hf_rope(x, positions[None])  # [1, T, R]; text: the three position ids equal
    cos, sin = rope(positions, dtype)  # [T, R]
    assert cos.shape == (6, ROT) and cos.dtype == dtype
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
    q, k = randn(6, 4, HEAD_DIM, seed=1).to(dtype), randn(6, 2, HEAD_DIM, seed=2).to(dtype)  # [T, H, D]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    ours_q, ours_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    tol = {} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(ours_q, hf_q[0].transpose(0, 1), **tol)
    torch.testing.assert_close(ours_k, hf_k[0].transpose(0, 1), **tol)
    assert torch.equal(ours_q[..., ROT:], q[..., ROT:]) and not torch.equal(
        ours_q[1:, :, :ROT], q[1:, :, :ROT]
    )
    # the cached cos|sin rows of the fused path rotate the same
    torch.testing.assert_close(
        rotary_embedding_ref(positions, q.clone(), k.clone(), rope.cos_sin_cache())[0], ours_q, **tol
    )
    mixed = torch.stack((positions, positions + 3, positions * 2))[:, None]  # [3, 1, T]: an image's t, h, w
    assert not torch.equal(hf_rope(x, mixed)[0], hf_cos)


def qkv_views(num_tokens: int, num_q: int, num_kv: int, dtype: torch.dtype, seed: int, scale: float = 1.0):
    """q [T, Hq, D], k and v [T, Hkv, D] as views of one fused qkv output, as Attention hands them over."""
    qkv = (scale * randn(num_tokens, (num_q + 2 * num_kv) * HEAD_DIM, seed=seed)).to(dtype)
    sizes = [num_q * HEAD_DIM, num_kv * HEAD_DIM, num_kv * HEAD_DIM]
    return tuple(x.view(num_tokens, -1, HEAD_DIM) for x in qkv.split(sizes, dim=-1))


@pytest.mark.parametrize(
    ("norm", "store", "dtype"),
    [(None, None, torch.float32), (None, "kv", torch.bfloat16), ("llama", "kv", torch.float16),
     ("zero-centered", None, torch.float16), ("zero-centered", "kv", torch.float32),
     ("zero-centered", "fp8", torch.bfloat16)],
)  # fmt: skip
def test_partial_rotary_kernel_equals_the_reference(norm, store, dtype) -> None:
    """The kernel over R = D / 4: equal to the reference (the norm of kernels/norm.py first, KVCache.store after),
    the pass-through dims normed in place where the heads are normed and untouched where not, and stored whole
    (rotated part, passed part, the values' D dims) into their slots, other slots untouched. In float16 the passed
    dims equal the norm's bit for bit: the norm rounds where HF's does (Llama's: before the weight; zero-centered:
    after it), which bfloat16 cannot show under the interpreter (its cast to bfloat16 rounds its own way)."""
    pytest.importorskip("triton")
    from longserve.attention.base import KVCache
    from longserve.kernels.rope import rotary_embedding

    num_q, num_kv, num_tokens = 4, 2, 5
    cache = make_rope().cos_sin_cache()  # [64, R]
    positions = torch.tensor([3, 0, 63, 17, 8])
    q, k, v = qkv_views(num_tokens, num_q, num_kv, dtype, seed=3, scale=3.0)
    zero_centered = norm == "zero-centered"
    weights = None
    if norm is not None:  # offsets around 0 for the zero-centered norm, scales around 1 for Llama's
        qw, kw = ((float(not zero_centered) + 0.5 * randn(HEAD_DIM, seed=s)).to(dtype) for s in (4, 5))
        weights = (qw, kw, 1e-6, zero_centered)
    q_ref, k_ref = q.clone(), k.clone()
    if weights is not None:
        q_ref, k_ref = rms_norm_ref(q, qw, 1e-6, zero_centered), rms_norm_ref(k, kw, 1e-6, zero_centered)
    rotary_embedding_ref(positions, q_ref, k_ref, cache)
    slots = torch.tensor([13, 2, 7, 30, 21])
    kv_dtype = torch.float8_e4m3fn if store == "fp8" else dtype
    fused, ref = (KVCache(1, 9, 4, num_kv, HEAD_DIM, kv_dtype, "cpu") for _ in range(2))
    for c in (fused, ref):
        c.k[0].copy_(randn(*c.k[0].shape, seed=6).to(kv_dtype))
        c.v[0].copy_(randn(*c.v[0].shape, seed=7).to(kv_dtype))
    k_slots, v_slots = fused.slots(0)
    v_before = v.clone()
    rotary_embedding(
        positions, q, k, cache, store=(v, slots, k_slots, v_slots) if store else None, qk_norm=weights
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # 16-bit: the rotation rounds once, HF's per operation
    torch.testing.assert_close(q, q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k, k_ref, atol=tol, rtol=tol)
    if weights is None or dtype == torch.float16:  # the passed dims as they were, or as the norm made them
        assert torch.equal(q[..., ROT:], q_ref[..., ROT:]) and torch.equal(k[..., ROT:], k_ref[..., ROT:])
    assert torch.equal(v, v_before)
    if store:
        ref.store(0, slots, k, v)  # what the launch rotated, stored (quantized) the reference's way
        as_bytes = (lambda t: t.view(torch.uint8)) if store == "fp8" else (lambda t: t)
        assert torch.equal(as_bytes(fused.k[0]), as_bytes(ref.k[0]))
        assert torch.equal(as_bytes(fused.v[0]), as_bytes(ref.v[0]))


@pytest.mark.parametrize("zero_centered", [False, True], ids=["llama-norm", "zero-centered-norm"])
def test_partial_rotary_kernel_writes_q_into_packed_rows(zero_centered) -> None:
    """q_dst with partial rotary: every D dims of each q head (rotated and passed) land in the packed rows, bit for
    bit what the launch wrote in place."""
    pytest.importorskip("triton")
    from longserve.attention.base import KVCache
    from longserve.kernels.rope import rotary_embedding

    num_kv, group, num_tokens, rows_per_head = 2, 2, 3, 8
    cache = make_rope().cos_sin_cache()
    positions = torch.tensor([1, 9, 33])
    q, k, v = qkv_views(num_tokens, num_kv * group, num_kv, torch.float32, seed=8)
    weights = (0.5 * randn(HEAD_DIM, seed=9), 0.5 * randn(HEAD_DIM, seed=10), 1e-6, zero_centered)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding(positions, q_ref, k_ref, cache, qk_norm=weights)
    rows = torch.full((num_kv, rows_per_head * group, HEAD_DIM), 7.0)
    q_dst = rows.view(num_kv, rows_per_head, group, HEAD_DIM)[:, :num_tokens].permute(
        1, 0, 2, 3
    )  # [T, Hkv, G, D]
    fused = KVCache(1, 4, 4, num_kv, HEAD_DIM, torch.float32, "cpu")
    k_slots, v_slots = fused.slots(0)
    slots = torch.tensor([5, 0, 9])
    rotary_embedding(positions, q, k, cache, store=(v, slots, k_slots, v_slots), qk_norm=weights, q_dst=q_dst)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(k_slots[slots], k) and torch.equal(v_slots[slots], v)
    packed = rows.view(num_kv, rows_per_head, group * HEAD_DIM)
    assert torch.equal(
        packed[:, :num_tokens], q.reshape(num_tokens, num_kv, group * HEAD_DIM).transpose(0, 1)
    )
    assert torch.all(packed[:, num_tokens:] == 7.0)


def test_rotary_step_with_zero_centered_qk_norms_on_both_paths() -> None:
    """RotaryStep.apply_and_store with zero-centered q/k norm modules (layers.RMSNorm, as Qwen3.5's attention
    builds them): the torch path (the modules, then the rotation) and the fused launch (the flag carried into the
    kernel) agree, and the fused path stored the keys and values."""
    pytest.importorskip("triton")
    from longserve.attention.base import KVCache
    from longserve.models.layers import RMSNorm
    from longserve.models.rope import RotaryStep

    rope = make_rope()
    norms = tuple(RMSNorm(HEAD_DIM, 1e-6, zero_centered=True) for _ in range(2))
    for i, n in enumerate(norms):
        n.weight.data.copy_(0.5 * randn(HEAD_DIM, seed=11 + i))
    positions = torch.tensor([4, 12, 50])
    q, k, v = qkv_views(3, 4, 2, torch.float32, seed=13, scale=2.0)
    slots = torch.tensor([2, 6, 3])
    torch_step = RotaryStep(positions, *rope(positions, torch.float32))
    fused_step = RotaryStep(positions, cos_sin_cache=rope.cos_sin_cache())
    kv = KVCache(1, 2, 4, 2, HEAD_DIM, torch.float32, "cpu")
    ref = torch_step.apply_and_store(q.clone(), k.clone(), v, kv, 0, slots, norms)
    got = fused_step.apply_and_store(q, k, v, kv, 0, slots, norms)
    assert not ref.kv_stored and got.kv_stored
    torch.testing.assert_close(got.q, ref.q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.k, ref.k, atol=1e-5, rtol=1e-5)
    k_slots, v_slots = kv.slots(0)
    assert torch.equal(k_slots[slots], got.k) and torch.equal(v_slots[slots], v)
