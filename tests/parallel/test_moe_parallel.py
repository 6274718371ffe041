"""Mixture-of-experts models over several CPU ranks (gloo): tensor parallelism (every expert's intermediate dim
split), expert parallelism (whole experts per rank: vLLM's enable_expert_parallel, SGLang's ep_size) and both
at once give TP=1's greedy tokens through the public LLM API, with a chunked prompt and a prefix-cache hit;
each rank holds and reads only its experts; bad sizes are refused with the setting named; a server started
with the flags reports the per-rank experts in /server_info."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longserve import LLM
from longserve.distributed import TPGroup, get_tp_group, parallel_state
from longserve.models import load_hf_config
from longserve.models.loader import LoadStats, load_model
from longserve.testing.checkpoints import MOE_ARCHS, make_tiny_checkpoint
from tests.parallel.test_tensor_parallel import GREEDY, prompts, run


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {arch: make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=11) for arch in MOE_ARCHS}


@pytest.fixture(scope="module")
def tp1(checkpoints) -> dict[str, tuple]:
    return {arch: run(path) for arch, path in checkpoints.items()}


def check_equal(got: tuple, expected: tuple) -> None:
    assert got[:2] == expected[:2]
    assert len(set(expected[1])) > 3, "degenerate output: the test would prove little"
    num_prompt = len(prompts()[2])
    assert got[2] == expected[2] < num_prompt + GREEDY.max_new_tokens  # the shared pages were not recomputed


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_tp2_equals_tp1(checkpoints, tp1, arch):
    """Each rank holds every expert's intermediate half (and the shared expert's, the dense layers' halves)."""
    check_equal(run(checkpoints[arch], tensor_parallel_size=2), tp1[arch])


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])  # Qwen2-MoE's: the overlap and server tests
def test_expert_parallel_over_2_ranks_equals_tp1(checkpoints, tp1, arch):
    """Each rank holds half of the experts whole; the pairs routed to the other rank's add nothing there."""
    check_equal(run(checkpoints[arch], tensor_parallel_size=2, enable_expert_parallel=True), tp1[arch])


def test_tp4_with_2_expert_groups_equals_tp1(checkpoints, tp1):
    """SGLang's --tp-size 4 --ep-size 2: two groups of two ranks, each group half of the experts, each rank
    half of its experts' intermediate dim (and a replicated kv head)."""
    check_equal(run(checkpoints["qwen3_moe"], tp_size=4, ep_size=2), tp1["qwen3_moe"])


def test_overlapped_halves_with_expert_parallel_equal_tp1(checkpoints, tp1):
    """Steps run as two halves whose all-reduces overlap: the MoE block's partial sum (experts + gated shared
    expert) is reduced once per half like the dense MLP's."""
    path = checkpoints["qwen2_moe"]
    with LLM(path, dtype="float32", device="cpu", max_total_tokens=2048, chunked_prefill_size=16, tp_size=2,
             enable_expert_parallel=True, tp_overlap_min_tokens=6) as m:  # fmt: skip
        got = [o.token_ids for o in m.generate(prompts()[:2], GREEDY)]
        assert m.engine.runner.num_overlapped_passes > 0
        m.engine.check_integrity()
    assert got == tp1["qwen2_moe"][0]


def test_dummy_experts_do_not_depend_on_the_placement(checkpoints):
    path = checkpoints["mixtral"]
    expected = run(path, load_format="dummy")
    assert run(path, load_format="dummy", tp_size=2, enable_expert_parallel=True)[:2] == expected[:2]


