"""Quantized checkpoints end to end on a GPU: the Triton / cuBLAS paths (CUDA graphs for decode and short
prefill chunks) give the greedy tokens of the torch reference path on the same GPU, for each format, dense and
MoE; in bf16 the first token's logprobs stay close to the reference's."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from longserve import LLM, SamplingParams
from longserve.testing import quant_checkpoints as qc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
WRITERS = {
    "gptq-actorder": lambda p: qc.write_gptq(
        p, "llama", bits=4, group_size=64, desc_act=True, sym=False, seed=1
    ),
    "gptq-int8": lambda p: qc.write_gptq(p, "qwen2", bits=8, group_size=128, seed=2),
    "awq": lambda p: qc.write_awq(p, "qwen3", group_size=128, seed=3),
    "ct-w4a16": lambda p: qc.write_compressed_tensors(p, "qwen3", "W4A16", seed=4),
    "ct-fp8-dynamic": lambda p: qc.write_compressed_tensors(p, "qwen3", "FP8_DYNAMIC", seed=5),
    "ct-int8": lambda p: qc.write_compressed_tensors(p, "qwen3", "W8A8", seed=6),
    "fp8-block": lambda p: qc.write_fp8_block(p, "qwen3", block=(64, 64), seed=7),
    "gptq-moe": lambda p: qc.write_gptq(p, "qwen3_moe", bits=4, group_size=32, seed=8),
    "fp8-moe": lambda p: qc.write_fp8_block(p, "qwen3_moe", block=(32, 32), seed=9),
}


def write_gptq_moe_g128(path):
    """GPTQ int4 experts in groups of 128 (experts 128 wide): what kernels/moe_wna16.py's grouped kernel takes."""
    with mock.patch.dict(qc.MOE_DIMS, {"moe_intermediate_size": 128}):
        return qc.write_gptq(path, "qwen3_moe", bits=4, group_size=128, seed=10)


# activations quantized at run time: a last-bit difference between the kernel's and the reference's GEMM (fp32
# summation order) flips the rounding of a later layer's activation to its next fp8/int8 value, and the tiny
# random models' near-uniform logits turn that into a different token within a few steps (seen on an H200:
# ct-int8 agreed on 66 of 96 tokens, ct-fp8-dynamic diverged at the second token) although the kernels equal
# their references op by op (test_quant_kernels_gpu.py). Even the first step moves, so the first step is what
# must agree: each side's token among the other's top two, and the logprobs of the tokens both list within 0.1
# (a broken kernel moves them by whole units). Open (H200, 841eb99): ct-int8 passes (gaps <= 0.05), but the three
# fp8-activation formats fail it, the kernel path's top logprob 0.16-0.23 *above* the reference's in each
# test's first failing row (one direction, unlike random flips; unexplained); a run at a4e6031 saw 0.02-0.07.
ACT_QUANT = {"ct-fp8-dynamic", "ct-int8", "fp8-block", "fp8-moe"}


