"""Loading quantized checkpoints: the format is checked before any weight is read (unknown methods and
unsupported options refused at start-up, naming what is supported; `--quantization` checked against
config.json, also by `longserve serve` before anything starts); a tensor whose dtype or companions do not fit
the declared format is an error, never a silent upcast; random weights in a format (`--load-format dummy`);
a W8A8 layer computes what its format's own library computes for the same input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from longserve import LLM, SamplingParams
from longserve.models import load_hf_config, load_model
from longserve.models.quant.config import apply_quantization
from longserve.runner import step_tokens
from longserve.testing import quant_checkpoints as qc
from longserve.testing.checkpoints import make_tiny_checkpoint
from tests.model.test_models_vs_hf import PAGE_IDS, new_cache, prompt, run_step

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


def with_quantization_config(path: str, qc_: dict | None) -> str:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if qc_ is None:
        config.pop("quantization_config", None)
    else:
        config["quantization_config"] = qc_
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("float"), "qwen3", seed=1)


@pytest.fixture(scope="module")
def gptq_ckpt(tmp_path_factory) -> str:
    return qc.write_gptq(tmp_path_factory.mktemp("gptq") / "c", "llama", bits=4, group_size=64, seed=2)


@pytest.mark.parametrize(
    ("qconfig", "message"),
    [
        ({**GPTQ, "bits": 3}, r"\(gptq\): bits 3 is not supported; supported: 4, 8"),
        ({**GPTQ, "group_size": 100}, r"group_size 100 is not supported; supported: -1 \(per channel\), or a multiple of 16"),
        ({**GPTQ, "lm_head": True}, r"lm_head: true \(a quantized LM head\) is not supported"),
        ({**GPTQ, "checkpoint_format": "marlin"}, r"checkpoint_format 'marlin' is not supported; supported: gptq, gptq_v2"),
        ({**GPTQ, "dynamic": {"+:.*down_proj": {"bits": 2}}}, r"bits 2 is not supported"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, r"version 'gemv' \(packing\) is not supported; supported: gemm"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, r"zero_point: false is not supported"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, r"fmt 'e5m2' is not supported; supported: e4m3"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, r"static activations with block scales"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}, "format": "int-quantized"},
         r"int4 weights with these activations is not supported; supported: pack-quantized W4A16/W8A16"),
        ({"quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": {"num_bits": 8}}, r"a quantized KV cache scheme \(kv_cache_scheme\) is not supported"),
        ({"quant_method": "bitsandbytes"}, r"quantization 'bitsandbytes' is not supported; supported: awq, compressed-tensors, fp8, gptq"),
        ({"bits": 4}, r"quantization_config without a quant_method"),
    ],
    ids=["gptq-bits3", "gptq-group", "gptq-lm-head", "gptq-marlin", "gptq-dynamic", "awq-gemv", "awq-no-zero",
         "fp8-e5m2", "fp8-block-static", "ct-w4a8", "ct-kv-cache", "bnb", "no-method"],
)  # fmt: skip
def test_unsupported_configs_are_refused_before_any_weight_is_read(float_ckpt, tmp_path, qconfig, message):
    path = with_quantization_config(make_tiny_checkpoint(tmp_path / "c", "qwen3", seed=1), qconfig)
    os.remove(os.path.join(path, "model.safetensors"))  # nothing could be read: the refusal comes first
    with pytest.raises(ValueError, match=message):
        apply_quantization(load_hf_config(path), None)
    with pytest.raises(ValueError, match=message):
        load_model(path, load_hf_config(path), torch.float32, CPU)


def test_quantization_flag_forces_or_checks(float_ckpt, gptq_ckpt):
    assert (
        apply_quantization(load_hf_config(gptq_ckpt), "gptq_marlin").quantization_config["quant_method"]
        == "gptq"
    )
    with pytest.raises(
        ValueError,
        match=r"--quantization awq disagrees with config.json's quantization_config \(quant_method 'gptq'\)",
    ):
        apply_quantization(load_hf_config(gptq_ckpt), "awq")
    with pytest.raises(
        ValueError, match=r"--quantization gptq: config.json has no quantization_config.*only fp8 quantizes"
    ):
        apply_quantization(load_hf_config(float_ckpt), "gptq")
    online = apply_quantization(load_hf_config(float_ckpt), "fp8").quantization_config
    assert online == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "is_checkpoint_fp8_serialized": False,
    }
    dummy = apply_quantization(load_hf_config(float_ckpt), "gptq", load_format="dummy").quantization_config
    assert dummy["bits"] == 4 and dummy["group_size"] == 128


def test_serve_refuses_at_start_up(float_ckpt, tmp_path):
    """`longserve serve` exits 2 with the message before anything starts (no weights loaded)."""
    bad = with_quantization_config(
        make_tiny_checkpoint(tmp_path / "bad", "qwen3", seed=1), {**GPTQ, "bits": 2}
    )
    for args, message in (([bad], "bits 2 is not supported; supported: 4, 8"),
                          ([float_ckpt, "--quantization", "awq"], "--quantization awq: config.json has no"),
                          ([float_ckpt, "--quantization", "hqq"], "quantization must be one of awq, compressed-tensors")):  # fmt: skip
        out = subprocess.run([sys.executable, "-m", "longserve", "serve", "--device", "cpu", "--model-path", *args],
                             cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
        assert "Loading weights" not in out.stderr


def rewrite(path: str, edit) -> str:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def test_fp8_weights_without_their_format_are_refused_not_upcast(tmp_path):
    """A checkpoint holding e4m3 weights (their scales dropped, or config.json without quantization_config)
    loads as garbage in a loader that upcasts; here it is an error naming the tensor."""
    path = qc.write_fp8_block(tmp_path / "fp8", "qwen3", block=(64, 64), seed=3)
    with_quantization_config(path, None)
    rewrite(path, lambda t: [t.pop(k) for k in list(t) if k.endswith("weight_scale_inv")])
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.0\.\w+\.\w+_proj\.weight' is float8_e4m3fn: quantized values, but config\.json declares no quantization",
    ):
        load_model(path, load_hf_config(path), torch.float32, CPU)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.update({"model.layers.1.mlp.up_proj.qzeros": t["model.layers.1.mlp.up_proj.qzeros"].half()}),
         r"'model\.layers\.1\.mlp\.up_proj\.qzeros' is float16, but the checkpoint's quantization format stores it as int32"),
        (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(128, 128)}),
         r"checkpoint tensor 'model\.layers\.0\.self_attn\.o_proj\.weight' matches no parameter"),
        (lambda t: t.pop("model.layers.0.self_attn.k_proj.scales"),
         r"missing weights for parameters: model\.layers\.0\.self_attn\.qkv_proj\.scales"),
        (lambda t: t.update({"model.layers.0.self_attn.v_proj.g_idx": t["model.layers.0.self_attn.v_proj.g_idx"].flip(0)}),
         r"'model\.layers\.0\.self_attn\.v_proj\.g_idx' differs between the fused shards q, k, v"),
    ],
    ids=["wrong-dtype", "float-where-quantized", "missing-scales", "shards-g_idx"],
)  # fmt: skip
def test_tensors_that_do_not_fit_the_format_are_errors(gptq_ckpt, tmp_path, edit, message):
    import shutil

    path = shutil.copytree(gptq_ckpt, tmp_path / "c")
    rewrite(str(path), edit)
    with pytest.raises(ValueError, match=message):
        load_model(str(path), load_hf_config(str(path)), torch.float32, CPU)


def test_dummy_weights_in_a_format(tmp_path):
    """--load-format dummy with --quantization: random packed weights and scales, deterministic per seed,
    finite logits and a model that is not degenerate; FP8 blocks through --hf-overrides' quantization_config."""
    float_ckpt = str(tmp_path / "f")
    qc.tiny_float_model(float_ckpt, "qwen3", seed=1).save_pretrained(float_ckpt)
    for quantization, overrides in (("gptq", None), ("awq", None), ("fp8", None),
                                    (None, {"quant_method": "fp8", "weight_block_size": [32, 32]})):  # fmt: skip
        models = []
        for _ in range(2):
            cfg = load_hf_config(float_ckpt)
            if overrides:
                cfg.quantization_config = overrides
            apply_quantization(cfg, quantization, "dummy")
            models.append(load_model(float_ckpt, cfg, torch.float32, CPU, load_format="dummy", seed=5))
        qkv = models[0].model.layers[0].self_attn.qkv_proj
        kind = type(qkv.quant_method).__name__
        assert kind == ("Fp8LinearMethod" if quantization in ("fp8", None) else "WNA16LinearMethod")
        for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
            assert torch.equal(a, b), name
        ids = prompt(models[0].vocab_size, 16)
        logits = run_step(models[0], new_cache(models[0]), [ids], [0], [PAGE_IDS])
        assert torch.isfinite(logits).all() and logits.std() > 0.01, (quantization, overrides)
        assert len(set(logits.argmax(-1).tolist())) > 2


