"""The floors `bench latency` prints: parameter counts of the built-in shapes against their published sizes
(Qwen3-30B-A3B: 30.5B total, 3.3B activated; Mixtral-8x7B: 46.7B, 12.9B), the keys a causal (windowed)
prefill attends against a brute-force count, the experts a step touches, and the bound of each kind of case."""

from __future__ import annotations

import pytest

from longserve.bench.configs import BUILTIN_CONFIGS
from longserve.bench.latency_plan import estimate_bytes
from longserve.bench.roofline import (
    _keys_attended,
    card_peaks,
    case_floor,
    model_costs,
    prefill_steps,
    step_cost,
    with_measured_bytes,
)


@pytest.mark.parametrize(
    ("shape", "total_b", "active_b"),
    [("qwen3-30b-a3b", 30.5, 3.3), ("mixtral-8x7b", 46.7, 12.9), ("llama-3.1-8b", 8.03, 8.03)],
)
def test_parameter_counts_match_the_published_sizes(shape: str, total_b: float, active_b: float) -> None:
    cfg = BUILTIN_CONFIGS[shape]
    costs = model_costs(cfg, itemsize=2)
    assert costs.weight_bytes / 2 / 1e9 == pytest.approx(total_b, rel=0.01)
    active = costs.active_params_per_token + costs.embed_params  # published counts include both embeddings
    assert active / 1e9 == pytest.approx(active_b, rel=0.03)
    weights, kv_per_token = estimate_bytes(cfg, 2, tp=2)  # the pool plan counts every expert
    assert weights == costs.weight_bytes // 2
    assert kv_per_token == cfg["num_hidden_layers"] * max(1, cfg["num_key_value_heads"] // 2) * 128 * 2 * 2


@pytest.mark.parametrize("window", [None, 1, 5, 16])
@pytest.mark.parametrize(("prefix", "new"), [(0, 1), (0, 20), (7, 13), (30, 4)])
def test_keys_attended(prefix: int, new: int, window: int | None) -> None:
    brute = sum(min(pos + 1, window or pos + 1) for pos in range(prefix, prefix + new))
    assert _keys_attended(prefix, new, window) == brute


def test_a_step_reads_only_the_experts_it_touches() -> None:
    costs = model_costs(BUILTIN_CONFIGS["qwen3-30b-a3b"], itemsize=2)
    one = step_cost(costs, [(0, 1)], sampled=1)
    expert_bytes = costs.expert_params * costs.itemsize
    head = costs.vocab * costs.hidden * costs.itemsize
    # one token: the dense weights, the LM head and 8 experts per layer, plus its own K/V written
    assert one.bytes == pytest.approx(
        costs.dense_params * 2 + head + 48 * 8 * expert_bytes + costs.kv_bytes_per_token
    )
    chunk = step_cost(costs, [(0, 8192)], sampled=0)  # every expert, no LM head
    assert chunk.bytes == pytest.approx(
        costs.weight_bytes - costs.embed_params * 2 + 8192 * costs.kv_bytes_per_token
    )
    assert chunk.flops > 8192 * 2 * costs.active_params_per_token


def test_case_floors_and_their_bounds() -> None:
    costs = model_costs(BUILTIN_CONFIGS["qwen3-30b-a3b"], itemsize=2)
    cold = case_floor({"case": "cold", "prompt_len": 32768, "ttft_s": 2.0}, costs, chunk=8192)
    assert cold["bound"] == "compute" and cold["steps"] == 4
    assert cold["ratio"] == pytest.approx(2.0 / cold["seconds"])
    assert [p for p, _, _ in prefill_steps(0, 32768, 8192)] == [0, 8192, 16384, 24576]
    # the scheduler's lone steps (sched/chunk_size.py): 32K, then fewer, then the usual 8K
    lone = prefill_steps(0, 131072, 8192, lone=32768)
    assert [n for _, n, _ in lone] == [32768, 13572, 10415, 8780] + [8192] * 8 + [131072 - 65535 - 8 * 8192]
    assert [p for p, _, _ in lone][:3] == [0, 32768, 46340] and [s for _, _, s in lone].count(True) == 1
    on_granule = prefill_steps(0, 131072, 8192, lone=32768, granule=2048)  # the cuDNN backend's
    assert [n for _, n, _ in on_granule] == [32768, 12288, 10240] + [8192] * 9 + [2048]
    lone_cold = case_floor({"case": "cold", "prompt_len": 32768}, costs, chunk=8192, lone=32768)
    assert lone_cold["steps"] == 1 and lone_cold["bytes"] < cold["bytes"] / 3  # the experts read once, not 4x
    decode1 = case_floor(
        {"case": "decode", "batch_size": 1, "context_len": 32768, "itl_ms_median": 4.0}, costs, chunk=8192
    )
    assert decode1["bound"] == "memory" and decode1["ratio"] == pytest.approx(4e-3 / decode1["seconds"])
    decode64 = case_floor({"case": "decode", "batch_size": 64, "context_len": 4096}, costs, chunk=8192)
    assert decode64["seconds"] > decode1["seconds"] and decode64["ratio"] is None
    hit = case_floor(
        {"case": "prefix_hit", "prompt_len": 32768 + 64, "cached_tokens": 32768, "ttft_s": 0.01}, costs, 8192
    )
    assert hit["steps"] == 1 and hit["seconds"] < cold["seconds"] / 50
    two_gpus = case_floor({"case": "cold", "prompt_len": 32768}, costs, chunk=8192, gpus=2)
    assert two_gpus["seconds"] == pytest.approx(cold["seconds"] / 2)
    assert case_floor({"case": "decode", "skipped": "too big"}, costs, 8192) is None


def test_a_card_takes_its_own_bandwidth() -> None:
    """An H100's floors at its measured bandwidth (a memory-bound decode step longer by 4,200 / 2,843), its GEMM
    ceiling the H200's (the same chip and clocks); an H200 and a CPU run at the H200's."""
    h100, h200 = card_peaks("NVIDIA H100 80GB HBM3"), card_peaks("NVIDIA H200")
    assert h100 == (770.0, 2843.0) and h200 == card_peaks("cpu (x86_64, 2 cores)") == (770.0, 4200.0)
    costs = model_costs(BUILTIN_CONFIGS["llama-3.1-8b"], itemsize=2)
    record = {"case": "decode", "batch_size": 1, "context_len": 32768, "itl_ms_median": 7.66}
    on_h100, on_h200 = (case_floor(record, costs, 8192, 1, *peaks) for peaks in (h100, h200))
    assert on_h100["bound"] == on_h200["bound"] == "memory"
    assert on_h100["seconds"] == pytest.approx(on_h200["seconds"] * 4200 / 2843)


def test_moe_kernels_have_their_own_profile_category() -> None:
    from longserve.bench.profile import categorize

    assert categorize("_moe_gemm_kernel") == "moe"
    assert categorize("_route_topk_kernel") == categorize("_moe_align_kernel") == "moe"  # not "sampling"
    assert categorize("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_TNT") == "gemm"


def test_kernels_launched_inside_the_moe_range_count_as_moe(monkeypatch) -> None:
    """On CUDA the fused kernel is "moe" by name, and the torch kernels launched from inside the experts'
    profiler range (routing's topk, alignment's sort) are too, for the time they ran there; the same kernels
    launched elsewhere keep their own category."""
    from types import SimpleNamespace

    import torch.profiler

    from longserve.bench import profile as prof_mod
    from longserve.models.moe import PROFILE_RANGE
    from longserve.testing.profiler import fake_profile

    moe_range = SimpleNamespace(name=PROFILE_RANGE, cpu_parent=None, kernels=[])
    topk_in_moe = SimpleNamespace(
        name="aten::topk", cpu_parent=moe_range, kernels=[SimpleNamespace(name="gatherTopK", duration=30.0)]
    )
    topk_sampling = SimpleNamespace(
        name="aten::topk", cpu_parent=None, kernels=[SimpleNamespace(name="gatherTopK", duration=10.0)]
    )
    kernels = [
        SimpleNamespace(
            key="_moe_gemm_kernel", device_type="DeviceType.CUDA", self_device_time_total=500.0, count=2
        ),
        SimpleNamespace(
            key="gatherTopK", device_type="DeviceType.CUDA", self_device_time_total=40.0, count=2
        ),
        SimpleNamespace(
            key="nvjet_tst_128x64", device_type="DeviceType.CUDA", self_device_time_total=200.0, count=3
        ),
    ]

    monkeypatch.setattr(
        torch.profiler, "profile", fake_profile(kernels, [moe_range, topk_in_moe, topk_sampling])
    )
    monkeypatch.setattr(prof_mod, "_sync", lambda: None)
    _, summary = prof_mod.profile_call(lambda: None, "cuda")
    assert summary["by_category_ms"] == pytest.approx({"moe": 0.53, "gemm": 0.2, "sampling": 0.01})


def test_each_kernel_counts_only_its_time_past_the_kernels_before_it(monkeypatch) -> None:
    """Programmatic dependent launch: a kernel starts while the one ahead drains and waits for it, so its span
    holds the other's tail. exclusive_times gives each the part no earlier-started kernel covers: they sum to the
    union of the spans (the device's busy time, gaps left out), each part to the kernel that ran first."""
    from types import SimpleNamespace

    import torch.profiler

    from longserve.bench import profile as prof_mod
    from longserve.testing.profiler import fake_profile

    spans = [
        ("norm", 0.0, 10.0),
        ("gemv", 2.0, 30.0),  # launched early: waits for the norm until 10
        ("silu", 25.0, 34.0),  # and for the gemv until 30
        ("gemv", 40.0, 60.0),  # after an idle gap: all of it
        ("tiny", 45.0, 50.0),  # inside the second gemv's span: nothing of its own
    ]
    times = prof_mod.exclusive_times(spans)
    assert times == {"norm": 10.0, "gemv": 20.0 + 20.0, "silu": 4.0, "tiny": 0.0}
    assert sum(times.values()) == 54.0  # 0-34 and 40-60

    kernel = lambda name, start, end: SimpleNamespace(  # noqa: E731
        name=name, device_type="DeviceType.CUDA", time_range=SimpleNamespace(start=start, end=end)
    )
    averages = [
        SimpleNamespace(key=n, device_type="DeviceType.CUDA", self_device_time_total=t, count=c)
        for n, t, c in (("gemv", 48.0, 2), ("norm", 10.0, 1), ("silu", 9.0, 1), ("tiny", 5.0, 1))
    ]

    # the kernels, and a host op that is not one
    events = [kernel(*span) for span in spans] + [SimpleNamespace(name="aten::mm", device_type="CPU")]
    monkeypatch.setattr(torch.profiler, "profile", fake_profile(averages, events))
    monkeypatch.setattr(prof_mod, "_sync", lambda: None)
    _, summary = prof_mod.profile_call(lambda: None, "cuda")
    assert summary["busy_ms"] == pytest.approx(0.072)  # the spans' sum, as before
    assert summary["exclusive_ms"] == pytest.approx(0.054)
    by_name = {op["name"]: op for op in summary["top_ops"]}
    assert by_name["gemv"]["ms"] == pytest.approx(0.048) and by_name["gemv"]["exclusive_ms"] == pytest.approx(
        0.04
    )
    assert by_name["tiny"]["exclusive_ms"] == 0.0


def test_a_quantized_engine_floor_counts_the_bytes_it_holds() -> None:
    """with_measured_bytes: the loaded engine's weight bytes (int4: ~0.52 a layer weight with its scales) and KV
    bytes per token (fp8: 1 a value) replace the bf16 ones in a decode step; the embeddings and the LM head stay
    bf16. bf16's own bytes leave the floor unchanged."""
    costs = model_costs(BUILTIN_CONFIGS["llama-3.1-8b"], itemsize=2)
    layer_params = costs.dense_params
    head = costs.vocab * costs.hidden
    same = with_measured_bytes(costs, costs.weight_bytes, costs.kv_bytes_per_token)
    assert step_cost(same, [(32768, 1)], 1).bytes == pytest.approx(step_cost(costs, [(32768, 1)], 1).bytes)
    int4_fp8kv = with_measured_bytes(
        costs, costs.embed_params * 2 + layer_params * 0.52, costs.kv_bytes_per_token / 2
    )
    assert int4_fp8kv.layer_itemsize == pytest.approx(0.52) and int4_fp8kv.kv_itemsize == pytest.approx(1.0)
    got = step_cost(int4_fp8kv, [(32768, 1)], sampled=1).bytes
    assert got == pytest.approx(layer_params * 0.52 + head * 2 + 32769 * costs.kv_bytes_per_token / 2)
    record = {"case": "decode", "batch_size": 1, "context_len": 32768, "itl_ms_median": 5.0}
    assert case_floor(record, int4_fp8kv, 8192)["seconds"] < case_floor(record, costs, 8192)["seconds"] / 1.7


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_hybrid_costs_count_the_models_parameters(tmp_path, arch: str) -> None:
    """A hybrid model's costs: every parameter of the built model but the norms (the floors' rounding), K/V only in
    its full-attention layers; the 35B-A3B shape's total near its published 35B."""
    import json

    import torch

    from longserve.models import load_hf_config, load_model
    from longserve.models.layers import RMSNorm
    from longserve.testing.checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, arch, seed=1)
    config = load_hf_config(path)
    cfg = json.loads(config.to_json_string())
    model = load_model(path, config, torch.float32, torch.device("cpu"))
    norms = {id(p) for m in model.modules() if isinstance(m, RMSNorm) for p in m.parameters()}
    norms |= {id(layer.linear_attn.norm.weight) for layer in model.model.layers if not layer.attends}
    counted = sum(p.numel() for p in model.parameters() if id(p) not in norms)
    costs = model_costs(cfg, itemsize=4)
    assert costs.weight_bytes // 4 == counted
    with open(f"{path}/config.json") as f:  # as released: the MoE one's text model under text_config
        assert model_costs(json.load(f), itemsize=4) == costs
    assert costs.num_layers == model.num_layers == 2  # of 4 layers
    big = model_costs(BUILTIN_CONFIGS["qwen3.5-35b-a3b"], itemsize=2)
    assert big.weight_bytes / 2 / 1e9 == pytest.approx(35, rel=0.03) and big.num_layers == 10