def prompts(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(10, 500, (40,), generator=g).tolist()
    return [head + torch.randint(10, 500, (3 + 17 * i,), generator=g).tolist() for i in range(n)]


def run(path, dtype="float32", **kw):
    with LLM(path, device="cuda", dtype=dtype, max_total_tokens=8192, **kw) as llm:
        outs = llm.generate(prompts(), GREEDY)
        llm.engine.check_integrity()
        graphs = llm.engine.runner.graph_runner is not None
    return [o.token_ids for o in outs], [o.outputs[0].logprobs for o in outs], graphs


def first_step(path, dtype="float32", max_new_tokens=1, **kw):
    """Per prompt: the greedy first token and the top-2 {token: logprob} of the first step."""
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    with LLM(path, device="cuda", dtype=dtype, max_total_tokens=8192, **kw) as llm:
        outs = llm.generate(prompts(), sp)
        llm.engine.check_integrity()
    return [(o.token_ids[0], dict(o.outputs[0].top_logprobs[0])) for o in outs]


def assert_first_steps_agree(got, expected):
    for (tok, lps), (ref_tok, ref_lps) in zip(got, expected):
        assert tok in ref_lps and ref_tok in lps, (tok, lps, ref_tok, ref_lps)
        for t in lps.keys() & ref_lps.keys():
            assert abs(lps[t] - ref_lps[t]) < 0.1, (t, lps[t], ref_lps[t])


def reference_path(monkeypatch):
    """Every quantized layer and expert through the torch references instead of the kernels."""
    from longserve.models import moe
    from longserve.models.quant import fp8, int8, wna16

    for mod in (moe, fp8, int8, wna16):
        monkeypatch.setattr(mod, "use_triton", lambda x: False)


@pytest.mark.parametrize("case", list(WRITERS))
def test_kernels_give_the_reference_tokens(tmp_path, monkeypatch, case):
    path = WRITERS[case](tmp_path / case)
    tokens, _, graphs = run(path)
    assert graphs and all(len(t) == GREEDY.max_new_tokens for t in tokens)
    got = first_step(path) if case in ACT_QUANT else None
    reference_path(monkeypatch)
    # eager: the MoE reference loops over torch.unique's experts, a host sync that a CUDA graph cannot hold
    if case in ACT_QUANT:
        assert_first_steps_agree(got, first_step(path, enforce_eager=True))
    else:
        expected, _, _ = run(path, enforce_eager=True)
        assert tokens == expected


@pytest.mark.parametrize("case", ["gptq-actorder", "awq", "fp8-block", "gptq-moe", "gptq-moe-g128"])
def test_bf16_first_token_logprobs_close_to_the_reference(tmp_path, monkeypatch, case):
    """In bf16 the kernels' first step agrees with the torch reference path's: each side's token among the
    other's top two, the logprobs of the tokens both list within 0.1 (bf16 rounding on the tiny random models'
    near-flat logits can swap the top two: gptq-moe-g128 on an H200 at f46cffd chose 291 at -2.335 where the
    reference chose 300 at -2.280; a broken kernel moves the logprobs by whole units).
    gptq-moe-g128: the four prompts' prefill (274 tokens in one step; MOE_WNA16_DEQUANT_MIN_TOKENS raised so
    that it is not dequantized) through the grouped int4 MoE kernel, the decode steps (4 tokens) through the
    routed GEMV. awq: int4 in groups of 128 with zero points, the dense layers' decode steps through the int4 GEMVs
    (kernels/int4_mma_gemv.py's when quant_gemv.INT4_MMA_GEMV is on: gpu_check.sh int4-mma-decode runs these tests
    so) in bf16, under CUDA graphs."""
    from longserve.kernels import fused_moe, moe_wna16

    path = (write_gptq_moe_g128 if case == "gptq-moe-g128" else WRITERS[case])(tmp_path / case)
    monkeypatch.setattr(moe_wna16, "MOE_WNA16_DEQUANT_MIN_TOKENS", 1 << 20)
    paths: list[str] = []
    real = fused_moe.moe_wna16_path
    monkeypatch.setattr(fused_moe, "moe_wna16_path", lambda *a: paths.append(real(*a)) or paths[-1])
    got = first_step(path, dtype="bfloat16", max_new_tokens=4)
    if case == "gptq-moe-g128":
        assert {"grouped", "gemv"} <= set(paths), sorted(set(paths))
    reference_path(monkeypatch)
    assert_first_steps_agree(got, first_step(path, dtype="bfloat16", enforce_eager=True))


@pytest.mark.parametrize("case", ["awq", "fp8-block-128"])
def test_the_norm_in_the_gemv_epilogue(tmp_path, monkeypatch, case):
    """gluon_gemv.NORM_EPILOGUE on: the decode steps' o and down projections (one row, bf16, CUDA graphs) add into
    the residual stream and norm in their GEMV's last tile (int4 by the ring; block FP8 by the wgmma GEMV, 128 x 128
    blocks), and the first step agrees with the same engine's with it off (the normed row's rounding may differ);
    four steps end with every page back."""
    from longserve.kernels import gemv_fused, gluon_gemv

    if case == "awq":
        path = WRITERS[case](tmp_path / case)
    else:
        # k and v of 128 rows (4 KV heads), so every projection divides into 128 x 128 blocks
        with mock.patch.dict(qc.DENSE_DIMS, {"num_key_value_heads": 4}):
            path = qc.write_fp8_block(tmp_path / case, "qwen3", block=(128, 128), seed=7)
    off = first_step(path, dtype="bfloat16", max_new_tokens=4)
    monkeypatch.setattr(gluon_gemv, "NORM_EPILOGUE", True)
    folded = []
    for name in ("wna16_gemv_then_norm", "fp8_block_linear_then_norm"):
        real = getattr(gemv_fused, name)
        monkeypatch.setattr(
            gemv_fused, name, lambda *a, real=real, **k: folded.append(real(*a, **k)) or folded[-1]
        )
    on = first_step(path, dtype="bfloat16", max_new_tokens=4)
    assert any(f is not None for f in folded), "no projection took the norm"
    assert_first_steps_agree(on, off)
