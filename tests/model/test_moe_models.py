"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) vs transformers on tiny random checkpoints written
by transformers itself: logits of a full and a chunked prefill over a paged cache, both checkpoint layouts of
the experts (transformers 5's save_pretrained writes one tensor per expert; its in-memory stacked 3D tensors
saved as they are), which layers are sparse, the loader's errors, dummy weights, and the memory plan's count
of expert weights."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from longserve.models import load_hf_config, load_model, moe_block
from longserve.models.decoder import MLP, validate_tp_size
from longserve.models.moe import FusedMoE, expert_weight_summary
from longserve.models.moe_block import SparseMoeBlock
from longserve.models.moe_layout import expected_distinct_experts, expert_placement, moe_spec
from longserve.testing.checkpoints import MOE_ARCHS, make_tiny_checkpoint
from tests.model.test_models_vs_hf import (
    PAGE_IDS,
    hf_logits,
    load_both,
    new_cache,
    prompt,
    run_step,
    two_chunks,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], str]:
    root = tmp_path_factory.mktemp("moe")
    return {
        (arch, layout): make_tiny_checkpoint(root / f"{arch}-{layout}", arch, seed=7, expert_layout=layout)
        for arch in MOE_ARCHS
        for layout in ("per_expert", "stacked")
    }


def tensor_names(path: str) -> list[str]:
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return sorted(f.keys())


def test_transformers_saves_one_tensor_per_expert(checkpoints: dict) -> None:
    """What transformers 5 writes (save_pretrained) and holds in memory differ: the loader takes both."""
    names = tensor_names(checkpoints[("mixtral", "per_expert")])
    assert "model.layers.0.block_sparse_moe.experts.5.w3.weight" in names
    assert not any("gate_up_proj" in n for n in names)
    names = tensor_names(checkpoints[("qwen2_moe", "per_expert")])
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.1.mlp.shared_expert_gate.weight" in names
    names = tensor_names(checkpoints[("qwen3_moe", "stacked")])
    assert (
        "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.2.mlp.experts.down_proj" in names
    )
    assert not any(".experts.0." in n for n in names)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_prefill_and_chunked_match_hf_in_both_layouts(checkpoints: dict, arch: str) -> None:
    ours, hf = load_both(checkpoints[(arch, "per_expert")])
    stacked, hf_stacked = load_both(checkpoints[(arch, "stacked")])
    ids = prompt(ours.vocab_size)
    ref = hf_logits(hf, ids)  # [40, V]
    assert torch.equal(ref, hf_logits(hf_stacked, ids))  # transformers reads both layouts alike

    full = run_step(ours, new_cache(ours), [ids], [0], [PAGE_IDS])
    torch.testing.assert_close(full, ref, atol=1e-4, rtol=1e-4)
    # both layouts load to the same weights, hence the same logits
    assert torch.equal(run_step(stacked, new_cache(stacked), [ids], [0], [PAGE_IDS]), full)
    for (name, a), (_, b) in zip(ours.named_parameters(), stacked.named_parameters()):
        assert torch.equal(a, b), name

    torch.testing.assert_close(two_chunks(ours, ids), ref, atol=1e-4, rtol=1e-4)