def fake_rank(monkeypatch, tp: int, rank: int, ep: int) -> None:
    group = TPGroup(rank, tp, rank, device_group=None, cpu_group=None, ep_size=ep)
    monkeypatch.setattr(parallel_state, "_TP", group)


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_each_rank_reads_only_its_experts(tmp_path, monkeypatch, layout):
    """Under expert parallelism a rank's stacked parameters are its experts' rows of the whole model's, read
    from either checkpoint layout without reading the other rank's experts."""
    path = make_tiny_checkpoint(tmp_path, "qwen3_moe", seed=2, expert_layout=layout)
    cfg = load_hf_config(path)
    whole_stats = LoadStats()
    whole = load_model(path, cfg, torch.float32, torch.device("cpu"), stats=whole_stats)
    read = []
    for rank in range(2):
        fake_rank(monkeypatch, 2, rank, ep=2)
        stats = LoadStats()
        part = load_model(path, cfg, torch.float32, torch.device("cpu"), stats=stats)
        monkeypatch.setattr(parallel_state, "_TP", None)
        for layer in (0, 2):
            mine, all_ = part.model.layers[layer].mlp.experts, whole.model.layers[layer].mlp.experts
            assert mine.w13.shape == (4, 80, 64) and mine.expert_map.tolist() == (
                [0, 1, 2, 3, -1, -1, -1, -1] if rank == 0 else [-1, -1, -1, -1, 0, 1, 2, 3]
            )
            assert torch.equal(mine.w13, all_.w13[4 * rank : 4 * rank + 4])
            assert torch.equal(mine.w2, all_.w2[4 * rank : 4 * rank + 4])
        read.append(stats.bytes_read)
    expert_bytes = sum(
        p.numel() * 4 for m in whole.modules() if hasattr(m, "required_shards") for p in m.parameters()
    )
    assert whole_stats.bytes_read == whole_stats.bytes_total
    for got in read:  # half of the experts' bytes, and half of the attention and dense layers'
        assert got <= whole_stats.bytes_total - expert_bytes // 2


def test_bad_expert_parallel_sizes_are_refused(checkpoints):
    path = checkpoints["mixtral"]  # 6 experts, 4 heads
    with pytest.raises(ValueError, match="ep_size=4 does not divide the model's 6 experts"):
        LLM(path, device="cpu", tp_size=4, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="ep_size=3 must divide tp_size=2"):
        LLM(path, device="cpu", tp_size=2, ep_size=3)
    with pytest.raises(ValueError, match="enable_expert_parallel places the experts over all tp_size=4"):
        LLM(path, device="cpu", tp_size=4, ep_size=2, enable_expert_parallel=True)
    assert get_tp_group() is None and not dist.is_initialized()


def test_server_flags_and_server_info(checkpoints, tmp_path, tp1):
    """`longserve serve --tp-size 2 --enable-expert-parallel` (vLLM's flag) serves TP=1's tokens, and
    /server_info's memory plan shows each rank's half of the experts; --ep-size (SGLang's) is the same."""
    import httpx

    from longserve.server.args import parse
    from tests.server.conftest import ServerProcess

    engine, _ = parse(["--model-path", checkpoints["qwen2_moe"], "--tp-size", "2", "--ep-size", "2"])
    assert (engine.ep_size, engine.enable_expert_parallel) == (2, False)
    engine, _ = parse(["--model-path", checkpoints["qwen2_moe"], "--tp", "2", "--enable-expert-parallel"])
    assert engine.ep_size == 2
    with pytest.raises(
        ValueError, match="ep_size=4 does not divide the model's 4 experts|ep_size=4 must divide"
    ):
        parse(["--model-path", checkpoints["qwen2_moe"], "--tp-size", "2", "--ep", "4"])

    args = ["--model-path", checkpoints["qwen2_moe"], "--device", "cpu", "--dtype", "float32"]
    args += ["--max-total-tokens", "2048", "--tp-size", "2", "--enable-expert-parallel"]
    server = ServerProcess(args, str(tmp_path / "server.log")).wait_ready()
    try:
        ids = prompts()[0]
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        }
        out = httpx.post(server.url + "/generate", json=body, timeout=120).json()
        assert out["output_ids"] == tp1["qwen2_moe"][0][0]
        info = httpx.get(server.url + "/server_info?check_integrity=1", timeout=30).json()
        memory = info["memory"]
        assert (memory["tp_size"], memory["ep_size"], memory["num_experts"], memory["local_experts"]) == (
            2,
            2,
            4,
            2,
        )
        assert memory["moe_layers"] == 2 and 0 < memory["expert_weight_bytes"] < memory["weight_bytes"]
        assert info["engine_config"]["ep_size"] == 2 and info["kv_integrity"] == "ok"
        assert "MoE layers of 4 experts, 2 on this rank" in server.log()
    finally:
        server.stop()