def test_the_llm_api_serves_a_quantized_checkpoint(gptq_ckpt):
    with LLM(gptq_ckpt, dtype="float32", device="cpu", max_total_tokens=512) as llm:
        out = llm.generate(
            [list(range(5, 30))], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        )
        assert len(out[0].token_ids) == 8
        llm.engine.check_integrity()


def test_a_dequantizing_model_takes_larger_lone_steps(float_ckpt, gptq_ckpt, monkeypatch):
    """Integer weights are dequantized once a step at prefill sizes, so on a GPU a lone prompt of such a model
    takes steps of 32K tokens unless configured (runner/step_tokens.py; the CPU as one of DEQUANT_LONE_DEVICES
    here); a float one keeps the usual budget, a configured size wins, a CPU keeps the usual steps, and the tokens
    are those of the usual steps."""
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    ids = list(range(5, 105))
    outs = {}
    for name, path, kw, lone in [
        ("gptq-on-a-cpu", gptq_ckpt, {}, None),
        ("float", float_ckpt, {}, None),
        ("gptq-set", gptq_ckpt, {"lone_prefill_chunk_size": 16}, 16),
        ("gptq", gptq_ckpt, {}, 32768),
        ("gptq-large-steps", gptq_ckpt, {"chunked_prefill_size": 32768}, None),
    ]:
        if name == "float":  # from here on, the CPU stands for a GPU
            monkeypatch.setattr(step_tokens, "DEQUANT_LONE_DEVICES", ("cuda", "cpu"))
        with LLM(path, dtype="float32", device="cpu", max_total_tokens=512, **kw,
                 **({} if "chunked_prefill_size" in kw else {"chunked_prefill_size": 16})) as llm:  # fmt: skip
            assert llm.engine.scheduler.config.lone_prefill_chunk_size == lone, name
            assert llm.engine.runner.max_step_prompt_tokens == max(lone or 0, llm.config.chunked_prefill_size)
            steps = []
            schedule = llm.engine.scheduler.schedule

            def recorded(schedule=schedule, steps=steps):
                out = schedule()
                steps.extend(x.num_new_tokens for x in out.scheduled if not x.request.output_token_ids)
                return out

            llm.engine.scheduler.schedule = recorded
            outs[name] = llm.generate([ids], greedy)[0].token_ids
            llm.engine.check_integrity()
        assert steps == ([100] if name in ("gptq", "gptq-large-steps") else [16] * 6 + [4]), (name, steps)
    assert outs["gptq"] == outs["gptq-set"] == outs["gptq-large-steps"] == outs["gptq-on-a-cpu"]


