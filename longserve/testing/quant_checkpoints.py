"""Tiny quantized checkpoints in each format's exact on-disk layout, for tests and dev scripts.

Written by the format's own library where it installs on a CPU machine:
    compressed-tensors   compressed_tensors itself (apply_quantization_config, its calculate_qparams from each
                         weight's min/max, ModelCompressor.compress_model, update_config): what llm-compressor
                         writes after an RTN (min-max) recipe; static activation scales from a calibration pass
    awq                  AutoAWQ's WQLinear_GEMM.from_linear (its packing and interleaved order)
    fp8                  transformers' own FP8 quantizer (Fp8Quantize: weight + weight_scale_inv per block),
                         config as the official Qwen3 FP8 checkpoints have it
and otherwise by `write_gptq` here (GPTQModel needs CUDA packages): AutoGPTQ's layout, packing as AutoGPTQ's
QuantLinear.pack does (round-to-nearest with min/max or abs-max scales: the format, not GPTQ's error
feedback; the grid and the packing live in gptq_packing.py); tests/model/test_quantized_models.py checks it
against AutoGPTQ's unpacking code, quoted there.

Every model starts as a tiny random transformers model (`tiny_float_model`: make_tiny_checkpoint's tokenizer
and config with dims where 32/64/128-element groups fit); MoE experts are written one tensor per expert, as
published checkpoints are. `dequantized_checkpoint` writes the float model a quantized checkpoint stands for
(what transformers then runs as the reference).
"""

from __future__ import annotations

import json
import os
import shutil
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from longserve.testing.checkpoints import SPECIAL_TOKENS, make_tiny_checkpoint

# write_gptq's grid and packing; tests/model/test_quantized_models.py reads them here (qc.gptq_pack)
from longserve.testing.gptq_packing import gptq_pack, gptq_quantize

# dims of the quantized tiny models: every K a multiple of 128 (groups of 32/64/128), q/k/v shards and the
# MoE intermediate multiples of 32 (fp8 blocks, packing) also under tensor parallelism 2
DENSE_DIMS = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32, "num_attention_heads": 4,
              "num_key_value_heads": 2}  # fmt: skip
MOE_DIMS = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32, "num_attention_heads": 4,
            "num_key_value_heads": 2, "moe_intermediate_size": 64}  # fmt: skip
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_INPUT_GROUPS = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}


def tiny_float_model(path: str | os.PathLike, arch: str, seed: int, num_layers: int | None = None) -> Any:
    """make_tiny_checkpoint's files (tokenizer, generation config) in `path` with a float32 transformers
    model of larger dims (DENSE_DIMS / MOE_DIMS), its special tokens shrunk alike; returns the model (the
    directory's weights are rewritten by the format writers)."""
    import transformers

    path = make_tiny_checkpoint(path, arch, seed=seed, num_layers=num_layers)
    # a vision-language checkpoint's text model alone (Qwen3.5-MoE): `model.*` names, its text config
    config = transformers.AutoConfig.from_pretrained(path)
    config = getattr(config, "text_config", config)
    dims = MOE_DIMS if hasattr(config, "moe_intermediate_size") or arch == "mixtral" else DENSE_DIMS
    for key, value in dims.items():
        if key == "moe_intermediate_size" and arch == "mixtral":
            config.intermediate_size = value  # Mixtral's experts are intermediate_size wide
        elif key != "intermediate_size" or arch != "mixtral":
            setattr(config, key, value)
    if getattr(config, "shared_expert_intermediate_size", None):
        config.shared_expert_intermediate_size = 128
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for emb in {id(e): e for e in (model.get_input_embeddings(), model.get_output_embeddings())}.values():
            emb.weight[: len(SPECIAL_TOKENS)] *= 0.05
    for name in os.listdir(path):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            os.remove(os.path.join(path, name))
    return model.eval()


