"""The kernels that round where torch rounds keep those roundings when built for sm90 (scripts/dev/rounding_ptx.py):
the shared expert's gated add and moe_sum's ADDEND epilogue, launched as their wrappers launch them
(activation.ROUNDED_AS_TORCH), round the product then add (`mul.rn.bf16`, `add.rn.bf16`); with Triton's FP fusion
the same source becomes one `fma.rn.bf16` (the product unrounded: 75-84% of torch's bits on an H100), which this
test also sees, so that it can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from longserve.testing.kernel_compile import sm90_compiler_missing  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def reports(*flags: str) -> dict[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "scripts/dev/rounding_ptx.py", *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["kernel"]: r["bf16_ops"] for r in map(json.loads, done.stdout.splitlines())}


@pytest.mark.skipif(sm90_compiler_missing() is not None, reason=str(sm90_compiler_missing()))
def test_the_gated_adds_round_the_product_before_the_sum() -> None:
    as_launched = reports()
    assert set(as_launched) == {"_sigmoid_gated_add_kernel", "_moe_sum_kernel"}, as_launched
    for kernel, ops in as_launched.items():
        assert not any(op.startswith("fma") for op in ops), (kernel, ops)
        assert any(op.startswith("mul.rn.bf16") for op in ops) and any(
            op.startswith("add.rn.bf16") for op in ops
        )
    fused = reports("--fusion")
    assert all(any(op.startswith("fma.rn.bf16") for op in ops) for ops in fused.values()), fused