def test_the_models_own_lone_step_shrinks_to_what_warm_up_holds(gptq_ckpt, monkeypatch):
    """Out of device memory at warm-up in a pass past the usual step, the model's own lone step shrinks to the
    largest pass that ran (with a warning), and the scheduler takes it; a configured one is refused, named."""
    monkeypatch.setattr(step_tokens, "DEQUANT_LONE_DEVICES", ("cuda", "cpu"))  # the CPU stands for a GPU
    with LLM(gptq_ckpt, dtype="float32", device="cpu", max_total_tokens=512, chunked_prefill_size=16) as llm:
        model = llm.engine.runner.model
        forward = type(model).forward

        def short_of_memory(self, input_ids, *args, **kwargs):
            if input_ids.numel() > 40:  # as a device with little room beside the KV pool
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return forward(self, input_ids, *args, **kwargs)

        monkeypatch.setattr(type(model), "forward", short_of_memory)
        llm.engine.warm_up(counts=[16, 32, 64])
        assert (
            llm.engine.runner.lone_prefill_chunk_size
            == 32
            == llm.engine.scheduler.config.lone_prefill_chunk_size
        )
        assert llm.engine.runner.max_step_prompt_tokens == 32
        llm.engine.warm_up(counts=[16, 64])  # nothing past 16 fits now: the usual steps
        assert llm.engine.scheduler.config.lone_prefill_chunk_size is None
        monkeypatch.undo()
        greedy = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(llm.generate([list(range(5, 105))], greedy)[0].token_ids) == 4
        llm.engine.check_integrity()
    with LLM(gptq_ckpt, dtype="float32", device="cpu", max_total_tokens=512, chunked_prefill_size=16,
             lone_prefill_chunk_size=64) as llm:  # fmt: skip
        monkeypatch.setattr(type(llm.engine.runner.model), "forward", short_of_memory)
        with pytest.raises(
            RuntimeError, match="warm-up ran out of device memory in a step of 64 prompt tokens"
        ):
            llm.engine.warm_up(counts=[16, 32, 64])
        assert llm.engine.scheduler.config.lone_prefill_chunk_size == 64


