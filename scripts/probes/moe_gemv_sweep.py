"""Block sizes and warps of kernels/moe_gemv.py's two kernels on the Qwen3-30B-A3B expert shape (128 experts,
top-8, hidden 2048, intermediate 768, bf16) at 1-8 tokens, each config timed as a CUDA graph beside
fused_moe's (MOE_GEMV_MAX_TOKENS's evidence). Prints us per call and the GB/s of the touched experts' bytes.

On a CUDA GPU: python3 scripts/probes/moe_gemv_sweep.py
"""

from __future__ import annotations

import itertools

import torch

from longserve.kernels.fused_moe import fused_moe, fused_moe_ref
from longserve.kernels.moe_gemv import moe_gemv
from longserve.kernels.moe_reference import route_topk
from longserve.platform import cuda_graph_time_ms

E, K, H, INTER = 128, 8, 2048, 768


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * INTER, H, device="cuda", generator=gen) * H**-0.5).bfloat16()
    w2 = (torch.randn(E, H, INTER, device="cuda", generator=gen) * INTER**-0.5).bfloat16()
    configs = list(itertools.product((8, 16, 32, 64), (64, 128, 256), (2, 4, 8)))
    for t in (1, 2, 4, 8):
        sweep(t, w13, w2, configs)


def sweep(t: int, w13: torch.Tensor, w2: torch.Tensor, configs: list[tuple[int, int, int]]) -> None:
    x = torch.randn(t, H, device="cuda").bfloat16()
    weights, ids = route_topk(torch.randn(t, E, device="cuda").bfloat16(), K, renormalize=True)
    touched = ids.unique().numel() * 3 * H * INTER * 2
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    buf = torch.empty_like(x)
    gemm = cuda_graph_time_ms(lambda: fused_moe(x, w13, w2, weights, ids, out=buf), 2, 20, 5) * 1e3
    print(f"T={t}: fused_moe {gemm:.1f} us ({touched / gemm / 1e3:.0f} GB/s)", flush=True)
    best = {}
    for which in ("up", "down"):
        times = []
        for cfg in configs:
            kw = {which: cfg}
            try:
                out = moe_gemv(x, w13, w2, weights, ids, torch.empty_like(x), **kw)
                bad = (out.float() - ref.float()).abs().max().item() > 0.05 * ref.float().abs().max().item()
                us = cuda_graph_time_ms(lambda kw=kw: moe_gemv(x, w13, w2, weights, ids, buf, **kw), 2, 20, 5)
                times.append((us * 1e3, cfg, bad))
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"  {which} {cfg}: {type(e).__name__}")
        times.sort()
        best[which] = times[0][1]
        print(
            f"  {which} (other kernel at its default) best 5: "
            + ", ".join(f"{c} {us:.1f} us{' WRONG' if bad else ''}" for us, c, bad in times[:5]),
            flush=True,
        )
    both = cuda_graph_time_ms(lambda: moe_gemv(x, w13, w2, weights, ids, buf, **best), 2, 20, 5) * 1e3
    print(f"  moe_gemv at both best {best}: {both:.1f} us ({touched / both / 1e3:.0f} GB/s)", flush=True)


if __name__ == "__main__":
    main()
