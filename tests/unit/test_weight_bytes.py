"""`bench latency` plans its KV pool against the bytes the weights will take (bench/weight_bytes.py,
latency_plan.estimate_bytes), read from config.json before loading: for quantized checkpoints in their own on-disk
layouts (GPTQ int4 / int8, AWQ, FP8 blocks, GPTQ MoE with the official Qwen3.5 recipe's float attention and shared
experts) the estimate is within a few percent of the tensors the checkpoint holds (norms, g_idx and routers are not
counted), high where a model's dense part is partly float; counted as float weights they were 2-2.5x too many (a
32K case of the 35B-A3B GPTQ-Int4 on an H100 would have been planned against 64.6 GiB instead of ~19)."""

from __future__ import annotations

import json
import os

import pytest
from safetensors import safe_open

from longserve.bench.latency_plan import estimate_bytes
from longserve.bench.weight_bytes import quant_format
from longserve.testing import quant_checkpoints as qc

MOE_DYNAMIC = {
    "-:.*attn.*": {},
    "-:.*shared_expert.*": {},
}  # the official Qwen3.5 GPTQ-Int4 checkpoints' rules


def held_bytes(path: str) -> int:
    total = 0
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is no mapping
                    t = f.get_tensor(key)
                    total += t.numel() * t.element_size()
    return total


CASES = {
    "gptq-int4-g32": lambda p: qc.write_gptq(p, "qwen3", bits=4, group_size=32),
    "gptq-int4-g128-llama": lambda p: qc.write_gptq(p, "llama", bits=4, group_size=128),
    "gptq-int8-channel": lambda p: qc.write_gptq(p, "qwen3", bits=8, group_size=-1),
    "awq": lambda p: qc.write_awq(p, "qwen3", group_size=32),
    "fp8-block": lambda p: qc.write_fp8_block(p, "qwen3", block=(32, 32)),
    "gptq-moe-float-attention": lambda p: qc.write_gptq(
        p, "qwen3_moe", group_size=32, dynamic={"-:.*attn.*": {}}
    ),
    "gptq-qwen3.5-moe-official-rules": lambda p: qc.write_gptq(
        p, "qwen3_5_moe", group_size=32, dynamic=MOE_DYNAMIC
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_estimate_holds_a_quantized_checkpoints_bytes(tmp_path, case):
    path = str(CASES[case](tmp_path))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    itemsize = 4 if str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32") == "float32" else 2
    held = held_bytes(path)
    est, _ = estimate_bytes(cfg, itemsize, quant=quant_format(cfg, None, "auto"))
    as_float, _ = estimate_bytes(cfg, itemsize)
    high = 1.25 if case == "gptq-moe-float-attention" else 1.03  # its dense MLP layer counts as float
    assert 0.95 * held <= est <= high * held, (est, held)
    assert as_float > 1.6 * held


def test_dummy_weights_in_a_format_and_an_fp8_cache():
    """--quantization gptq with dummy weights (the format's defaults) and --kv-cache-dtype fp8: the same plan as the
    format's checkpoint; a K/V value a byte."""
    from longserve.bench.configs import BUILTIN_CONFIGS

    cfg = BUILTIN_CONFIGS["llama-3.1-8b"]
    float_w, float_kv = estimate_bytes(cfg, 2)
    int4_w, fp8_kv = estimate_bytes(cfg, 2, quant=quant_format(cfg, "gptq", "dummy"), kv_itemsize=1)
    assert fp8_kv * 2 == float_kv
    embed = 2 * 128256 * 4096 * 2  # embeddings and LM head stay bf16
    assert (int4_w - embed) / (float_w - embed) == pytest.approx((0.5 + 2.5 / 128) / 2, rel=1e-3)
    with pytest.raises(ValueError, match="no quantization_config"):
        quant_format(
            cfg, "awq", "auto"
        )  # float weights from a checkpoint are not AWQ: the engine's own error
