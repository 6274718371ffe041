"""Hybrid linear/full-attention models (Qwen3.5 dense and MoE, Qwen3-Next) vs transformers, float32, on tiny random checkpoints
written by transformers itself (the MoE one as the released vision-language wrapper): a full prefill, the same
prompt in chunks (the recurrent state carried in its slot, the full layers' K/V in pages), a mixed step of a decode
beside another request's chunk, greedy decode against transformers' generate, and the weights the loader maps."""

from __future__ import annotations

import pytest
import torch

from longserve.attention.base import ForwardContext, KVCache
from longserve.attention.recurrent_state import RecurrentStates
from longserve.attention.torch_backend import TorchAttentionBackend
from longserve.models import load_hf_config, load_model
from longserve.testing.checkpoints import HYBRID_ARCHS, QWEN3_NEXT, make_tiny_checkpoint
from tests.model.test_models_vs_hf import PAGE_SIZE, hf_logits, load_both, make_meta, prompt

NUM_SLOTS = 4
PAGE_IDS = (
    torch.randperm(48, generator=torch.Generator().manual_seed(0)).add(1).tolist()
)  # 192 tokens, shuffled


def new_cache(model: torch.nn.Module) -> KVCache:
    return KVCache(model.num_layers, 49, PAGE_SIZE, model.num_kv_heads, model.head_dim, torch.float32, "cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid")
    return {arch: make_tiny_checkpoint(root / arch, arch, seed=7) for arch in (*HYBRID_ARCHS, QWEN3_NEXT)}


def new_states(model: torch.nn.Module) -> RecurrentStates:
    num_layers, spec = model.recurrent_states()
    states = RecurrentStates(num_layers, spec, NUM_SLOTS, torch.float32, torch.float32, "cpu")
    for t in (*states.conv, *states.ssm):  # garbage a fresh request must not read
        t.normal_()
    return states


def step(model, cache, states, token_ids, prefix_lens, page_tables, slots) -> torch.Tensor:
    """One step over several requests' new tokens in their state slots; logits [T, V] of every new token."""
    meta, positions = make_meta(prefix_lens, [len(t) for t in token_ids], page_tables)
    meta.state_slots = torch.tensor(slots, dtype=torch.int64)
    ctx = ForwardContext(meta=meta, kv_cache=cache, backend=TorchAttentionBackend(), states=states)
    with torch.no_grad():
        return model.compute_logits(model(torch.cat(token_ids), positions, ctx))  # [T, V]


