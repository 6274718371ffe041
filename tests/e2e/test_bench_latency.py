"""`longserve bench latency` end to end on CPU with the built-in tiny config: records, JSON file, CLI, and
the errors of malformed flags."""

from __future__ import annotations

import json
import time

import pytest

from longserve import cli
from longserve.bench import run_latency
from longserve.bench.configs import BUILTIN_CONFIGS

FLAGS = [
    "--config", "tiny", "--device", "cpu", "--dtype", "float32", "--repeat", "1", "--warmup", "0",
]  # fmt: skip


def test_latency_records_and_json(tmp_path, capsys):
    out = tmp_path / "lat.json"
    records = run_latency([
        *FLAGS, "--prompt-lens", "64,128", "--prefix-hit", "96:8", "--decode-batch-sizes", "1,4",
        "--decode-context-len", "32", "--compare-hf", "--output-json", str(out),
    ])  # fmt: skip
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(records))
    by_case = {}
    for rec in saved:
        by_case.setdefault(rec["case"], []).append(rec)
        assert rec["skipped"] is None
        meta = rec["metadata"]
        assert meta["dtype"] == "float32" and meta["model"] == "tiny" and meta["device"].startswith("cpu")
        assert meta["torch"] and meta["date"] and "--prompt-lens 64,128" in meta["command"]
    assert sorted(by_case) == ["cold", "decode", "prefix_hit"]

    cold = by_case["cold"]
    assert [r["prompt_len"] for r in cold] == [64, 128]
    for r in cold:
        assert r["ttft_s"] > 0 and r["wall_s"] >= r["ttft_s"] and r["tokens_per_s"] > 0
        assert r["hf_wall_s"] > 0 and r["hf_ratio"] == pytest.approx(r["hf_wall_s"] / r["wall_s"])

    (hit,) = by_case["prefix_hit"]
    assert (hit["cached_len"], hit["new_len"], hit["prompt_len"]) == (96, 8, 104)
    assert hit["cached_tokens"] == 96  # page-aligned (page_size 16)
    assert hit["ttft_s"] > 0 and hit["cold_ttft_s"] > 0
    assert hit["speedup"] == pytest.approx(hit["cold_ttft_s"] / hit["ttft_s"])

    decode = by_case["decode"]
    assert [(r["batch_size"], r["context_len"]) for r in decode] == [(1, 32), (4, 32)]
    for r in decode:
        assert r["itl_ms_median"] > 0 and r["itl_ms_mean"] > 0 and r["tokens_per_s"] > 0
        assert r["num_mixed_steps"] == 0  # every timed step was a pure decode of the whole batch

    table = capsys.readouterr().out
    for name in ("cold-64", "cold-128", "prefix-96:8", "decode-b1-c32", "decode-b4-c32"):
        assert name in table
    # the heading names the engine's steps; a float model on a CPU takes no lone ones (runner/step_tokens.py)
    assert meta["lone_prefill_chunk_size"] is None
    assert f"float32, prompt steps of {meta['chunked_prefill_size']}, commit" in table


