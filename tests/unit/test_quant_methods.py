"""The weight-format seams: linear layers and MoE experts take the method their checkpoint's
quantization_config names ("unquantized" without one; unknown formats refused), every projection computes
through it, and `FusedMoE` (stacked experts, top-k routing, tensor-parallel slices) equals the reference
MoE computation; its unquantized method runs the Triton kernel where layers run kernels (interpreted here)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from longserve.attention import ForwardContext, KVCache, TorchAttentionBackend, build_metadata  # noqa: E402
from longserve.distributed import TPGroup, parallel_state  # noqa: E402
from longserve.kernels.moe_reference import fused_moe_ref, route_topk  # noqa: E402
from longserve.models import linear_method, load_model  # noqa: E402
from longserve.models import moe as moe_mod  # noqa: E402
from longserve.models.dummy_weights import init_dummy_weights  # noqa: E402
from longserve.models.layers import MergedLinear, RowParallelLinear  # noqa: E402
from longserve.models.linear_method import UnquantizedLinearMethod, get_linear_method  # noqa: E402
from longserve.models.moe import FusedMoE, UnquantizedMoEMethod, get_moe_method  # noqa: E402
from longserve.models.quantization import quantization_method  # noqa: E402

CPU = torch.device("cpu")
NUM_LAYERS = 2


def tiny_config(quant: dict | None = None):
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        architectures=["Qwen3ForCausalLM"],
    )  # fmt: skip
    if quant is not None:
        cfg.quantization_config = quant
    return cfg


def test_the_format_comes_from_quantization_config() -> None:
    assert quantization_method(tiny_config()) == "unquantized"
    assert isinstance(get_linear_method(tiny_config()), UnquantizedLinearMethod)
    assert isinstance(get_moe_method(tiny_config()), UnquantizedMoEMethod)
    assert quantization_method(tiny_config({"quant_method": "FP8", "activation_scheme": "dynamic"})) == "fp8"
    with pytest.raises(ValueError, match="quant_method"):
        quantization_method(tiny_config({"bits": 4}))


def test_an_unknown_format_is_refused_naming_the_supported_ones() -> None:
    cfg = tiny_config({"quant_method": "hqq", "bits": 4})
    with pytest.raises(
        ValueError, match=r"'hqq' is not supported; supported: awq, compressed-tensors, fp8, gptq"
    ):
        load_model("unused", cfg, torch.float32, CPU, load_format="dummy")


class RecordingMethod(UnquantizedLinearMethod):
    """Plain weights that count the products computed and the post-load hooks run through the method."""

    name = "recording"
    applied: list[int] = []
    processed: list[int] = []

    def apply(self, layer, x, bias):
        self.applied.append(id(layer))
        return super().apply(layer, x, bias)

    def process_weights_after_loading(self, layer) -> None:
        self.processed.append(id(layer))


def run_model(model) -> torch.Tensor:
    ids = torch.arange(5, 16)  # [11]
    pages = [1, 2]
    meta = build_metadata([0], [len(ids)], [pages], 8, "cpu")
    cache = KVCache(model.num_layers, 4, 8, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    with torch.inference_mode():
        return model(ids, torch.arange(len(ids)), ForwardContext(meta, cache, TorchAttentionBackend()))


def test_every_projection_computes_through_the_checkpoints_method(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(linear_method.LINEAR_METHODS, "recording", RecordingMethod)
    monkeypatch.setattr(RecordingMethod, "applied", [])
    monkeypatch.setattr(RecordingMethod, "processed", [])
    plain = load_model("unused", tiny_config(), torch.float32, CPU, load_format="dummy", seed=3)
    model = load_model(
        "unused", tiny_config({"quant_method": "Recording"}), torch.float32, CPU, load_format="dummy", seed=3
    )
    linears = [m for m in model.modules() if isinstance(m, (MergedLinear, RowParallelLinear))]
    assert len(linears) == 4 * NUM_LAYERS  # qkv, o, gate_up, down
    assert all(isinstance(m.quant_method, RecordingMethod) for m in linears)
    assert sorted(RecordingMethod.processed) == sorted(id(m) for m in linears)  # once each, after loading
    out = run_model(model)
    assert sorted(RecordingMethod.applied) == sorted(id(m) for m in linears)  # one product each per pass
    torch.testing.assert_close(out, run_model(plain), atol=0, rtol=0)  # same weights, same products


def per_token_loop(x, w13, w2, weights, ids) -> torch.Tensor:
    """For each token, the sum over its k experts of w * down(silu(gate x) * up x)."""
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]  # [I] each
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


def experts(num_experts=6, hidden=32, inter=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)  # [E, 2I, H]
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(dtype)  # [E, H, I]
    x = torch.randn(13, hidden, generator=g).to(dtype)  # [T, H]
    logits = torch.randn(13, num_experts, generator=g).to(dtype)  # [T, E]
    return w13, w2, x, logits


def loaded_moe(w13, w2, top_k=2, renormalize=True, round_weights=False) -> FusedMoE:
    moe = FusedMoE(
        w13.shape[0], top_k, w13.shape[2], w2.shape[2], renormalize, round_routing_weights=round_weights
    )
    moe.to(w13.dtype)
    moe.weight_loader(moe.w13, w13)
    moe.weight_loader(moe.w2, w2)
    return moe


@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_module_equals_per_token_loop(renormalize: bool) -> None:
    w13, w2, x, logits = experts(dtype=torch.float64)
    moe = loaded_moe(w13, w2, top_k=3, renormalize=renormalize)
    weights, ids = route_topk(logits, 3, renormalize)
    expected = per_token_loop(x, w13, w2, weights.double(), ids)
    torch.testing.assert_close(moe(x, logits), expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("round_weights", [True, False])
def test_routing_weights_round_like_the_model_asks(round_weights: bool) -> None:
    """bf16: Qwen-MoE multiplies by weights rounded to bf16, Mixtral by float32 ones (different results)."""
    w13, w2, x, logits = experts(dtype=torch.bfloat16, seed=1)
    weights, ids = route_topk(logits, 2, True)
    used = weights.to(torch.bfloat16) if round_weights else weights
    out = loaded_moe(w13, w2, round_weights=round_weights)(x, logits)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, fused_moe_ref(x, w13, w2, used, ids))
    other = weights if round_weights else weights.to(torch.bfloat16)
    assert not torch.equal(out, fused_moe_ref(x, w13, w2, other, ids))


def test_the_unquantized_method_runs_the_kernel_where_layers_run_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("triton")
    from longserve.kernels import fused_moe as kernel_mod

    calls = []
    real = kernel_mod.fused_moe
    monkeypatch.setattr(kernel_mod, "fused_moe", lambda *a, **k: calls.append(1) or real(*a, **k))
    w13, w2, x, logits = experts(seed=2)
    moe = loaded_moe(w13, w2)
    expected = moe(x, logits)  # CPU tensors: the reference
    assert calls == []
    monkeypatch.setattr(moe_mod, "use_triton", lambda t: True)  # as for CUDA tensors with triton
    torch.testing.assert_close(moe(x, logits), expected, atol=1e-5, rtol=1e-5)
    assert calls == [1]


def fake_tp(monkeypatch: pytest.MonkeyPatch, tp: int, rank: int) -> None:
    group = None if tp == 1 else TPGroup(rank, tp, rank, device_group=None, cpu_group=None)
    monkeypatch.setattr(parallel_state, "_TP", group)


def test_tp_ranks_hold_intermediate_slices_that_sum_to_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    w13, w2, x, logits = experts(inter=24, seed=4)
    whole = loaded_moe(w13, w2)(x, logits)
    parts = []
    for rank in range(2):
        fake_tp(monkeypatch, 2, rank)
        moe = loaded_moe(w13, w2)
        assert moe.w13.shape == (6, 24, 32) and moe.w2.shape == (6, 32, 12)
        gate, up = w13[:, rank * 12 : (rank + 1) * 12], w13[:, 24 + rank * 12 : 24 + (rank + 1) * 12]
        assert torch.equal(moe.w13, torch.cat([gate, up], dim=1))  # gate slice, then the same up slice
        assert torch.equal(moe.w2, w2[:, :, rank * 12 : (rank + 1) * 12])
        parts.append(moe.partial(x, logits))
    fake_tp(monkeypatch, 1, 0)
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="shape mismatch"):
        loaded_moe(w13, w2).weight_loader(loaded_moe(w13, w2).w2, w2[:, :, :12])


def test_dummy_experts_do_not_depend_on_tp(monkeypatch: pytest.MonkeyPatch) -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = FusedMoE(4, 2, 16, 8, renormalize=True)

    full = Block()
    init_dummy_weights(full, std=0.1, seed=5)
    for rank in range(2):
        fake_tp(monkeypatch, 2, rank)
        part = Block()
        init_dummy_weights(part, std=0.1, seed=5)
        lo, hi = rank * 4, (rank + 1) * 4
        w13 = full.experts.w13
        assert torch.equal(part.experts.w13, torch.cat([w13[:, lo:hi], w13[:, 8 + lo : 8 + hi]], dim=1))
        assert torch.equal(part.experts.w2, full.experts.w2[:, :, lo:hi])
    fake_tp(monkeypatch, 1, 0)