def float_weights(model: Any) -> dict[str, torch.Tensor]:
    """The model's tensors as a checkpoint names them: experts one 2D tensor per expert and projection."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out: dict[str, torch.Tensor] = {}
    mixtral = model.config.model_type == "mixtral"
    for name, tensor in state.items():
        if name.endswith(".experts.gate_up_proj"):
            base = name.removesuffix(".gate_up_proj")
            if mixtral:
                base = base.replace(".mlp.experts", ".block_sparse_moe.experts")
            gate, up = tensor.chunk(2, dim=1)  # [E, I, H] each
            for e in range(tensor.shape[0]):
                out[f"{base}.{e}.{'w1' if mixtral else 'gate_proj'}.weight"] = gate[e].contiguous()
                out[f"{base}.{e}.{'w3' if mixtral else 'up_proj'}.weight"] = up[e].contiguous()
        elif name.endswith(".experts.down_proj"):
            base = name.removesuffix(".down_proj")
            if mixtral:
                base = base.replace(".mlp.experts", ".block_sparse_moe.experts")
            for e in range(tensor.shape[0]):
                out[f"{base}.{e}.{'w2' if mixtral else 'down_proj'}.weight"] = tensor[e].contiguous()
        else:
            out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.") if mixtral else name] = tensor
    return out


def is_quantizable(name: str) -> bool:
    """A linear projection's weight (attention, MLP, experts, shared expert); not the router, norms,
    embeddings or the LM head."""
    if not name.endswith(".weight"):
        return False
    proj = name.rsplit(".", 2)[-2]
    return proj in _LINEARS or proj in ("w1", "w2", "w3")


def _input_key(name: str) -> str:
    """Modules that read the same input (q/k/v; gate/up; one expert's gate/up) share GPTQ's act order."""
    module = name.removesuffix(".weight")
    prefix, _, proj = module.rpartition(".")
    shared = _INPUT_GROUPS.get(proj) or {"w1": "mlp", "w3": "mlp"}.get(proj)
    return f"{prefix}.{shared}" if shared else module


def _save(path: str, tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> str:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if quantization_config is None:
        config.pop("quantization_config", None)
    else:
        config["quantization_config"] = quantization_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def _save_model_config(model: Any, path: str) -> None:
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)


# ---------------------------------------------------------------------------------------------- GPTQ


def write_float(
    path: str | os.PathLike, arch: str = "qwen3", *, seed: int = 0, num_layers: int | None = None
) -> str:
    """The float checkpoint the format writers quantize for the same arch and seed (their original)."""
    path = str(path)
    model = tiny_float_model(path, arch, seed, num_layers)
    _save_model_config(model, path)
    return _save(path, float_weights(model), None)


def write_gptq(
    path: str | os.PathLike,
    arch: str = "qwen3",
    *,
    bits: int = 4,
    group_size: int = 128,
    desc_act: bool = False,
    sym: bool = True,
    dynamic: dict | None = None,
    seed: int = 0,
    num_layers: int | None = None,
) -> str:
    """A GPTQ checkpoint (AutoGPTQ / GPTQModel v1 layout). `dynamic`: GPTQModel's per-module rules; modules a
    "-:" rule matches stay float (`.weight`). desc_act: each input's columns in a random order (shared by
    the modules reading that input), g_idx as GPTQ's act order writes it."""
    import re

    path = str(path)
    model = tiny_float_model(path, arch, seed, num_layers)
    gen = torch.Generator().manual_seed(seed + 1)
    perms: dict[str, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, w in float_weights(model).items():
        module = name.removesuffix(".weight")
        skip = any(p.startswith("-:") and re.match(p[2:], module) for p in (dynamic or {}))
        if not is_quantizable(name) or skip:
            tensors[name] = w
            continue
        k = w.shape[1]
        group = group_size if group_size > 0 else k
        if desc_act:
            perm = perms.setdefault(_input_key(name), torch.randperm(k, generator=gen))
            g_idx = (torch.argsort(perm) // group).to(torch.int32)  # column perm[i] is the i-th quantized
        else:
            g_idx = (torch.arange(k) // group).to(torch.int32)
        qd = gptq_quantize(w, bits, group, sym, g_idx)
        qweight, qzeros = gptq_pack(qd["q"], qd["zeros"], bits)
        tensors.update({f"{module}.qweight": qweight, f"{module}.qzeros": qzeros,
                        f"{module}.scales": qd["scales"], f"{module}.g_idx": g_idx})  # fmt: skip
    _save_model_config(model, path)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
          "checkpoint_format": "gptq", "lm_head": False}  # fmt: skip
    if dynamic:
        qc["dynamic"] = dynamic
    return _save(path, tensors, qc)


# ----------------------------------------------------------------------------------------------- AWQ


def write_awq(path: str | os.PathLike, arch: str = "qwen3", *, group_size: int = 128, seed: int = 0,
              num_layers: int | None = None) -> str:  # fmt: skip
    """An AWQ GEMM checkpoint packed by AutoAWQ's WQLinear_GEMM.from_linear, with the asymmetric min-max
    scales and zero points of AutoAWQ's pseudo_quantize_tensor."""
    with warnings.catch_warnings():  # AutoAWQ's deprecation notice on import
        warnings.simplefilter("ignore", DeprecationWarning)
        from awq.modules.linear.gemm import WQLinear_GEMM

    path = str(path)
    model = tiny_float_model(path, arch, seed, num_layers)
    tensors: dict[str, torch.Tensor] = {}
    for name, w in float_weights(model).items():
        if not is_quantizable(name):
            tensors[name] = w
            continue
        n, k = w.shape
        wg = w.reshape(n, k // group_size, group_size)
        hi, lo = wg.amax(dim=2), wg.amin(dim=2)
        # AutoAWQ's min-max scales (a little wider: from_linear rounds without clamping, so no value may
        # round past 15 into the next nibble)
        scales = ((hi - lo).clamp(min=1e-5) / 14.5).half().float()  # [N, G]
        zeros = (-torch.round(lo / scales)).clamp(0, 15)  # [N, G]
        linear = torch.nn.Linear(k, n, bias=False)
        linear.weight.data = w.clone()
        q = WQLinear_GEMM.from_linear(
            linear, 4, group_size, scales=scales.t().contiguous(), zeros=zeros.t().contiguous()
        )
        module = name.removesuffix(".weight")
        tensors.update(
            {f"{module}.qweight": q.qweight, f"{module}.qzeros": q.qzeros, f"{module}.scales": q.scales}
        )
    _save_model_config(model, path)
    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
          "modules_to_not_convert": None}  # fmt: skip
    return _save(path, tensors, qc)


# ----------------------------------------------------------------------------------------------- FP8


def write_fp8_block(path: str | os.PathLike, arch: str = "qwen3", *, block: tuple[int, int] = (128, 128),
                    seed: int = 0, num_layers: int | None = None) -> str:  # fmt: skip
    """The official Qwen3 / DeepSeek FP8 layout: e4m3 `weight` + float32 `weight_scale_inv` per block,
    quantized by transformers' own FP8 quantizer (Fp8Quantize), one tensor per expert."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    path = str(path)
    model = tiny_float_model(path, arch, seed, num_layers)
    quantizer = Fp8Quantize(
        types.SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=block))
    )
    tensors: dict[str, torch.Tensor] = {}
    for name, w in float_weights(model).items():
        if not is_quantizable(name):
            tensors[name] = w
            continue
        out = quantizer.convert({name: w.to(torch.bfloat16)})
        if out[name].dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name} {tuple(w.shape)} does not divide into blocks {block}")
        tensors.update(out)
    _save_model_config(model, path)
    qc = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(block),
    }
    return _save(path, tensors, qc)


# ---------------------------------------------------------------------------------- compressed-tensors


CT_SCHEMES = ("W4A16", "W4A16_ASYM", "W8A16", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "W8A8")


def write_compressed_tensors(path: str | os.PathLike, arch: str = "qwen3", scheme: str = "W4A16", *,
                             group_size: int | None = None, block: tuple[int, int] | None = None,
                             actorder: str | None = None, seed: int = 0, num_layers: int | None = None,
                             ignore: tuple[str, ...] = ("lm_head",)) -> str:  # fmt: skip
    """compressed-tensors writes a preset scheme (llm-compressor's names) over every Linear but `ignore`:
    weights' scales and zero points from their min/max by its calculate_qparams, static input scales from the
    activations of a calibration prompt, compression and config by its ModelCompressor. (Dense models only:
    transformers 5 holds MoE experts as 3D tensors, which compressed-tensors does not target.)"""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.utils import calculate_qparams

    path = str(path)
    model = tiny_float_model(path, arch, seed, num_layers)
    preset = {k: v.model_copy() for k, v in PRESET_SCHEMES[scheme].items()}
    weights = preset["weights"]
    if group_size is not None:
        weights.group_size = group_size
    if actorder is not None:
        weights.actorder = actorder
    if block is not None:
        weights.block_structure = list(block)
        preset["input_activations"].group_size = block[1]
    qconfig = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **preset)},
                                 ignore=list(ignore))  # fmt: skip
    static = "input_activations" in preset and not preset["input_activations"].dynamic
    amax = _calibrate_inputs(model) if static else {}
    apply_quantization_config(model, qconfig)
    gen = torch.Generator().manual_seed(seed + 2)
    for name, module in model.named_modules():
        if not hasattr(module, "weight_scale"):
            continue
        args = module.quantization_scheme.weights
        w = module.weight.data
        lo, hi = _strategy_min_max(w, args)
        scale, zero = calculate_qparams(lo, hi, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
        if hasattr(module, "weight_g_idx"):  # actorder group: the groups' columns in a random order
            g = args.group_size
            module.weight_g_idx.data.copy_(torch.argsort(torch.randperm(w.shape[1], generator=gen)) // g)
            _regroup(module, args, calculate_qparams)
        if static:
            a_lo, a_hi = -amax[name].reshape(1), amax[name].reshape(1)
            module.input_scale.data.copy_(
                calculate_qparams(a_lo, a_hi, module.quantization_scheme.input_activations)[0]
            )
    fmt = "pack-quantized" if scheme.startswith("W") and "A16" in scheme else None
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    compressor.update_config(path)
    return path


def _strategy_min_max(w: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == "tensor":
        return w.min().reshape(1), w.max().reshape(1)
    if strategy == "channel":
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    if strategy == "group":
        wg = w.unflatten(1, (-1, args.group_size))
        return wg.amin(dim=2), wg.amax(dim=2)
    bn, bk = args.block_structure
    wb = w.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))  # [N/bn, bn, K/bk, bk]
    return wb.amin(dim=(1, 3)), wb.amax(dim=(1, 3))


def _regroup(module: Any, args: Any, calculate_qparams: Callable) -> None:
    """Act order: each group's scale from the columns g_idx puts in it."""
    w, g_idx = module.weight.data, module.weight_g_idx.data.long()
    groups = module.weight_scale.shape[1]
    lo = torch.stack([w[:, g_idx == g].amin(dim=1) for g in range(groups)], dim=1)
    hi = torch.stack([w[:, g_idx == g].amax(dim=1) for g in range(groups)], dim=1)
    scale, zero = calculate_qparams(lo, hi, args)
    module.weight_scale.data.copy_(scale)
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero)


def _calibrate_inputs(model: Any) -> dict[str, torch.Tensor]:
    """The largest |input| of each Linear over a calibration prompt (a static activation scale's range)."""
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):

            def hook(mod, inputs, name=name):
                value = inputs[0].detach().abs().max()
                amax[name] = torch.maximum(amax.get(name, value), value)

            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(torch.arange(4, 68)[None] % model.config.vocab_size)
    for h in hooks:
        h.remove()
    return amax


# ------------------------------------------------------------------------------------- the reference


def dequantized_checkpoint(src: str, dst: str | os.PathLike, weights: dict[str, torch.Tensor]) -> str:
    """A float checkpoint in `dst` with `src`'s tokenizer and config (no quantization_config) and the given
    (dequantized) weights, named as checkpoints name them; transformers loads it as the reference."""
    dst = str(dst)
    shutil.copytree(
        src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"), dirs_exist_ok=True
    )
    return _save(dst, weights, None)
