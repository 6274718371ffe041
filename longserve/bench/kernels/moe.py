"""GPU timing of the fused MoE at the Qwen3-30B-A3B and Mixtral-8x7B shapes: TFLOP/s and GB/s against the
chip's ceilings, beside the torch reference; `bench_moe()` returns one dict per case, `main()` prints them.

FLOPs are the useful ones, 2*T*k*(H*2I + I*H); bytes are the distinct experts' weights (each read once)
plus the hidden states in and out. Each case is checked against the reference first; the kernel is timed
eagerly and as a replayed CUDA graph (what decode steps run; the eager time of a small batch is host time).

`--align both` times each case twice, with the torch alignment (`moe_align_ref`, ~15 launches) and with the
one-launch Triton one (kernels/moe_align.py), and the alignment alone (`align_ms`, also a CUDA graph): the
measurement that sets kernels/moe_align.py's MOE_TRITON_ALIGN_MAX_PAIRS (the largest T*k where the
"triton" rows' ms beat the "torch" ones'). `route_ms` times the router's top-k the same two ways (route_topk,
kernels/moe_routing.py): it sets models/moe.py's MOE_TRITON_ROUTING_MAX_TOKENS.
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch

from longserve.platform import cuda_graph_time_ms, cuda_time_ms


@dataclass(frozen=True)
class MoEShape:
    num_experts: int
    top_k: int
    hidden: int
    inter: int  # per expert
    round_weights: bool  # Qwen-MoE rounds the routing weights to the dtype; Mixtral keeps fp32


SHAPES = {
    "qwen3-30b-a3b": MoEShape(128, 8, 2048, 768, True),
    "mixtral-8x7b": MoEShape(8, 2, 4096, 14336, False),
}
MAX_REL_ERR = 1e-2
ALIGN_MODES = ("torch", "triton")


@contextmanager
def alignment(mode: str):
    """kernels/moe_align.py's alignment switch set for `mode` ("torch": off; "triton": every size the
    kernel takes) while the block runs (captured CUDA graphs keep the path they were captured with)."""
    from longserve.kernels import moe_align as mod
    from longserve.kernels.moe_align import MAX_PAIRS

    if mode not in ALIGN_MODES:
        raise ValueError(f"alignment {mode!r}: one of {ALIGN_MODES}")
    saved = mod.MOE_TRITON_ALIGN_MAX_PAIRS
    mod.MOE_TRITON_ALIGN_MAX_PAIRS = MAX_PAIRS if mode == "triton" else 0
    try:
        yield
    finally:
        mod.MOE_TRITON_ALIGN_MAX_PAIRS = saved


def bench_moe(
    shapes: list[str] | None = None,
    token_counts: tuple[int, ...] = (1, 64, 8192),
    dtype: torch.dtype = torch.bfloat16,
    peak_tflops: float = 770.0,
    peak_gbps: float = 4200.0,
    warmup: int = 5,
    iters: int = 20,
    repeats: int = 5,
    compare_torch: bool = True,
    device: str = "cuda",
    align_modes: tuple[str, ...] = ("torch",),
) -> list[dict[str, object]]:
    """One dict per (shape, T, alignment): tokens, align, experts_touched, gflop, mbytes, ms (graph replay),
    eager_ms, align_ms (the alignment alone, graph replay), route_ms (the router's top-k alone, torch or
    the Triton kernel as `align` says), tflops, tflops_pct, gbps, gbps_pct, torch_ms,
    speedup, rel_err. `align_modes`: "torch" and/or "triton" (the MoE alignment's path). `device` other than
    cuda: smoke tests."""
    from longserve.kernels.fused_moe import fused_moe, fused_moe_ref, get_moe_config
    from longserve.kernels.moe_align import MAX_PAIRS as MAX_ALIGN_PAIRS
    from longserve.kernels.moe_align import align_routed_pairs
    from longserve.kernels.moe_reference import route_topk

    dev = torch.device(device)
    assert dev.type != "cuda" or torch.cuda.is_available(), "bench_moe needs a CUDA GPU"
    rows: list[dict[str, object]] = []
    for name in shapes or list(SHAPES):
        shape = SHAPES[name]
        e, k, h, inter = shape.num_experts, shape.top_k, shape.hidden, shape.inter
        gen = torch.Generator(device=dev).manual_seed(0)
        w13 = (torch.randn(e, 2 * inter, h, device=dev, generator=gen) * h**-0.5).to(dtype)  # [E, 2I, H]
        w2 = (torch.randn(e, h, inter, device=dev, generator=gen) * inter**-0.5).to(dtype)  # [E, H, I]
        elem = w13.element_size()
        for t in token_counts:
            x = torch.randn(t, h, device=dev, generator=gen).to(dtype)  # [T, H]
            logits = torch.randn(t, e, device=dev, generator=gen)  # [T, E]: balanced on average
            weights, ids = route_topk(logits, k, renormalize=True)  # [T, k] each
            weights = weights.to(dtype) if shape.round_weights else weights
            out = torch.empty_like(x)  # [T, H]
            ref = fused_moe_ref(x, w13, w2, weights, ids)  # [T, H]
            touched = torch.unique(ids).numel()  # host sync: fine here, outside the timed calls
            flops = 2 * t * k * (h * 2 * inter + inter * h)
            nbytes = touched * 3 * h * inter * elem + 2 * t * h * elem
            ref_ms = float("nan")
            if compare_torch:
                ref_call = partial(fused_moe_ref, x, w13, w2, weights, ids)
                ref_ms = cuda_time_ms(ref_call, warmup=1, iters=max(1, iters // 4), repeats=3)
            block_m = get_moe_config(e, inter, h, k, dtype, t)["BLOCK_M"]
            router_logits = logits.to(dtype)  # [T, E] what a model's router linear gives
            for mode in align_modes:
                if mode == "triton" and t * k > MAX_ALIGN_PAIRS:
                    continue  # past what the kernel takes: the torch row is the only one
                with alignment(mode):
                    got = fused_moe(x, w13, w2, weights, ids, out=out)
                    rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                    if not rel < MAX_REL_ERR:
                        raise RuntimeError(f"{name} T={t} ({mode} alignment): relative error {rel:.2e}")
                    call = partial(fused_moe, x, w13, w2, weights, ids, out=out)
                    align_call = partial(align_routed_pairs, ids, e, block_m)
                    route_call = partial(
                        _route, mode, router_logits, k, dtype if shape.round_weights else None
                    )
                    eager = cuda_time_ms(call, warmup=warmup, iters=iters, repeats=repeats)
                    if dev.type == "cuda":
                        replay = cuda_graph_time_ms(call, warmup=warmup, iters=iters, repeats=repeats)
                        align_ms = cuda_graph_time_ms(align_call, warmup=warmup, iters=iters, repeats=repeats)
                        route_ms = cuda_graph_time_ms(route_call, warmup=warmup, iters=iters, repeats=repeats)
                    else:
                        replay = eager
                        align_ms = cuda_time_ms(align_call, warmup=warmup, iters=iters, repeats=repeats)
                        route_ms = cuda_time_ms(route_call, warmup=warmup, iters=iters, repeats=repeats)
                row = _row(name, t, mode, touched, flops, nbytes, replay, eager, align_ms, ref_ms, rel,
                           peak_tflops, peak_gbps)  # fmt: skip
                rows.append({**row, "route_ms": route_ms})
    return rows


def _route(mode: str, logits: torch.Tensor, top_k: int, round_to: torch.dtype | None):
    """The router's top-k as models/moe.py runs it: route_topk (+ the weights' rounding), or with "triton" the
    one-launch kernel of kernels/moe_routing.py (its switch: MOE_TRITON_ROUTING_MAX_TOKENS)."""
    from longserve.kernels.moe_reference import route_topk

    if mode == "triton":
        from longserve.kernels.moe_routing import route_topk_fused

        return route_topk_fused(logits, top_k, True, "softmax", round_to or torch.float32)
    weights, ids = route_topk(logits, top_k, True)
    return (weights.to(round_to) if round_to else weights), ids


def _row(name, t, mode, touched, flops, nbytes, replay, eager, align_ms, ref_ms, rel, peak_tflops, peak_gbps):
    return {
        "shape": name,
        "tokens": t,
        "align": mode,
        "experts_touched": touched,
        "gflop": flops / 1e9,
        "mbytes": nbytes / 1e6,
        "ms": replay,
        "eager_ms": eager,
        "align_ms": align_ms,
        "tflops": flops / replay / 1e9,
        "tflops_pct": 100 * flops / replay / 1e9 / peak_tflops,
        "gbps": nbytes / replay / 1e6,
        "gbps_pct": 100 * nbytes / replay / 1e6 / peak_gbps,
        "torch_ms": ref_ms,
        "speedup": ref_ms / replay,
        "rel_err": rel,
    }


def format_rows(rows: list[dict[str, object]]) -> str:
    cols = [
        "shape",
        "tokens",
        "align",
        "experts_touched",
        "ms",
        "eager_ms",
        "align_ms",
        "route_ms",
        "tflops",
        "tflops_pct",
        "gbps",
        "gbps_pct",
    ]
    cols += ["torch_ms", "speedup", "rel_err"]
    lines = [" ".join(f"{c:>15}" for c in cols)]
    for r in rows:
        lines.append(" ".join(f"{r[c]:>15.4g}" if isinstance(r[c], float) else f"{r[c]!s:>15}" for c in cols))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Fused MoE kernel: achieved TFLOP/s and GB/s on this GPU")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    p.add_argument("--tokens", default="1,64,8192", help="comma-separated token counts")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--peak-tflops", type=float, default=770.0, help="measured dense GEMM ceiling")
    p.add_argument("--peak-gbps", type=float, default=4200.0, help="measured memory bandwidth ceiling")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-torch", action="store_true", help="skip timing the torch reference")
    p.add_argument(
        "--align",
        default="torch",
        choices=["torch", "triton", "both"],
        help="the MoE alignment's path: the torch ops, the one-launch Triton kernel, or each in turn "
        "(sets kernels/moe_align.py's MOE_TRITON_ALIGN_MAX_PAIRS)",
    )
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe times the Triton kernel on a CUDA GPU, and none is visible here")
    rows = bench_moe(
        [s for s in args.shapes.split(",") if s],
        tuple(int(t) for t in args.tokens.split(",")),
        getattr(torch, args.dtype),
        args.peak_tflops,
        args.peak_gbps,
        iters=args.iters,
        repeats=args.repeats,
        compare_torch=not args.no_torch,
        align_modes=ALIGN_MODES if args.align == "both" else (args.align,),
    )
    print(torch.cuda.get_device_name(), f"ceilings: {args.peak_tflops} TFLOP/s, {args.peak_gbps} GB/s")
    print(format_rows(rows))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
