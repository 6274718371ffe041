"""Quantized checkpoints, each in its format's exact on-disk layout (longserve/testing/quant_checkpoints.py:
written by compressed-tensors, AutoAWQ and transformers' FP8 quantizer themselves; GPTQ's by a helper whose
packing is checked here against AutoGPTQ's own unpacking), loaded by longserve in float32: the prefill logits
equal those of transformers running the dequantized weights (dequantized by each format's reference code),
with the activations quantized as the format does at run time (W8A8), and 32 greedy tokens match. Dense and
MoE models, GPTQ's `dynamic` rules, act order, symmetric and asymmetric zero points, 4 and 8 bits, groups of
32/64/128 and per channel."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file

from longserve.models import load_hf_config, load_model, moe
from longserve.models.quant.config import apply_quantization
from longserve.testing import quant_checkpoints as qc
from tests.model.test_models_vs_hf import PAGE_IDS, new_cache, prompt, run_step

CPU = torch.device("cpu")


# --- the formats' reference dequantization --------------------------------------------------------------


def autogptq_dequantize(qweight, qzeros, scales, g_idx, bits) -> torch.Tensor:
    """Quoted from AutoGPTQ, auto_gptq/nn_modules/qlinear/qlinear_cuda.py (AutoGPTQ/AutoGPTQ, commit 058fd80a),
    QuantLinear.forward's torch fallback for bits in [2, 4, 8]; `self.` attributes are arguments here, and
    the scales are float32 (AutoGPTQ multiplies in float16, which would round the weights). Returns [N, K]."""
    scales = scales.float()
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(
        torch.unsqueeze(qzeros, 2).expand(-1, -1, 32 // bits), wf.unsqueeze(0)
    ).to(torch.int16 if bits == 8 else torch.int8)
    zeros = torch.bitwise_and(zeros, (2**bits) - 1)
    zeros = zeros + 1
    zeros = zeros.reshape(scales.shape)
    weight = torch.bitwise_right_shift(
        torch.unsqueeze(qweight, 1).expand(-1, 32 // bits, -1), wf.unsqueeze(-1)
    ).to(torch.int16 if bits == 8 else torch.int8)
    weight = torch.bitwise_and(weight, (2**bits) - 1)
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    weights = scales[g_idx.long()] * (weight - zeros[g_idx.long()])
    return weights.T.contiguous()


def dequantize_gptq_checkpoint(path: str, bits: int) -> dict[str, torch.Tensor]:
    tensors = load_file(os.path.join(path, "model.safetensors"))
    out = {k: v for k, v in tensors.items() if not k.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))}
    for name in [k for k in tensors if k.endswith(".qweight")]:
        m = name.removesuffix(".qweight")
        out[f"{m}.weight"] = autogptq_dequantize(
            tensors[name], tensors[f"{m}.qzeros"], tensors[f"{m}.scales"], tensors[f"{m}.g_idx"], bits
        )
    return out


def dequantize_awq_checkpoint(path: str, group_size: int) -> dict[str, torch.Tensor]:
    """AutoAWQ's own dequantize_gemm (awq.utils.packing_utils), with float32 scales."""
    with warnings.catch_warnings():  # AutoAWQ's deprecation notice on import
        warnings.simplefilter("ignore", DeprecationWarning)
        from awq.utils.packing_utils import dequantize_gemm

    tensors = load_file(os.path.join(path, "model.safetensors"))
    out = {k: v for k, v in tensors.items() if not k.endswith((".qweight", ".qzeros", ".scales"))}
    for name in [k for k in tensors if k.endswith(".qweight")]:
        m = name.removesuffix(".qweight")
        w = dequantize_gemm(
            tensors[name], tensors[f"{m}.qzeros"], tensors[f"{m}.scales"].float(), 4, group_size
        )
        out[f"{m}.weight"] = w.T.contiguous()
    return out