def test_w8a8_layers_compute_what_compressed_tensors_computes(tmp_path):
    """Given the same input, each projection of a compressed-tensors W8A8 model (INT8 and FP8, dynamic and
    static activation scales) equals the library's own quantized forward in transformers."""
    from transformers import AutoModelForCausalLM

    for scheme in ("W8A8", "FP8", "FP8_DYNAMIC", "FP8_BLOCK"):
        kw = {"block": (32, 32)} if scheme == "FP8_BLOCK" else {}
        path = qc.write_compressed_tensors(tmp_path / scheme, "qwen3", scheme, seed=6, **kw)
        ours = load_model(path, load_hf_config(path), torch.float32, CPU)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            hf(torch.arange(4, 9)[None])  # compressed-tensors decompresses on the first forward
            x = torch.randn(7, 128, generator=torch.Generator().manual_seed(0))
            h, o = hf.model.layers[1], ours.model.layers[1]
            q, k, v = o.self_attn.qkv_proj.split(o.self_attn.qkv_proj(x))
            for ref, got in ((h.self_attn.q_proj(x[None])[0], q), (h.self_attn.v_proj(x[None])[0], v),
                             (h.mlp.up_proj(x[None])[0], o.mlp.gate_up_proj.split(o.mlp.gate_up_proj(x))[1]),
                             (h.self_attn.o_proj(x[None])[0], o.self_attn.o_proj(x))):  # fmt: skip
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=scheme)
            x2 = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
            torch.testing.assert_close(
                o.mlp.down_proj(x2), h.mlp.down_proj(x2[None])[0], atol=1e-5, rtol=1e-5
            )


def test_compressed_tensors_group_actorder_reads_weight_g_idx(tmp_path):
    """compressed-tensors before 0.20 wrote actorder "group" checkpoints with a weight_g_idx per module (0.20
    removed the option); read as GPTQ's act order. Relabelling every module's groups (g_idx = perm[k // g],
    the scales' and zero points' columns moved alike) leaves the weights, hence the logits, unchanged, while
    every layer now reads its groups through g_idx."""
    path = qc.write_compressed_tensors(tmp_path / "ct", "qwen3", "W4A16_ASYM", group_size=32, seed=8)
    before = load_model(path, load_hf_config(path), torch.float32, CPU)
    gen = torch.Generator().manual_seed(0)

    perms: dict[str, torch.Tensor] = {}  # the modules of a fused layer read one input: one relabelling

    def relabel(t):
        for name in [k for k in t if k.endswith(".weight_packed")]:
            m = name.removesuffix(".weight_packed")
            scale, zp = t[f"{m}.weight_scale"], t[f"{m}.weight_zero_point"]
            key = m.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            perm = perms.setdefault(key, torch.randperm(scale.shape[1], generator=gen))
            k = t[f"{m}.weight_shape"][1].item()
            t[f"{m}.weight_g_idx"] = perm[torch.arange(k) // 32].to(torch.int32)
            t[f"{m}.weight_scale"], t[f"{m}.weight_zero_point"] = (
                torch.empty_like(scale),
                torch.empty_like(zp),
            )
            t[f"{m}.weight_scale"][:, perm], t[f"{m}.weight_zero_point"][:, perm] = scale, zp

    rewrite(path, relabel)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    after = load_model(path, load_hf_config(path), torch.float32, CPU)
    assert after.model.layers[0].self_attn.qkv_proj.int_g_idx is not None
    ids = prompt(after.vocab_size, 16)
    torch.testing.assert_close(
        run_step(after, new_cache(after), [ids], [0], [PAGE_IDS]),
        run_step(before, new_cache(before), [ids], [0], [PAGE_IDS]), atol=1e-5, rtol=1e-5,
    )  # fmt: skip