def test_sparse_and_dense_layers_follow_the_config(checkpoints: dict) -> None:
    """Qwen3-MoE's mlp_only_layers [1] is dense between sparse layers; Qwen2-MoE's decoder_sparse_step 2
    makes layers 1 and 3 sparse, each with its gated shared expert; Mixtral is sparse throughout."""
    kinds = {}
    for arch in MOE_ARCHS:
        path = checkpoints[(arch, "per_expert")]
        model = load_model(path, load_hf_config(path), torch.float32, CPU)
        kinds[arch] = [
            "moe" if isinstance(layer.mlp, SparseMoeBlock) else "dense" for layer in model.model.layers
        ]
        for layer in model.model.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                assert (layer.mlp.shared_expert is not None) == (arch == "qwen2_moe")
            else:
                assert isinstance(layer.mlp, MLP)
    assert kinds == {
        "qwen3_moe": ["moe", "dense", "moe"],
        "qwen2_moe": ["dense", "moe", "dense", "moe"],
        "mixtral": ["moe", "moe"],
    }
    spec = moe_spec(load_hf_config(checkpoints[("qwen3_moe", "stacked")]))
    assert (spec.num_experts, spec.top_k, spec.intermediate_size, spec.renormalize) == (8, 3, 40, True)
    assert moe_spec(load_hf_config(checkpoints[("mixtral", "stacked")])).round_routing_weights is False
    # config.json as transformers 5 writes it (num_local_experts), read as a dict (bench latency's plan, the roofline):
    # the same experts as the config object's
    with open(os.path.join(checkpoints[("qwen3_moe", "stacked")], "config.json")) as f:
        raw = json.load(f)
    assert moe_spec(raw) == spec and ("num_experts" in raw) != ("num_local_experts" in raw)


def _rewrite(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("model.layers.0.block_sparse_moe.experts.4.w3.weight"),
         r"missing weights for parameters: model\.layers\.0\.mlp\.experts\.w13"),
        (lambda t: t.update({"model.layers.0.block_sparse_moe.experts.1.w2.weight": torch.zeros(64, 39)}),
         r"shape mismatch for expert 1's down projection: checkpoint \(64, 39\), expected \(64, 40\)"),
        (lambda t: t.update({"model.layers.1.block_sparse_moe.experts.6.w1.weight": torch.zeros(40, 64)}),
         r"expert tensor 'gate:6' does not fit a layer of 6 experts"),
    ],
    ids=["missing-expert", "wrong-shape", "expert-out-of-range"],
)  # fmt: skip
def test_loader_errors_name_the_expert(tmp_path, edit, message: str) -> None:
    path = make_tiny_checkpoint(tmp_path / "c", "mixtral", seed=1)
    _rewrite(path, edit)
    with pytest.raises(ValueError, match=message):
        load_model(path, load_hf_config(path), torch.float32, CPU)


def test_stacked_tensor_of_the_wrong_shape_is_refused(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path / "c", "qwen3_moe", seed=1, expert_layout="stacked")
    _rewrite(path, lambda t: t.update({"model.layers.0.mlp.experts.down_proj": torch.zeros(7, 64, 40)}))
    with pytest.raises(
        ValueError, match=r"shape mismatch: checkpoint \(7, 64, 40\), experts expect \(8, 64, 40\)"
    ):
        load_model(path, load_hf_config(path), torch.float32, CPU)


def test_dummy_weights_fill_every_expert(tmp_path) -> None:
    """--load-format dummy draws the experts too (needs only config.json), deterministic per seed."""
    path = make_tiny_checkpoint(tmp_path / "c", "qwen2_moe", seed=1)
    os.remove(os.path.join(path, "model.safetensors"))
    cfg = load_hf_config(path)
    a = load_model(path, cfg, torch.float32, CPU, load_format="dummy", seed=3)
    b = load_model(path, cfg, torch.float32, CPU, load_format="dummy", seed=3)
    experts = a.model.layers[1].mlp.experts
    for w in (experts.w13, experts.w2):
        per_expert_std = w.flatten(1).std(dim=1)  # every expert drawn, none left empty or zero
        assert torch.all((per_expert_std > 0.1) & (per_expert_std < 0.3)), per_expert_std  # initializer 0.2
    assert not torch.equal(experts.w13[0], experts.w13[1])
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), name
    ids = prompt(a.vocab_size, 12)
    logits = run_step(a, new_cache(a), [ids], [0], [PAGE_IDS])
    assert torch.isfinite(logits).all()


