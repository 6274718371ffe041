"""Whether a Gated DeltaNet launch makes an illegal memory access (forty-sixth session: an H100 at `23a7f23`
reported one in tests/gpu/test_gated_delta_gpu.py and the gdn_kernels probe with float32 states, none with bf16,
from the chunked delta rule's recurrence as it then was, with the output computed inside it; it is split in two
since, as FLA's). Each case runs in a process of its own (an illegal access poisons the CUDA context; Triton's
reports of such faults on sm_90 see them in some processes and not others) with CUDA_LAUNCH_BLOCKING=1 and a sync
after every launch; prints one line a case: which launch failed, or ok.

    python3 scripts/probes/gdn_state_crash.py            # every case
    python3 scripts/probes/gdn_state_crash.py CASE       # one case, in this process

Run from anywhere: the checkout's root goes on the path (the forty-seventh session's first run, outside gpu_check.sh,
found no `longserve` in each case's process).
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

CASES = [
    "fp32-8192", "bf16-8192", "fp32-200", "fp32-64", "fp32-3lens", "fp32-slot-i64", "fp32-nostate-read",
    "fp32-8192-again", "bf16-8192-again", "fp32-32768",
]  # fmt: skip


def run(case: str) -> None:
    import torch
    import triton

    from longserve.kernels import causal_conv1d as cc
    from longserve.kernels import gated_delta as gd

    hk, hv, kd, vd, w = 16, 32, 128, 128, 4
    d = 2 * hk * kd + hv * vd
    dev, bf = "cuda", torch.bfloat16
    sd = torch.bfloat16 if case.startswith("bf16") else torch.float32
    lens = {"fp32-200": [200], "fp32-64": [64], "fp32-3lens": [1, 700, 3000], "fp32-32768": [32768]}.get(
        case, [8192]
    )
    n = sum(lens)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    slot_dtype = torch.int64 if case == "fp32-slot-i64" else torch.int32
    slots = torch.arange(len(lens), dtype=slot_dtype, device=dev)
    has = torch.tensor([case != "fp32-nostate-read"] * len(lens), device=dev)
    weight = torch.randn(d, w, device=dev).to(bf) * 0.5
    a_log, dt_bias = torch.randn(hv, device=dev), torch.randn(hv, device=dev).to(bf)
    conv = torch.zeros(8, w - 1, d, device=dev, dtype=bf)
    ssm = torch.zeros(8, hv, kd, vd, device=dev, dtype=sd)
    qkv = torch.randn(n, d, device=dev).to(bf)
    a, b = torch.randn(n, hv, device=dev).to(bf), torch.randn(n, hv, device=dev).to(bf)

    def step(name, fn):
        try:
            out = fn()
            torch.cuda.synchronize()
            return out
        except Exception as e:
            # CUDA_LAUNCH_BLOCKING=1: the launch that faulted is the innermost line of our kernels in the traceback
            import traceback

            ours = [f for f in traceback.extract_tb(e.__traceback__) if "/longserve/kernels/" in f.filename]
            where = (
                f" at {ours[-1].filename.rsplit('/', 1)[-1]}:{ours[-1].lineno} ({ours[-1].line})"
                if ours
                else ""
            )
            print(
                f"{case}: FAILED in {name}{where}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True
            )
            sys.exit(1)

    mixed = step("conv prefill", lambda: cc.causal_conv1d_prefill(qkv, weight, conv, qsl, slots, has))
    q, k, v = (x.reshape(n, -1, kd) for x in mixed.split([hk * kd, hk * kd, hv * vd], dim=-1))
    g, beta = step("gating", lambda: gd.gdn_gating(a, b, a_log, dt_bias))
    step("delta rule prefill", lambda: gd.gated_delta_prefill(q, k, v, g, beta, ssm, qsl, slots, has))
    x1 = torch.randn(len(lens), d, device=dev).to(bf)
    m1 = step("conv decode", lambda: cc.causal_conv1d_decode(x1, weight, conv, slots))
    q1, k1, v1 = (x.reshape(len(lens), -1, kd) for x in m1.split([hk * kd, hk * kd, hv * vd], dim=-1))
    g1, b1 = gd.gdn_gating(a[: len(lens)], b[: len(lens)], a_log, dt_bias)
    step("delta rule decode", lambda: gd.gated_delta_decode(q1, k1, v1, g1, b1, ssm, slots))
    print(f"{case}: ok ({triton.__version__}, {torch.cuda.get_device_name()})", flush=True)


def main() -> None:
    if len(sys.argv) > 1:
        run(sys.argv[1])
        return
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for case in CASES:
        r = subprocess.run(
            [sys.executable, __file__, case], env=env, capture_output=True, text=True, timeout=120
        )
        lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith(case)]
        print(
            lines[-1] if lines else f"{case}: rc {r.returncode}: {(r.stdout + r.stderr)[-400:]}", flush=True
        )


if __name__ == "__main__":
    main()
