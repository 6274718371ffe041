"""The small decode kernels built for sm90 with programmatic dependent launch on (scripts/dev/pdl_early_loads.py):
each waits on the kernel before (griddepcontrol.wait) and issues the loads of what no kernel of the step writes
before that wait, off the step's chain of kernels (the norm's weight; RoPE's position, cos, sin and slot; the decode
attention's length). Moving such a load back behind the wait fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from longserve.testing.kernel_compile import sm90_compiler_missing  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(sm90_compiler_missing() is not None, reason=str(sm90_compiler_missing()))
def test_host_written_loads_come_before_the_wait() -> None:
    done = subprocess.run([sys.executable, "scripts/dev/pdl_early_loads.py", "--both"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.splitlines()]
    assert all(r["waits"] == 1 and r["local"] == 0 for r in reports), reports
    early = {r["kernel"]: len(r["loads_before_wait"]) for r in reports if r["early"]}
    # the weight (its vector pieces); the position, slot, cos and sin; the length
    assert (
        early["_rms_norm_kernel"] >= 1 and early["_rope_kernel"] >= 4 and early["_decode_split_kernel"] >= 1
    ), early
    # launch.PDL_EARLY_LOADS off: the wait first, as before
    late = [r for r in reports if not r["early"]]
    assert len(late) == 3 and all(not r["loads_before_wait"] for r in late), late
