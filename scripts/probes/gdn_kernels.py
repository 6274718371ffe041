"""One Gated DeltaNet layer's kernels on the GPU at Qwen3.5's shape (16 key / 32 value heads of 128, conv width 4,
bf16 activations, float32 or bf16 states): each kernel's time for a lone prompt of 8K / 32K tokens and for decode
batches of 1 / 16 / 64, and the decode steps' state traffic against the card's bandwidth (the state is read and
written once a step: a request's 32 x 128 x 128 values a layer). Prints one line a case.

    python3 scripts/probes/gdn_kernels.py [--state-dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from longserve.kernels import causal_conv1d as cc
from longserve.kernels import gated_delta as gd
from longserve.kernels import gated_norm as gn
from longserve.platform import cuda_time_ms

HK, HV, K, V, W = 16, 32, 128, 128, 4
D = 2 * HK * K + HV * V


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    sd = getattr(torch, args.state_dtype)
    dev, bf = "cuda", torch.bfloat16
    weight = torch.randn(D, W, device=dev).to(bf) * 0.5
    a_log, dt_bias, norm_w = (
        torch.randn(HV, device=dev),
        torch.randn(HV, device=dev).to(bf),
        torch.ones(V, device=dev),
    )
    slots_n = 64
    conv = torch.zeros(slots_n, W - 1, D, device=dev, dtype=bf)
    ssm = torch.zeros(slots_n, HV, K, V, device=dev, dtype=sd)
    peak_gbs = 4.2e3 if "H200" in torch.cuda.get_device_name() else 3.35e3
    print(f"{torch.cuda.get_device_name()}, states {args.state_dtype}")

    for n in (8192, 32768):
        qkv = torch.randn(n, D, device=dev).to(bf)
        a, b, z = (
            torch.randn(n, HV, device=dev).to(bf),
            torch.randn(n, HV, device=dev).to(bf),
            qkv[:, : HV * V],
        )
        qsl = torch.tensor([0, n], dtype=torch.int32, device=dev)
        slots, has = torch.tensor([0], dtype=torch.int32, device=dev), torch.tensor([False], device=dev)
        mixed = cc.causal_conv1d_prefill(qkv, weight, conv, qsl, slots, has)
        q, k, v = mixed.split([HK * K, HK * K, HV * V], dim=-1)
        q, k, v = q.view(n, HK, K), k.view(n, HK, K), v.view(n, HV, V)
        g, beta = gd.gdn_gating(a, b, a_log, dt_bias)
        out = gd.gated_delta_prefill(q, k, v, g, beta, ssm, qsl, slots, has)
        t_conv = cuda_time_ms(partial(cc.causal_conv1d_prefill, qkv, weight, conv, qsl, slots, has))
        t_gate = cuda_time_ms(partial(gd.gdn_gating, a, b, a_log, dt_bias))
        t_rule = cuda_time_ms(partial(gd.gated_delta_prefill, q, k, v, g, beta, ssm, qsl, slots, has))
        t_norm = cuda_time_ms(partial(gn.gated_rms_norm, out.reshape(-1, V), z.reshape(-1, V), norm_w, 1e-6))
        print(f"prefill {n:>6}: conv {t_conv:.3f} ms, gating {t_gate:.3f}, delta rule {t_rule:.3f}, gated norm "
              f"{t_norm:.3f}; a layer {t_conv + t_gate + t_rule + t_norm:.3f} ms")  # fmt: skip

    for bsz in (1, 16, 64):
        x = torch.randn(bsz, D, device=dev).to(bf)
        a, b = torch.randn(bsz, HV, device=dev).to(bf), torch.randn(bsz, HV, device=dev).to(bf)
        slots = torch.arange(bsz, dtype=torch.int32, device=dev)
        mixed = cc.causal_conv1d_decode(x, weight, conv, slots)
        q, k, v = mixed.split([HK * K, HK * K, HV * V], dim=-1)
        q, k, v = q.view(bsz, HK, K), k.view(bsz, HK, K), v.view(bsz, HV, V)
        g, beta = gd.gdn_gating(a, b, a_log, dt_bias)
        t_conv = cuda_time_ms(partial(cc.causal_conv1d_decode, x, weight, conv, slots))
        t_rule = cuda_time_ms(partial(gd.gated_delta_decode, q, k, v, g, beta, ssm, slots))
        state_bytes = 2 * bsz * HV * K * V * ssm.element_size()  # read and written once
        floor = state_bytes / (peak_gbs * 1e9) * 1e3
        print(f"decode b{bsz:<3}: conv {t_conv:.4f} ms, delta rule {t_rule:.4f} ms (state traffic floor "
              f"{floor:.4f} ms at {peak_gbs / 1e3:.2f} TB/s: {floor / t_rule:.0%})")  # fmt: skip


if __name__ == "__main__":
    main()