def test_expert_weight_summary(checkpoints: dict) -> None:
    """The memory plan counts the experts: E x (2I x H + H x I) per sparse layer, in the model's dtype."""
    path = checkpoints[("qwen3_moe", "per_expert")]
    model = load_model(path, load_hf_config(path), torch.bfloat16, CPU)
    summary = expert_weight_summary(model)
    assert summary == dict(
        expert_weight_bytes=2 * 8 * (2 * 40 * 64 + 64 * 40) * 2, moe_layers=2, num_experts=8, local_experts=8
    )
    dense = make_tiny_checkpoint(os.path.join(os.path.dirname(path), "dense"), "qwen3")
    dense_model = load_model(dense, load_hf_config(dense), torch.float32, CPU)
    assert expert_weight_summary(dense_model)["moe_layers"] == 0


def test_expert_placement_and_parallel_validation(checkpoints: dict) -> None:
    # 8 experts of 40 over tp=4: ep=1 slices every expert, ep=2 halves, ep=4 places 2 whole experts a rank
    def ranks(ep: int) -> list[tuple[int, int, int, int]]:
        places = [expert_placement(8, 40, 4, r, ep) for r in range(4)]
        return [(p.expert_start, p.num_local, p.inter_start, p.inter_size) for p in places]

    assert ranks(1) == [(0, 8, 10 * r, 10) for r in range(4)]
    assert ranks(2) == [(0, 4, 0, 20), (0, 4, 20, 20), (4, 4, 0, 20), (4, 4, 20, 20)]
    assert [expert_placement(8, 40, 4, r, 4).expert_start for r in range(4)] == [0, 2, 4, 6]
    cfg = load_hf_config(checkpoints[("mixtral", "stacked")])  # 6 experts of 40, 4 heads
    validate_tp_size(cfg, 2, 2)
    with pytest.raises(ValueError, match="ep_size=4 does not divide the model's 6 experts"):
        validate_tp_size(cfg, 4, 4)
    with pytest.raises(ValueError, match="intermediate size 40 is not divisible by tp_size=3; choose"):
        expert_placement(6, 40, 3, 0, 1)
    qwen2 = load_hf_config(checkpoints[("qwen2_moe", "stacked")])  # shared expert 80, dense 96
    with pytest.raises(ValueError, match="tp_size=3 does not divide the model's 4 attention heads"):
        validate_tp_size(qwen2, 3)
    assert expected_distinct_experts(128, 8, 1) == pytest.approx(8)
    assert expected_distinct_experts(128, 8, 8192) == pytest.approx(128)
    assert 8 < expected_distinct_experts(128, 8, 16) < 16 * 8


def test_fused_moe_layers_hold_the_loaded_experts(checkpoints: dict) -> None:
    """The stacked parameter rows are the checkpoint's per-expert tensors: w13[e] = gate_e | up_e, w2[e]."""
    path = checkpoints[("qwen2_moe", "per_expert")]
    model = load_model(path, load_hf_config(path), torch.float32, CPU)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    experts: FusedMoE = model.model.layers[3].mlp.experts
    for e in range(4):
        prefix = f"model.layers.3.mlp.experts.{e}."
        gate_up = torch.cat([tensors[prefix + "gate_proj.weight"], tensors[prefix + "up_proj.weight"]])
        assert torch.equal(experts.w13[e], gate_up)
        assert torch.equal(experts.w2[e], tensors[prefix + "down_proj.weight"])
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen2MoeForCausalLM"]