def test_cli_bench_latency(tmp_path, capsys):
    out = tmp_path / "cli.json"
    steps = ["--chunked-prefill-size", "16", "--lone-prefill-chunk-size", "48"]
    rc = cli.main(["bench", "latency", *FLAGS, "--prompt-lens", "32", *steps, "--output-json", str(out)])
    assert rc == 0
    (rec,) = json.loads(out.read_text())
    assert rec["name"] == "cold-32" and rec["ttft_s"] > 0 and rec["hf_ratio"] is None
    assert rec["metadata"]["lone_prefill_chunk_size"] == 48 and rec["floor"]["steps"] == 1  # one lone step
    assert "prompt steps of 16 (48 alone)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--config", "tiny", "--prefix-hit", "32768"], "argument --prefix-hit: expected CACHED:NEW"),
        (["--config", "no-such-model", "--prompt-lens", "64"], "unknown config 'no-such-model'"),
        (["--config", "tiny", "--prompt-lens", "64,x"], "argument --prompt-lens"),
        (["--config", "tiny", "--decode-batch-sizes", "1@"], "argument --decode-batch-sizes"),
    ],
)
def test_malformed_flags_exit_2(capsys, flags, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "latency", *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_nothing_to_run_and_config_without_dummy(capsys):
    assert cli.main(["bench", "latency", "--config", "tiny", "--device", "cpu"]) == 2
    assert "nothing to run" in capsys.readouterr().err
    assert (
        cli.main(["bench", "latency", "--config", "tiny", "--load-format", "auto", "--prompt-lens", "8"]) == 2
    )
    assert "--load-format dummy" in capsys.readouterr().err


def test_decode_case_too_big_for_the_pool_is_skipped():
    records = run_latency([
        *FLAGS, "--decode-batch-sizes", "1,16", "--decode-context-len", "64", "--decode-steps", "4",
        "--max-total-tokens", "512",
    ])  # fmt: skip
    one, sixteen = records
    assert one["skipped"] is None and one["itl_ms_median"] > 0
    assert (
        sixteen["skipped"].startswith("16 x 64-token contexts need")
        and "the pool holds 512" in sixteen["skipped"]
    )
    assert sixteen.get("itl_ms_median") is None


def test_decode_cases_each_with_its_own_context():
    """B@C gives a decode case its own context length (one engine, one model load, for b1@32K and b64@4K);
    a plain B takes --decode-context-len; a case too big for the pool is skipped alone."""
    records = run_latency([
        *FLAGS, "--decode-batch-sizes", "1@200,2,16@96", "--decode-context-len", "64", "--decode-steps", "4",
        "--max-total-tokens", "768",
    ])  # fmt: skip
    assert [(r["name"], r["batch_size"], r["context_len"]) for r in records] == [
        ("decode-b1-c200", 1, 200), ("decode-b2-c64", 2, 64), ("decode-b16-c96", 16, 96),
    ]  # fmt: skip
    assert (
        records[0]["skipped"] is None and records[0]["itl_ms_median"] > 0 and records[1]["itl_ms_median"] > 0
    )
    assert records[2]["skipped"].startswith("16 x 96-token contexts need")


def test_profile_under_tensor_parallelism():
    """--profile --tp-size 2 (gloo): the time of every case (cold, prefix hit, decode steps) is split into
    categories that exist in the step (GEMM and the collectives of tensor parallelism among them) and never exceeds the wall time; the workers stop."""
    import torch.distributed as dist

    records = run_latency(
        [*FLAGS, "--prompt-lens", "128", "--prefix-hit", "96:8", "--profile", "--tp-size", "2",
         "--decode-batch-sizes", "2", "--decode-context-len", "64"]
    )  # fmt: skip
    assert [r["case"] for r in records] == ["cold", "prefix_hit", "decode"]
    for rec in records:  # decode too: its profiled call is --decode-steps steps
        prof = rec["profile"]
        cats = prof["by_category_ms"]
        assert cats["gemm"] > 0 and cats["collectives"] > 0, cats
        assert sum(cats.values()) == pytest.approx(prof["busy_ms"]) and prof["busy_ms"] <= prof["wall_ms"]
        assert {o["name"] for o in prof["top_ops"]} & {"aten::mm", "aten::addmm"}
        assert rec["metadata"]["tp_size"] == 2
    assert not dist.is_initialized()


def test_host_profile_names_the_engine_functions():
    """--host-profile: each case's extra run under cProfile lists the host functions by self time (each
    one's cumulative time within the run's wall time); a function the call ran is named."""
    from longserve.bench.profile import host_profile_call

    records = run_latency(
        [*FLAGS, "--prompt-lens", "64", "--decode-batch-sizes", "2", "--decode-context-len", "32",
         "--host-profile"]
    )  # fmt: skip
    for rec in records:
        prof = rec["host_profile"]
        rows = prof["top_functions"]
        assert rows and [r["self_ms"] for r in rows] == sorted((r["self_ms"] for r in rows), reverse=True)
        assert all(0 <= r["self_ms"] <= r["cum_ms"] <= prof["wall_ms"] * 1.05 + 1 for r in rows), rows
        assert "profile" not in rec  # --profile was not asked for
    total, summary = host_profile_call(lambda: sum(range(10)), top=50)
    assert total == 45 and any(
        r["function"] == "<built-in method builtins.sum>" for r in summary["top_functions"]
    )


def test_categorize_kernel_names():
    from longserve.bench.profile import categorize

    assert categorize("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "collectives"
    assert categorize("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_TNT") == "gemm"
    assert categorize("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "gemm"
    assert categorize("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16") == "attention"
    assert categorize("_extend_kernel") == "attention"
    assert categorize("_rms_norm_kernel") == "norm/rope/act"
    assert categorize("_wna16_dequant_rows_kernel") == categorize("_group_quant_kernel") == "quant"
    assert categorize("_silu_and_mul_quant_kernel") == "norm/rope/act"
    assert categorize("_wna16_gemm_kernel") == "gemm"
    assert categorize("void at::native::elementwise_kernel<128, 2>") == "other"


def test_gpu_annotations_are_not_counted_twice(monkeypatch):
    """NCCL's record_function annotation ("nccl:all_reduce") shows on the GPU timeline with its kernel's
    time: only the kernel counts (seen on an H200: collectives had doubled)."""
    from types import SimpleNamespace

    import torch.profiler

    from longserve.bench import profile as prof_mod
    from longserve.testing.profiler import fake_profile

    events = [
        SimpleNamespace(key="ncclDevKernel_AllReduce_Sum_bf16_RING_LL", device_type="DeviceType.CUDA",
                        self_device_time_total=300.0, count=2),
        SimpleNamespace(key="nccl:all_reduce", device_type="DeviceType.CUDA", self_device_time_total=300.0,
                        count=2, is_user_annotation=True),
        SimpleNamespace(key="nvjet_sm90_tst_256x128", device_type="DeviceType.CUDA",
                        self_device_time_total=700.0, count=4),
        SimpleNamespace(key="aten::mm", device_type="DeviceType.CPU", self_device_time_total=0.0, count=4),
    ]  # fmt: skip

    monkeypatch.setattr(torch.profiler, "profile", fake_profile(events))
    monkeypatch.setattr(prof_mod, "_sync", lambda: None)
    _, summary = prof_mod.profile_call(lambda: None, "cuda")
    assert summary["by_category_ms"] == {"gemm": 0.7, "collectives": 0.3}


def test_decode_times_whole_steps_under_the_overlapped_schedule(monkeypatch):
    """Each timed interval holds one step's device time. Under the overlapped schedule a step is in flight when
    the timing starts; the sync finishes it, and the next step() only reads it: timed from there, one interval
    of each run was host time alone (the 8B on an H200: ~1 of ~13 ms). Device time simulated: a step's tokens
    are ready device_s after it is queued, and the timer's sync waits for the last one queued."""
    from longserve.bench import latency_cases
    from longserve.runner import sampled

    device_s = 0.08
    queued: list[float] = []
    post_init, result = sampled.SampledStep.__post_init__, sampled.SampledStep.result

    def queue(self):
        post_init(self)
        self._queued_at = time.perf_counter()
        queued.append(self._queued_at)

    def wait_then_result(self):
        time.sleep(max(0.0, getattr(self, "_queued_at", 0.0) + device_s - time.perf_counter()))
        return result(self)

    def sync(self):
        time.sleep(max(0.0, max(queued, default=0.0) + device_s - time.perf_counter()))

    monkeypatch.setattr(sampled.SampledStep, "__post_init__", queue)
    monkeypatch.setattr(sampled.SampledStep, "result", wait_then_result)
    monkeypatch.setattr(latency_cases.Timer, "sync", sync)
    (rec,) = run_latency([
        *FLAGS, "--decode-batch-sizes", "2", "--decode-context-len", "32", "--decode-steps", "4",
        "--enable-overlap-schedule",
    ])  # fmt: skip
    assert rec["num_mixed_steps"] == 0
    # timed from the sync, the first interval was host time alone: the mean ~3/4 of the median
    assert rec["itl_ms_mean"] >= 0.9 * rec["itl_ms_median"], rec
    assert rec["itl_ms_mean"] >= device_s * 1e3 * 0.95, rec


def test_context_length_plans_a_longer_engine_and_refuses_a_shorter_one(capsys):
    """--context-length (vLLM's --max-model-len) sizes the engine as a server with that context would be (its
    attention plans, graphs and pool), not the cases; shorter than the longest case is a clear error."""
    records = run_latency([*FLAGS, "--prompt-lens", "24", "--max-model-len", "300"])
    assert records[0]["metadata"]["context_length"] == 304  # 300 rounded up to whole pages of 16
    assert records[0]["metadata"]["pool_tokens"] >= 304
    plain = run_latency([*FLAGS, "--prompt-lens", "24"])
    assert plain[0]["metadata"]["context_length"] == 32
    assert cli.main(["bench", "latency", *FLAGS, "--prompt-lens", "24", "--context-length", "16"]) == 2
    assert "--context-length 16 is shorter than the longest case (25 tokens" in capsys.readouterr().err


def test_graphs_are_planned_for_the_cases_unless_given():
    """The engine captures decode graphs up to the cases' largest decode batch (a decode step replays its own
    batch size's graph whatever else is captured) and, with decode cases alone, no piecewise graphs, unless the
    flag or --context-length (a server's engine) is given."""
    cases = ["--decode-batch-sizes", "1,3", "--decode-context-len", "16", "--decode-steps", "2"]
    runs = {
        "decode": run_latency([*FLAGS, *cases]),
        "cold": run_latency([*FLAGS, "--prompt-lens", "24"]),
        "given": run_latency(
            [*FLAGS, *cases, "--cuda-graph-max-bs", "8", "--piecewise-cuda-graph-max-tokens", "512"]
        ),
        "server": run_latency([*FLAGS, *cases, "--context-length", "64"]),
    }
    graphs = {k: {(r["metadata"]["cuda_graph_max_bs"], r["metadata"]["piecewise_cuda_graph_max_tokens"]) for r in v}
              for k, v in runs.items()}  # fmt: skip
    assert graphs == {"decode": {(3, 0)}, "cold": {(1, 4096)}, "given": {(8, 512)}, "server": {(128, 4096)}}


def test_the_pool_is_sized_for_the_model_hf_overrides_make(monkeypatch):
    """--hf-overrides shrink the model the engine builds (the 35B-A3B runs take 20 of its 40 layers): the pool is
    planned from that model's weights, not the config file's (an H100 skipped a decode case that fitted, against
    64.6 GiB of weights the engine never held)."""
    import longserve.platform

    gib = 1 << 30
    monkeypatch.setattr(longserve.platform, "available_memory_bytes", lambda device: (4 * gib, 4 * gib))
    tiny = {k: v for k, v in BUILTIN_CONFIGS["tiny"].items() if k not in ("architectures", "model_type")}
    argv = ["--config", "llama-3.1-8b", *FLAGS[2:], "--prompt-lens", "64"]
    with pytest.raises(ValueError, match=r"memory allows a pool of 16 after ~29\.9 GiB of weights"):
        run_latency(argv)  # the 8B in float32: 30 GiB of weights do not fit 4 GiB
    (rec,) = run_latency([*argv, "--hf-overrides", json.dumps(tiny)])
    assert rec["skipped"] is None and rec["ttft_s"] > 0
    assert rec["metadata"]["pool_tokens"] >= 80  # sized for the tiny model: its 65-token request and more