def dequantize_ct_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """compressed-tensors' own decompression of pack-quantized modules (PackedQuantizationCompressor): the
    reference where transformers 5.24 cannot load the checkpoint itself (it expects unpacked asymmetric zero
    points)."""
    import json

    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    with open(os.path.join(path, "config.json")) as f:
        groups = json.load(f)["quantization_config"]["config_groups"]
    scheme = QuantizationScheme.model_validate(next(iter(groups.values())))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    out = {k: v for k, v in tensors.items() if not k.rsplit(".", 1)[-1].startswith("weight_")}
    for name in [k for k in tensors if k.endswith(".weight_packed")]:
        m = name.removesuffix(".weight_packed")
        state = {k.removeprefix(m + "."): v for k, v in tensors.items() if k.startswith(m + ".weight_")}
        out[f"{m}.weight"] = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    return out


def deepseek_act_quant(x: torch.Tensor, block: int) -> torch.Tensor:
    """The FP8 block recipe's activation quantization, quoted from DeepSeek-V3's inference/kernel.py
    (deepseek-ai/DeepSeek-V3, act_quant_kernel: `s = tl.max(tl.abs(x)) / 448.; y = x / s; y.to(e4m3)`), per
    token-group of `block`, dequantized again (y * s) for the float reference."""
    shape = x.shape
    g = x.float().reshape(-1, shape[-1] // block, block)
    s = g.abs().amax(dim=-1, keepdim=True) / 448.0
    y = (g / s).to(torch.float8_e4m3fn)
    return (y.float() * s).reshape(shape).to(x.dtype)


@contextlib.contextmanager
def quantized_inputs(hf: torch.nn.Module, fake_quant: Callable[[torch.Tensor], torch.Tensor]):
    """While active, the input of every quantized projection of `hf` (attention, MLP, experts: the ones
    ending in _proj, and the experts' stacked tensors, sliced per expert by the eager implementation) goes
    through `fake_quant` first: transformers' forward with run-time activation quantization."""
    ids = {id(p) for n, p in hf.named_parameters() if "_proj" in n and "lm_head" not in n}
    real = torch.nn.functional.linear

    def linear(x, weight, bias=None):
        base = weight._base if weight._base is not None else weight
        if id(weight) in ids or id(base) in ids:
            x = fake_quant(x)
        return real(x, weight, bias)

    torch.nn.functional.linear = linear
    try:
        yield
    finally:
        torch.nn.functional.linear = real


# --- the cases -------------------------------------------------------------------------------------------

MOE_DYNAMIC = {"-:.*attn.*": {}, "-:.*shared_expert.*": {}}  # the official Qwen3.5 GPTQ-Int4 recipe's rules


def _gptq(arch, bits, group, desc_act, sym, dynamic=None):
    def write(path):
        return qc.write_gptq(path, arch, bits=bits, group_size=group, desc_act=desc_act, sym=sym,
                             dynamic=dynamic, seed=3)  # fmt: skip

    return write, lambda path: dequantize_gptq_checkpoint(path, bits), None


def _awq(arch, group, num_layers=None):
    write = lambda path: qc.write_awq(path, arch, group_size=group, seed=4, num_layers=num_layers)  # noqa: E731
    return write, lambda path: dequantize_awq_checkpoint(path, group), None


def _ct(scheme, reference="transformers", **kw):
    return (lambda path: qc.write_compressed_tensors(path, "qwen3", scheme, seed=5, **kw)), reference, None


def _fp8_block(arch, block):
    return (
        (lambda path: qc.write_fp8_block(path, arch, block=block, seed=6)),
        "transformers",
        (lambda x: deepseek_act_quant(x, block[1])),
    )


CASES = {
    "gptq-int4-g128-sym": _gptq("qwen3", 4, 128, False, True),
    "gptq-int4-g32-actorder-asym": _gptq("llama", 4, 32, True, False),
    "gptq-int8-g64-bias": _gptq("qwen2", 8, 64, False, True),
    "gptq-int4-perchannel-actorder": _gptq("mistral", 4, -1, True, True),
    "gptq-int4-moe-dynamic": _gptq("qwen3_moe", 4, 32, False, True, MOE_DYNAMIC),
    "gptq-int4-moe-shared-actorder": _gptq("qwen2_moe", 4, 64, True, False),
    "awq-g128": _awq("qwen3", 128),
    "awq-g64": _awq("llama", 64),
    "awq-g64-mixtral": _awq("mixtral", 64, num_layers=1),  # AutoAWQ packs column by column: one layer
    "ct-w4a16-g128": _ct("W4A16"),
    "ct-w4a16-asym-g32": _ct("W4A16_ASYM", dequantize_ct_checkpoint, group_size=32, actorder="weight"),
    "ct-w8a16": _ct("W8A16"),
    "ct-fp8-static": _ct("FP8"),
    "ct-fp8-dynamic": _ct("FP8_DYNAMIC"),
    "ct-fp8-block": _ct("FP8_BLOCK", block=(32, 32)),
    "ct-int8-w8a8": _ct("W8A8"),
    "fp8-block-64": _fp8_block("qwen3", (64, 64)),
    "fp8-block-moe": _fp8_block("qwen3_moe", (32, 32)),
    "fp8-block-mixtral": _fp8_block("mixtral", (32, 32)),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("quant")


def load_pair(root, case: str):
    """(longserve's model, transformers' reference model, the activation fake-quantization or None)."""
    from transformers import AutoModelForCausalLM

    write, reference, act = CASES[case]
    path = write(root / case)
    ours = load_model(path, load_hf_config(path), torch.float32, CPU)
    kwargs = dict(dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    if reference == "transformers":  # transformers reads the quantized checkpoint itself (dequantizing)
        hf = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    else:
        ref = qc.dequantized_checkpoint(path, root / f"{case}-dequantized", reference(path))
        hf = AutoModelForCausalLM.from_pretrained(ref, **kwargs)
    return ours, hf.eval(), act


def hf_logits(hf, ids: torch.Tensor, act) -> torch.Tensor:
    with torch.no_grad(), quantized_inputs(hf, act) if act else contextlib.nullcontext():
        return hf(ids[None]).logits[0].float()


# W8A8 formats quantize activations at run time: an activation that float-order noise (1e-5: a different
# attention kernel, summation order) puts on the other side of a rounding boundary moves one quantization step,
# which shifts that token's logits by up to ~0.2 in these tiny random models (the layer-level tests below show
# the same inputs give the same outputs to 1e-6). Such rows are allowed (a minority, bounded), and a greedy token
# may differ only where transformers' own top-2 margin is within that bound.
FLIP_BOUND = 0.3
ACT_QUANT = {"ct-fp8-static", "ct-fp8-dynamic", "ct-fp8-block", "ct-int8-w8a8", "fp8-block-64", "fp8-block-moe",
             "fp8-block-mixtral"}  # fmt: skip


def check_logits(logits: torch.Tensor, ref: torch.Tensor, act_quant: bool) -> None:
    if not act_quant:
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
        return
    err = (logits - ref).abs().amax(dim=1)  # [T]
    assert float(err.max()) < FLIP_BOUND, err
    assert int((err > 2e-3).sum()) <= len(err) // 2, err


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_match_transformers(root, case: str) -> None:
    check_logits_and_greedy_tokens(root, case, steps=32)


def check_logits_and_greedy_tokens(root, case: str, steps: int) -> None:
    """The prompt's logits equal transformers' (fp32, the format's dequantized weights), then `steps` greedy
    tokens: transformers' own, ours following them with equal logits at each step."""
    ours, hf, act = load_pair(root, case)
    quantized = {type(m.quant_method).__name__ for m in ours.modules() if hasattr(m, "quant_method")}
    assert quantized - {"UnquantizedLinearMethod", "UnquantizedMoEMethod"}, quantized
    act_quant = case in ACT_QUANT
    ids = prompt(ours.vocab_size, 24, seed=2)
    cache = new_cache(ours)
    logits = run_step(ours, cache, [ids], [0], [PAGE_IDS])
    check_logits(logits, hf_logits(hf, ids, act), act_quant)
    # transformers' greedy decode (its KV cache) with its logits at each step; ours follows its tokens
    with torch.no_grad(), quantized_inputs(hf, act) if act else contextlib.nullcontext():
        out = hf.generate(ids[None], max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)  # fmt: skip
    tokens, near_ties = out.sequences[0, len(ids) :].tolist(), 0
    last = logits[-1]
    for step, (token, ref) in enumerate(zip(tokens, out.logits)):
        ref = ref[0].float()
        assert int(ref.argmax()) == token
        if int(last.argmax()) != token:
            top2 = ref.topk(2).values
            assert act_quant and float(top2[0] - top2[1]) < FLIP_BOUND, f"token {step}"
            near_ties += 1
        last = run_step(ours, cache, [torch.tensor([token])], [len(ids) + step], [PAGE_IDS])[-1]
    assert len(tokens) == steps and near_ties <= 3
    assert len(set(tokens)) >= 4  # not a degenerate model


def test_gptq_dynamic_rules_keep_modules_float(root) -> None:
    """The official Qwen3.5 GPTQ-Int4 recipe: attention and the shared expert stay float (`.weight`), the
    routed experts are int4; the router, embeddings and lm_head are never quantized."""
    dyn = qc.write_gptq(root / "dyn", "qwen2_moe", bits=4, group_size=64, dynamic=MOE_DYNAMIC, seed=3)
    names = load_file(os.path.join(dyn, "model.safetensors"))
    assert (
        "model.layers.1.self_attn.q_proj.weight" in names
        and "model.layers.1.mlp.experts.2.up_proj.qweight" in names
    )
    assert "model.layers.1.mlp.shared_expert.down_proj.weight" in names
    model = load_model(dyn, load_hf_config(dyn), torch.float32, CPU)
    layer = model.model.layers[1]
    kinds = {
        "attn": type(layer.self_attn.qkv_proj.quant_method).__name__,
        "shared": type(layer.mlp.shared_expert.gate_up_proj.quant_method).__name__,
        "experts": type(layer.mlp.experts.quant_method).__name__,
        "dense": type(model.model.layers[0].mlp.gate_up_proj.quant_method).__name__,
    }
    assert kinds == {"attn": "UnquantizedLinearMethod", "shared": "UnquantizedLinearMethod",
                     "experts": "WNA16MoEMethod", "dense": "WNA16LinearMethod"}  # fmt: skip


def test_gptq_packing_matches_autogptq_unpacking() -> None:
    """The GPTQ writer's packing read back by AutoGPTQ's quoted unpacking gives the quantized grid values."""
    gen = torch.Generator().manual_seed(0)
    for bits, group, sym, act_order in ((4, 32, True, False), (4, 64, False, True), (8, 128, False, False)):
        w = torch.randn(96, 256, generator=gen)
        g_idx = torch.arange(256) // group
        if act_order:
            g_idx = torch.argsort(torch.randperm(256, generator=gen)) // group
        q = qc.gptq_quantize(w, bits, group, sym, g_idx.int())
        qweight, qzeros = qc.gptq_pack(q["q"], q["zeros"], bits)
        expected = (q["q"] - q["zeros"][g_idx].T) * q["scales"].float()[g_idx].T  # [N, K]
        assert torch.equal(autogptq_dequantize(qweight, qzeros, q["scales"], g_idx.int(), bits), expected)
        assert (expected - w).abs().max() <= q["scales"].float().max()  # a real quantization of w


def test_online_fp8_quantizes_a_float_checkpoint(root) -> None:
    """--quantization fp8 on a float checkpoint: e4m3 weights with a scale per output channel (amax / 448),
    activations per token at run time; equal to transformers with the same weights and activations."""
    from transformers import AutoModelForCausalLM

    qc.tiny_float_model(root / "online", "qwen3", seed=7).save_pretrained(root / "online")
    cfg = apply_quantization(load_hf_config(str(root / "online")), "fp8")
    ours = load_model(str(root / "online"), cfg, torch.float32, CPU)
    qkv = ours.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.fp8_scale.shape == (qkv.out_features,)
    hf = AutoModelForCausalLM.from_pretrained(
        root / "online", dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():  # the reference: each weight quantized per channel, dequantized
        for name, p in hf.named_parameters():
            if "_proj" in name:
                s = p.abs().amax(dim=1, keepdim=True) / 448.0
                p.copy_((p / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s)
    ids = prompt(ours.vocab_size, 24, seed=2)

    def per_token(x):
        return deepseek_act_quant(x, x.shape[-1])

    ref = hf_logits(hf, ids, per_token)
    torch.testing.assert_close(
        run_step(ours, new_cache(ours), [ids], [0], [PAGE_IDS]), ref, atol=2e-3, rtol=2e-3
    )


# end to end, the GEMV's tile-scale path in int4 and in int8 with a bias (the act-order and asymmetric paths are
# checked op by op in tests/unit/test_quant_gemv.py: here they cost 40 s of CI under the interpreter). All 12
# integer-weight cases of CASES (MoE ones' dense layers included) passed this way at the commit that added it
# (5.5 min on the 2-core machine).
# (case, the one-row int4 GEMV of kernels/int4_gemv.py on: quant_gemv.INT4_FAST_PATH, on by default)
GEMV_CASES = [("gptq-int4-g128-sym", False), ("gptq-int4-g128-sym", True), ("gptq-int8-g64-bias", False)]


# greedy steps of the kernel-path variants below (each an interpreted GEMV launch per layer and projection): the
# decode path is the same at every step, and the reference path above checks 32. The six: 48 s on the 2-core
# machine (98 s with 32 steps, in a slower hour)
KERNEL_PATH_STEPS = 12


def count_rows(monkeypatch: pytest.MonkeyPatch, module, name: str) -> list[int]:
    """Wrap module.name (a GEMV, called with the activations first): the list of the row counts it was called
    with."""
    calls: list[int] = []
    real = getattr(module, name)

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize(("case", "int4_fast"), GEMV_CASES)
def test_wna16_models_through_the_gemv_kernel(
    root, case: str, int4_fast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The integer-weight cases above with their linear layers on the Triton path (interpreted here) and the
    decode GEMV switched on for every size they compute (quant_gemm.WNA16_GEMV_MAX_TOKENS: 64 by default, set
    here in case it changes: the prefill's 24 rows too): the same logits and greedy tokens, every product
    through kernels/quant_gemv.py; with int4_fast, the decode steps' one-row products through
    kernels/int4_gemv.py."""
    pytest.importorskip("triton")
    from longserve.kernels import quant_gemm, quant_gemv
    from longserve.models.quant import wna16

    monkeypatch.setattr(wna16, "use_triton", lambda x: True)  # as for CUDA tensors with triton
    monkeypatch.setattr(moe, "use_triton", lambda x: True)  # the experts too (MoEMethod.apply)
    monkeypatch.setattr(quant_gemm, "WNA16_GEMV_MAX_TOKENS", 64)  # the prefill's 24 tokens too
    monkeypatch.setattr(quant_gemv, "INT4_FAST_PATH", int4_fast)
    launches: list[tuple] = []
    kernel = quant_gemv.int4_gemv_kernel

    class Counted:  # the fast kernel's launches (kernel[grid](...)), passed on
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(quant_gemv, "int4_gemv_kernel", Counted())
    calls = count_rows(monkeypatch, quant_gemm, "wna16_gemv")
    check_logits_and_greedy_tokens(root, case, steps=KERNEL_PATH_STEPS)
    assert 24 in calls and 1 in calls, sorted(set(calls))  # the prefill and the decode steps
    assert bool(launches) == int4_fast, len(launches)


@pytest.mark.parametrize(
    ("case", "gemv"), [("fp8-block-64", "fp8_block_gemv"), ("ct-fp8-dynamic", "fp8_channel_gemv")]
)  # ct-fp8-block passed too (15 s more of CI)
def test_fp8_models_through_the_gemv_kernels(
    root, case: str, gemv: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FP8 cases, block-scaled and per channel, with their linear layers on the Triton path (interpreted here)
    and the decode GEMVs (kernels/fp8_gemv.py) at up to 16 rows (quant_fp8.FP8_GEMV_MAX_TOKENS: 1 by
    default): the same logits and greedy tokens as transformers, the decode steps' products through
    the GEMV."""
    pytest.importorskip("triton")
    from longserve.kernels import quant_fp8
    from longserve.models.quant import fp8

    monkeypatch.setattr(fp8, "use_triton", lambda x: True)  # as for CUDA tensors with triton
    monkeypatch.setattr(moe, "use_triton", lambda x: True)  # the experts too (MoEMethod.apply)
    monkeypatch.setattr(quant_fp8, "FP8_GEMV_MAX_TOKENS", 16)
    calls = count_rows(monkeypatch, quant_fp8, gemv)
    fused = count_rows(monkeypatch, quant_fp8, "silu_and_mul_quant")  # the block prefill's down projections
    check_logits_and_greedy_tokens(root, case, steps=KERNEL_PATH_STEPS)
    assert 1 in calls and 24 not in calls, sorted(set(calls))  # the decode steps; the prefill's 24 rows not
    assert set(fused) == ({24} if case.startswith("fp8-block") else set()), fused


@pytest.mark.parametrize("prefill", ["dequant", "fused"])
def test_int4_moe_model_through_the_routed_gemv_and_the_prefill_paths(
    root, prefill: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPTQ int4 MoE case with its experts on the Triton path (interpreted here): the prefill's 24 tokens
    (MOE_WNA16_DEQUANT_MIN_TOKENS lowered to 24) through the dequantized experts, or, a step within
    MOE_WNA16_ROWS_MAX_PER_EXPERT, through fused_moe's int path by rows; the decode steps through the routed int4
    GEMV (kernels/moe_wna16.py): the same logits and greedy tokens as transformers."""
    pytest.importorskip("triton")
    from longserve.kernels import fused_moe, moe_wna16
    from longserve.models.quant import wna16

    monkeypatch.setattr(wna16, "use_triton", lambda x: True)  # as for CUDA tensors with triton
    monkeypatch.setattr(moe, "use_triton", lambda x: True)  # the experts too (MoEMethod.apply)
    monkeypatch.setattr(moe_wna16, "MOE_WNA16_DEQUANT_MIN_TOKENS", 24)
    # 24 tokens of the tiny Qwen3-MoE (8 experts, top 3): 9 rows an expert, within a bound of 9, past one of 8
    monkeypatch.setattr(moe_wna16, "MOE_WNA16_ROWS_MAX_PER_EXPERT", 8 if prefill == "dequant" else 9)
    paths: list[str] = []
    real = fused_moe.moe_wna16_path
    monkeypatch.setattr(fused_moe, "moe_wna16_path", lambda *a: paths.append(real(*a)) or paths[-1])
    check_logits_and_greedy_tokens(root, "gptq-int4-moe-dynamic", steps=KERNEL_PATH_STEPS)
    assert {"gemv", prefill} <= set(paths), sorted(set(paths))
