"""`longserve bench latency` on an MoE shape on the CPU (the built-in tiny-moe, Qwen3-MoE with a dense layer
between sparse ones) with expert parallelism over two gloo ranks: every case runs, `--profile` files the
experts' time under its own "moe" category, and each case carries the floor of the bytes and FLOPs it must
move with the measured/floor ratio, in the JSON and the printed table."""

from __future__ import annotations

import json

import pytest

from longserve.bench import run_latency
from longserve.bench.configs import BUILTIN_CONFIGS


def test_moe_shape_with_expert_parallel_profile_and_floors(tmp_path, capsys):
    import torch.distributed as dist

    out = tmp_path / "moe.json"
    records = run_latency([
        "--config", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--repeat", "1", "--warmup", "0",
        "--prompt-lens", "64", "--decode-batch-sizes", "2", "--decode-context-len", "32", "--decode-steps", "4",
        "--tp-size", "2", "--enable-expert-parallel", "--profile", "--peak-tflops", "1", "--peak-gbps", "10",
        "--output-json", str(out),
    ])  # fmt: skip
    assert not dist.is_initialized()
    assert json.loads(out.read_text()) == json.loads(json.dumps(records))
    cold, decode = records
    assert (cold["case"], decode["case"]) == ("cold", "decode")
    for rec in records:
        cats = rec["profile"]["by_category_ms"]
        assert cats["moe"] > 0 and cats["collectives"] > 0, cats
        floor = rec["floor"]
        assert (
            floor["seconds"] > 0
            and floor["gpus"] == 2
            and (floor["peak_tflops"], floor["peak_gbps"]) == (1, 10)
        )
        assert rec["metadata"]["tp_size"] == 2
    assert cold["floor"]["ratio"] == pytest.approx(cold["ttft_s"] / cold["floor"]["seconds"])
    assert decode["floor"]["ratio"] == pytest.approx(
        decode["itl_ms_median"] / 1e3 / decode["floor"]["seconds"]
    )
    assert "moe" in BUILTIN_CONFIGS["tiny-moe"]["model_type"]
    table = capsys.readouterr().out
    assert "x floor" in table and f"{cold['floor']['ratio']:.2f}" in table