def test_stacked_moe_inputs_equal_the_separate_gemms(checkpoints: dict, monkeypatch) -> None:
    """Qwen2-MoE (a gated shared expert, plain weights, one rank): after loading, the router's, the shared gate's
    and the shared expert's gate|up weights are views of one stacked tensor (linear_method.stack_inputs); with
    the stacked GEMM on (STACKED_INPUTS_MAX_TOKENS) every MoE block takes it, and a prompt's and two chunks'
    logits equal transformers' as they do without it. Mixtral (no shared expert) stacks nothing."""
    ours, hf = load_both(checkpoints[("qwen2_moe", "per_expert")])
    blocks = [m for m in ours.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    for b in blocks:
        storage = b.stacked_inputs.untyped_storage().data_ptr()
        views = (b.shared_expert.gate_up_proj.weight, b.gate.weight, b.shared_expert_gate.weight)
        assert all(w.untyped_storage().data_ptr() == storage for w in views)
        assert b.stacked_inputs.shape[0] == sum(w.shape[0] for w in views)
    ids = prompt(ours.vocab_size)
    ref = hf_logits(hf, ids)
    off = run_step(ours, new_cache(ours), [ids], [0], [PAGE_IDS])
    calls = []
    stacked = SparseMoeBlock._stacked
    monkeypatch.setattr(SparseMoeBlock, "_stacked", lambda self, x: calls.append(1) or stacked(self, x))
    monkeypatch.setattr(moe_block, "STACKED_INPUTS_MAX_TOKENS", 1 << 20)
    on = run_step(ours, new_cache(ours), [ids], [0], [PAGE_IDS])
    assert len(calls) == len(blocks)
    torch.testing.assert_close(on, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(on, off, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(two_chunks(ours, ids), ref, atol=1e-4, rtol=1e-4)
    mixtral, _ = load_both(checkpoints[("mixtral", "per_expert")])
    assert all(m.stacked_inputs is None for m in mixtral.modules() if isinstance(m, SparseMoeBlock))


def test_shared_experts_gated_add_in_the_experts_sum(checkpoints: dict, monkeypatch) -> None:
    """Qwen2-MoE with its experts in the Triton fused_moe (interpreted, as on a GPU) and the shared expert's
    sigmoid(gate) * shared handed to it (FUSED_SHARED_GATE): a 5-token step adds it in the k-sum's launch in
    every block, a 40-token one after the sum; through the separate and the stacked input GEMMs the logits equal
    the torch path's, those with FUSED_SHARED_GATE off, and transformers'."""
    from longserve.kernels import fused_moe as fm
    from longserve.models import moe as moe_mod

    ours, hf = load_both(checkpoints[("qwen2_moe", "per_expert")])
    blocks = [m for m in ours.modules() if isinstance(m, SparseMoeBlock)]
    in_sum, after = [], []
    real_sum, real_add = fm.moe_sum, fm.sigmoid_gated_add
    monkeypatch.setattr(
        fm, "moe_sum", lambda *a, **kw: in_sum.append(kw.get("addend") is not None) or real_sum(*a, **kw)
    )
    monkeypatch.setattr(fm, "sigmoid_gated_add", lambda *a: after.append(1) or real_add(*a))
    for n, summed in ((5, True), (40, False)):
        ids = prompt(ours.vocab_size, n=n)
        monkeypatch.setattr(moe_mod, "use_triton", lambda x: False)
        torch_path = run_step(ours, new_cache(ours), [ids], [0], [PAGE_IDS])
        monkeypatch.setattr(moe_mod, "use_triton", lambda x: True)
        for stacked in (0, 1 << 20):
            monkeypatch.setattr(moe_block, "STACKED_INPUTS_MAX_TOKENS", stacked)
            in_sum.clear(), after.clear()
            fused = run_step(ours, new_cache(ours), [ids], [0], [PAGE_IDS])
            assert (in_sum, after) == (([True] * len(blocks), []) if summed else ([], [1] * len(blocks)))
            torch.testing.assert_close(fused, torch_path, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(fused, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
        monkeypatch.setattr(moe_block, "FUSED_SHARED_GATE", False)
        torch.testing.assert_close(
            run_step(ours, new_cache(ours), [ids], [0], [PAGE_IDS]), torch_path, atol=1e-5, rtol=1e-5
        )
        monkeypatch.setattr(moe_block, "FUSED_SHARED_GATE", True)
