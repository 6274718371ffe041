"""Quantized models over two CPU ranks (gloo) give TP=1's greedy tokens through the public LLM API (a chunked
prompt and a prefix-cache hit included): GPTQ with act order (g_idx under tensor parallelism: the row-parallel
layers keep every group, as vLLM does), GPTQ MoE experts split by intermediate slice, FP8 blocks (each rank's
block rows and columns), and random int4 experts placed whole on the ranks (expert parallelism)."""

from __future__ import annotations

import pytest

from longserve.testing import quant_checkpoints as qc
from tests.parallel.test_moe_parallel import check_equal
from tests.parallel.test_tensor_parallel import run


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("quant-tp")
    return {
        "gptq-actorder": qc.write_gptq(
            root / "gptq", "llama", bits=4, group_size=128, desc_act=True, sym=False, seed=11
        ),  # fmt: skip
        "gptq-moe": qc.write_gptq(
            root / "gptq-moe", "qwen3_moe", bits=4, group_size=32, seed=12, dynamic={"-:.*attn.*": {}}
        ),  # fmt: skip
        "fp8-block": qc.write_fp8_block(root / "fp8", "qwen3", block=(32, 32), seed=13),
    }


@pytest.mark.parametrize("case", ["gptq-actorder", "gptq-moe", "fp8-block"])
def test_tp2_equals_tp1(checkpoints, case):
    check_equal(run(checkpoints[case], tensor_parallel_size=2), run(checkpoints[case]))


def test_dummy_quantized_experts_placed_whole_equal_tp1(checkpoints):
    """Random int4 weights (each rank draws every checkpoint tensor of a module whole and keeps its part),
    with the experts placed whole on the ranks (expert parallelism): TP=1's tokens."""
    path = checkpoints["gptq-moe"]
    expected = run(path, load_format="dummy")
    got = run(path, load_format="dummy", tensor_parallel_size=2, enable_expert_parallel=True)
    assert got[:2] == expected[:2]