@pytest.mark.parametrize("arch", [*HYBRID_ARCHS, QWEN3_NEXT])
def test_prefill_chunks_and_mixed_step_match_hf(checkpoints: dict, arch: str) -> None:
    ours, hf = load_both(checkpoints[arch])
    assert ours.num_layers == 2  # two full-attention layers hold K/V; two linear ones hold states
    ids = prompt(ours.vocab_size, n=150)  # past two of the delta rule's 64-token chunks
    ref = hf_logits(hf, ids)  # [150, V]

    full = step(ours, new_cache(ours), new_states(ours), [ids], [0], [PAGE_IDS[:40]], [2])
    torch.testing.assert_close(full, ref, atol=1e-4, rtol=1e-4)

    # three chunks in slot 1, not on the delta rule's 64-token boundaries: its chunks then start elsewhere than
    # transformers' (from 0), a float32 rounding apart (~1e-4 of logits of ~10)
    cache, states = new_cache(ours), new_states(ours)
    bounds = ((0, 37), (37, 101), (101, 150))
    parts = [step(ours, cache, states, [ids[a:b]], [a], [PAGE_IDS[:40]], [1]) for a, b in bounds]
    torch.testing.assert_close(torch.cat(parts), ref, atol=5e-4, rtol=1e-4)

    # another request's decode (slot 1 continues) beside a fresh prompt in slot 3
    other = prompt(ours.vocab_size, n=21, seed=3)
    nxt = int(ref[-1].argmax())
    mixed = step(
        ours, cache, states, [torch.tensor([nxt]), other], [150, 0], [PAGE_IDS[:40], PAGE_IDS[40:]], [1, 3]
    )
    after = hf_logits(hf, torch.cat([ids, torch.tensor([nxt])]))[-1]  # [V]
    torch.testing.assert_close(mixed[0], after, atol=5e-4, rtol=1e-4)
    torch.testing.assert_close(mixed[1:], hf_logits(hf, other), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", [*HYBRID_ARCHS, QWEN3_NEXT])
def test_greedy_decode_matches_hf_generate(checkpoints: dict, arch: str) -> None:
    """32 tokens one step each (the one-token kernels' path) against transformers' generate with its cache."""
    ours, hf = load_both(checkpoints[arch])
    ids = prompt(ours.vocab_size, n=30, seed=5)
    with torch.no_grad():
        expected = hf.generate(ids[None], max_new_tokens=32, do_sample=False)[0, 30:].tolist()
    cache, states = new_cache(ours), new_states(ours)
    logits = step(ours, cache, states, [ids], [0], [PAGE_IDS], [0])
    out = [int(logits[-1].argmax())]
    while len(out) < 32:
        pos = 30 + len(out) - 1
        logits = step(ours, cache, states, [torch.tensor(out[-1:])], [pos], [PAGE_IDS], [0])
        out.append(int(logits[-1].argmax()))
    assert out == expected


def test_linear_attention_projections_run_as_one_gemm(checkpoints: dict, monkeypatch) -> None:
    """After loading, each linear-attention layer's in_proj_qkv and in_proj_zba weights are views of one stacked
    tensor (linear_method.stack_inputs) that `project` multiplies once: a prompt's and a decode's logits equal those of
    the two GEMMs apart (gated_delta_net.STACKED_PROJECTIONS off) and transformers'."""
    from longserve.models import gated_delta_net
    from longserve.models.gated_delta_net import GatedDeltaNet

    ours, hf = load_both(checkpoints["qwen3_5_moe"])
    mixers = [m for m in ours.modules() if isinstance(m, GatedDeltaNet)]
    assert mixers
    for m in mixers:
        storage = m.stacked_inputs.untyped_storage().data_ptr()
        assert m.in_proj_qkv.weight.untyped_storage().data_ptr() == storage
        assert m.in_proj_zba.weight.untyped_storage().data_ptr() == storage
        assert m.stacked_inputs.shape[0] == m.conv_dim + m.in_proj_zba.out_features
    ids = prompt(ours.vocab_size, n=70)
    runs = {}
    for stacked in (True, False):
        monkeypatch.setattr(gated_delta_net, "STACKED_PROJECTIONS", stacked)
        cache, states = new_cache(ours), new_states(ours)
        first = step(ours, cache, states, [ids[:-1]], [0], [PAGE_IDS[:40]], [2])
        runs[stacked] = (first, step(ours, cache, states, [ids[-1:]], [69], [PAGE_IDS[:40]], [2]))
    for a, b in zip(runs[True], runs[False]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(runs[True]), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_attention_output_gate_kernel_equals_torchs(checkpoints: dict, monkeypatch) -> None:
    """The attention layers with an output gate on their Triton kernels (interpreted, as on a GPU): the fused rotary
    kernel rotating and norming q in place where it lies in q_proj's output, [q | gate] a head (no copy), and
    sigmoid_mul reading the gate there, against torch's ops: a prompt's logits, every attention layer taking
    both."""
    pytest.importorskip("triton")
    from longserve.kernels import activation
    from longserve.kernels import rope as rope_kernels
    from longserve.models import decoder, rope

    ours, hf = load_both(checkpoints["qwen3_5"])
    ids = prompt(ours.vocab_size, n=40)
    want = step(ours, new_cache(ours), new_states(ours), [ids], [0], [PAGE_IDS[:40]], [2])
    calls, real = [], activation.sigmoid_mul
    monkeypatch.setattr(activation, "sigmoid_mul", lambda *a: calls.append(1) or real(*a))
    strides, real_rope = [], rope_kernels.rotary_embedding
    monkeypatch.setattr(
        rope_kernels,
        "rotary_embedding",
        lambda pos, q, *a, **kw: strides.append(q.stride()) or real_rope(pos, q, *a, **kw),
    )
    monkeypatch.setattr(decoder, "use_triton", lambda x: True)
    monkeypatch.setattr(rope, "use_triton", lambda x: True)
    got = step(ours, new_cache(ours), new_states(ours), [ids], [0], [PAGE_IDS[:40]], [2])
    assert len(calls) == ours.num_layers  # the model's attention layers (K/V holders)
    # q rotated where it lies: its heads 2D apart
    assert len(strides) == ours.num_layers and all(s[1] == 2 * ours.head_dim for s in strides), strides
    # (the fused rotary kernel sums the q/k norms' variances in another order: 2e-5 apart in the logits)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_vision_language_checkpoint_serves_its_text_model(checkpoints: dict) -> None:
    path = checkpoints["qwen3_5_moe"]
    config = load_hf_config(path)
    assert config.model_type == "qwen3_5_moe_text" and config.architectures == [
        "Qwen3_5MoeForConditionalGeneration"
    ]
    model = load_model(path, config, torch.float32, torch.device("cpu"))
    names = dict(model.named_parameters())
    assert (
        "model.layers.0.linear_attn.in_proj_zba.weight" in names
        and "model.layers.1.self_attn.qkv_proj.weight" in names
    )
    assert not any("visual" in n or "mtp" in n for n in names)


def test_gptq_moe_with_the_released_rules_matches_transformers(tmp_path) -> None:
    """Qwen3.5-MoE in GPTQ int4 as the official checkpoints are (`dynamic` keeps both attentions and the shared
    expert float, the routed experts 4-bit): logits and 16 greedy tokens equal transformers' on the dequantized
    weights (AutoGPTQ's own unpacking, tests/model/test_quantized_models.py)."""
    from transformers import AutoModelForCausalLM

    from longserve.testing import quant_checkpoints as qc
    from tests.model.test_quantized_models import MOE_DYNAMIC, dequantize_gptq_checkpoint

    path = qc.write_gptq(tmp_path / "gptq", "qwen3_5_moe", bits=4, group_size=32, dynamic=MOE_DYNAMIC, seed=3)
    ref = qc.dequantized_checkpoint(path, tmp_path / "dequantized", dequantize_gptq_checkpoint(path, 4))
    ours = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32, experts_implementation="eager").eval()
    methods = {
        name: type(m.quant_method).__name__ for name, m in ours.named_modules() if hasattr(m, "quant_method")
    }
    assert methods["model.layers.0.mlp.experts"] != "UnquantizedMoEMethod"
    assert {methods[n] for n in methods if "attn" in n or "shared_expert" in n} == {"UnquantizedLinearMethod"}

    ids = prompt(ours.vocab_size, n=40, seed=2)
    cache, states = new_cache(ours), new_states(ours)
    logits = step(ours, cache, states, [ids], [0], [PAGE_IDS], [0])
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        expected = hf.generate(ids[None], max_new_tokens=16, min_new_tokens=16, do_sample=False)[
            0, 40:
        ].tolist()
    out = [int(logits[-1].argmax())]
    while len(out) < 16:
        logits = step(ours, cache, states, [torch.tensor(out[-1:])], [40 + len(out) - 1], [PAGE_IDS], [0])
        out.append(int(logits[-1].argmax()))
    assert out == expected and len(set(out)) >= 4

    # act order's weights as the released checkpoints lay them out: the vision-language wrapper's text model under
    # `model.language_model.`, the quantization config at the top level: the rules and each module's companions
    # (its g_idx) are found under those names, and the model is the same
    act = qc.write_gptq(tmp_path / "act", "qwen3_5_moe", bits=4, group_size=32, desc_act=True, dynamic=MOE_DYNAMIC,
                        seed=4)  # fmt: skip
    vl = as_vision_language(act, tmp_path / "act-vl")
    logits = {}
    for p in (act, vl):
        model = load_model(p, load_hf_config(p), torch.float32, torch.device("cpu"))
        logits[p] = step(model, new_cache(model), new_states(model), [ids], [0], [PAGE_IDS], [0])
    assert logits[vl].equal(logits[act])


def as_vision_language(path: str, dst) -> str:
    """A text-model checkpoint (Qwen3.5-MoE) rewritten as the released vision-language layout: tensors under
    `model.language_model.`, config.json a `Qwen3_5MoeConfig` with the text config inside and the quantization
    config beside it (the vision tower's tensors left out: the loader skips them)."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5MoeConfig

    shutil.copytree(path, dst)
    tensors = load_file(f"{path}/model.safetensors")
    renamed = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in tensors.items()}  # fmt: skip
    save_file(renamed, f"{dst}/model.safetensors", metadata={"format": "pt"})
    text = json.loads(Path(path, "config.json").read_text())
    quant = text.pop("quantization_config")
    vl = Qwen3_5MoeConfig(text_config=text, vision_config={"depth": 1, "hidden_size": 32, "num_heads": 2,
                                                           "out_hidden_size": text["hidden_size"]})  # fmt: skip
    vl.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    config = vl.to_dict()
    config["quantization_config"] = quant
    with open(f"{dst}/config.json", "w") as f:
        json.dump(config, f)
    return str(dst)


def test_qwen3_next_fused_projections_regroup_and_quantized_ones_are_refused(checkpoints: dict) -> None:
    """Qwen3-Next's in_proj_qkvz / in_proj_ba (per key head: q, k, its value heads' v and z; b then a) load into the
    layer's q|k|v and z|b|a as transformers' fix_query_key_value_ordering splits them; a packed one is refused."""
    from safetensors.torch import load_file

    path = checkpoints[QWEN3_NEXT]
    model = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"))
    tensors = load_file(f"{path}/model.safetensors")
    layer = model.model.layers[0].linear_attn
    qkvz = tensors["model.layers.0.linear_attn.in_proj_qkvz.weight"]  # [Hk * (2K + 2 (Hv/Hk) V), H]
    hk, k, per_v = 2, 16, 2 * 24  # 2 value heads a key head of 24
    groups = qkvz.view(hk, 2 * k + 2 * per_v, -1)
    q, key, v, z = groups.split([k, k, per_v, per_v], dim=1)
    qkv, zba = layer.in_proj_qkv.weight, layer.in_proj_zba.weight
    assert torch.equal(qkv[: hk * k], q.reshape(-1, qkvz.shape[1]))
    assert torch.equal(qkv[2 * hk * k :], v.reshape(-1, qkvz.shape[1]))
    assert torch.equal(zba[: hk * per_v], z.reshape(-1, qkvz.shape[1]))
    bad = {"model.layers.0.linear_attn.in_proj_qkvz.qweight": torch.zeros(1, dtype=torch.int32)}
    with pytest.raises(ValueError, match="quantized fused Qwen3-Next projection is not supported"):
        model.load_weights(bad.items())
