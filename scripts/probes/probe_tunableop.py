"""GPU probe: whether torch's TunableOp (cuBLAS / cuBLASLt algorithms tried per GEMM shape, the fastest kept) reads
the 8B's weights faster than the default heuristics at the prefix hit's and decode's token counts. In the hit
(RESULTS.md thirty-fourth session, `hit-profile`) the GEMMs read the 15 GB of weights in ~5.6 ms, ~2.7 TB/s on an
H100 (~3.0 reachable): gate_up 2.64 ms, down 1.39 (+0.08 split-K sum), qkv 0.67, o 0.51, lm_head 0.36.

Each projection of the Llama-3.1-8B shape (bf16, weights rotated through copies so that L2 holds none) at 16, 64
and 128 tokens: the default, then the same call with TunableOp tuned for it, in one process:

    python3 scripts/probes/probe_tunableop.py
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.nn.functional as F

from longserve.platform import cuda_time_ms

# (name, out features, in features) of one layer, and the head
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096)]  # fmt: skip
TOKENS = [int(t) for t in os.environ.get("PROBE_TOKENS", "16,64,128").split(",")]
L2_BYTES = 64 << 20


def main() -> None:
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    weights = {}
    for name, n, k in SHAPES:
        copies = max(1, -(-3 * L2_BYTES // (n * k * 2)))  # enough copies that a round trip misses L2
        weights[name] = [torch.randn(n, k, dtype=bf16, device=dev) * 0.02 for _ in range(copies)]
    inputs = {t: {k: torch.randn(t, k, dtype=bf16, device=dev) for _, _, k in SHAPES} for t in TOKENS}

    def timed(name: str, k: int, t: int) -> float:
        ws, x, i = weights[name], inputs[t][k], [0]

        def call() -> None:
            i[0] = (i[0] + 1) % len(ws)
            F.linear(x, ws[i[0]])

        return cuda_time_ms(call, warmup=5, iters=30, repeats=5) * 1e3

    default = {(name, t): timed(name, k, t) for name, _, k in SHAPES for t in TOKENS}
    tunable = torch.cuda.tunable
    tunable.set_filename(os.path.join(tempfile.mkdtemp(), "tunableop_results.csv"))
    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.set_max_tuning_duration(200)  # ms a shape
    tunable.set_rotating_buffer_size(256)  # MB: each candidate timed on weights out of L2, as in the model
    for name, _, k in SHAPES:
        for t in TOKENS:
            for w in weights[name]:
                F.linear(inputs[t][k], w)  # tunes the shape on its first call
    torch.cuda.synchronize()
    tunable.tuning_enable(False)  # use what was found, tune nothing more
    tuned = {(name, t): timed(name, k, t) for name, _, k in SHAPES for t in TOKENS}
    print("| projection | tokens | default us (TB/s) | TunableOp us (TB/s) | tuned / default |")
    print("|---|---|---|---|---|")
    total = {t: [0.0, 0.0] for t in TOKENS}
    for name, n, k in SHAPES:
        for t in TOKENS:
            a, b = default[name, t], tuned[name, t]
            tb = n * k * 2 / 1e6  # MB -> TB/s at us
            print(f"| {name} | {t} | {a:.1f} ({tb / a:.2f}) | {b:.1f} ({tb / b:.2f}) | {b / a:.3f} |")
            layers = 1 if name == "lm_head" else 32
            total[t][0] += layers * a
            total[t][1] += layers * b
    for t, (a, b) in total.items():
        print(
            f"8B at {t} tokens, all GEMMs: default {a / 1e3:.2f} ms, TunableOp {b / 1e3:.2f} ms ({b / a:.3f})"
        )
    print("TunableOp's choices:", flush=True)
    for result in tunable.get_results():
        print("  " + " | ".join(map(str, result)))


if __name__ == "__main__":
    main()
