"""Programmatic dependent launch (kernels/launch.py's PDL) on a GPU. It changes when a kernel may start, never
what it computes: engines with PDL on give bit-identical greedy tokens and logprobs to PDL off, through CUDA
graphs and eagerly, dense bf16 (rms norms, rotary + K/V store, split decode attention and its merge, SiLU), FP8
blocks and GPTQ int4 (their GEMVs and split-K sums), int4 experts (the routed GEMV), 16-bit experts (the router's
top-k, the alignment, the grouped GEMMs, the sum over k) and FP8 experts (the activations' quantization too); and
the kernels that take USE_PDL really were compiled to launch with it."""

from __future__ import annotations

import pytest
import torch

from longserve import LLM, SamplingParams
from longserve.kernels import launch
from longserve.testing import quant_checkpoints as qc
from longserve.testing.checkpoints import make_tiny_checkpoint
from tests.gpu.test_quant_engine_gpu import write_gptq_moe_g128

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CHECKPOINTS = {
    "qwen3-bf16": lambda p: make_tiny_checkpoint(p, "qwen3", num_layers=3),
    "llama-bf16": lambda p: make_tiny_checkpoint(p, "llama", num_layers=3),
    "fp8-block": lambda p: qc.write_fp8_block(p, "qwen3", block=(64, 64), seed=7),
    "gptq-int4-g128": lambda p: qc.write_gptq(p, "llama", bits=4, group_size=128, seed=1),
    "gptq-moe-g128": write_gptq_moe_g128,
    "qwen3-moe-bf16": lambda p: make_tiny_checkpoint(p, "qwen3_moe", num_layers=3),
    "fp8-moe": lambda p: qc.write_fp8_block(p, "qwen3_moe", block=(32, 32), seed=9),
}


def prompts() -> list[list[int]]:
    """Four prompts of 1.1K-1.6K tokens: the decode attention runs 3-4 splits and merges them."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 500, (1100 + 170 * i,), generator=g).tolist() for i in range(4)]


def generate(path: str, pdl: bool, eager: bool) -> tuple[list, list]:
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    before, launch.PDL = launch.PDL, pdl
    try:
        kw = dict(max_total_tokens=16384, context_length=2048, enforce_eager=eager)  # past the 512 positions
        with LLM(path, device="cuda", dtype="bfloat16", **kw) as llm:
            outs = llm.generate(prompts(), params)
            llm.engine.check_integrity()
    finally:
        launch.PDL = before
    return [o.token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_pdl_changes_no_output(name, eager, tmp_path):
    path = CHECKPOINTS[name](tmp_path / name)
    assert generate(path, pdl=True, eager=eager) == generate(path, pdl=False, eager=eager)


# the decode step's Triton kernels that must hold a variant compiled to launch with PDL after a PDL run of these
# checkpoints (module.kernel in longserve.kernels). kernels/moe_gemv.py's two take USE_PDL too, off by default
# (MOE_GEMV_MAX_TOKENS = 0).
COMPILED_FOR_PDL = {
    "dense": (
        ("qwen3-bf16",),
        ("norm._rms_norm_kernel", "rope._rope_kernel", "decode_attention._decode_split_kernel",
         "extend_attention._merge_splits_kernel", "activation._silu_and_mul_kernel"),
    ),
    "moe": (  # the router's top-k, the alignment, the grouped GEMMs, the sum over k; FP8: the quantization
        ("qwen3-moe-bf16", "fp8-moe"),
        ("moe_routing._route_topk_kernel", "moe_align._moe_align_kernel", "moe_gemm._moe_gemm_kernel",
         "moe_sum._moe_sum_kernel", "quant_fp8._group_quant_kernel"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("step", sorted(COMPILED_FOR_PDL))
def test_the_decode_kernels_were_compiled_for_pdl(step, tmp_path, monkeypatch):
    """After a PDL run, each of the step's Triton kernels holds a variant that launches with PDL (the launch
    option reached the compiler: not a switch that does nothing). The decode's 3-4 splits merge in a launch of
    their own here (by default the split kernel merges up to 8 itself: test_attention_gpu.py runs that with
    PDL)."""
    import importlib

    from longserve.kernels import decode_attention

    monkeypatch.setattr(decode_attention, "DECODE_SERIAL_MERGE_MAX_SPLITS", 0)

    checkpoints, kernels = COMPILED_FOR_PDL[step]
    for name in checkpoints:
        generate(CHECKPOINTS[name](tmp_path / name), pdl=True, eager=False)
    for path in kernels:
        module, attr = path.split(".")
        kernel = getattr(importlib.import_module(f"longserve.kernels.{module}"), attr)
        compiled = list(kernel._compiled.values())
        assert any(c.metadata.launch_pdl for c in compiled), f"{path}: no variant launches with PDL"
