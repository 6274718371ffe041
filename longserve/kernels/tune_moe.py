"""Tune the fused MoE kernel's block sizes on this GPU and write them into `moe_configs/` (CUDA only).

`python -m longserve.kernels.tune_moe --num-experts 128 --top-k 8 --hidden 2048 --intermediate 768
--dtype bfloat16 --batch-sizes 1,2,4,...,8192` (`--weights fp8_e4m3`: experts in e4m3 with 128x128 block scales,
as the official FP8 checkpoints, activations quantized per token-group of 128 as fused_moe does; their own
table, `dtype=fp8_e4m3`; `--weights int4|int8`: GPTQ-style packed integers in groups of `--int-group`, which
fused_moe's int path dequantizes tile by tile, `dtype=int4|int8`): per batch size and BLOCK_M, the gate+up and
the down GEMM
are timed separately over their candidates (CUDA events around a replayed graph of --iters calls,
median of --repeats) and each candidate's output is checked against the torch reference once; the fastest
pair under the fastest BLOCK_M is written. Compiling dominates the run (each new candidate compiles once,
then serves every batch size with its BLOCK_M): give fewer --batch-sizes for a shorter run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from longserve.kernels.moe_config import smem_per_stage

# the search spaces; "quick" takes minutes on an H200 (tens of compiles per BLOCK_M and GEMM), "full" is
# vLLM's breadth (hundreds: hours of compiling)
SPACES = {
    "quick": {"BLOCK_N": [32, 64, 128, 256], "BLOCK_K": [64, 128], "GROUP_M": [1, 16], "num_warps": [4, 8], "num_stages": [3, 4]},
    # fp8 block experts at prefill sizes: around vLLM's tuned H200 table for them (E=128, N=768: BLOCK_K 128,
    # GROUP_M 16, 4 warps, 4 stages; its BLOCK_N of 128 weight rows is our fused gate+up's 64 columns)
    "fp8-prefill": {"BLOCK_N": [64, 128], "BLOCK_K": [128], "GROUP_M": [16], "num_warps": [4, 8], "num_stages": [3, 4]},
    # 16-bit experts at prefill sizes: the same neighbourhood with both K steps
    "prefill": {"BLOCK_N": [64, 128], "BLOCK_K": [64, 128], "GROUP_M": [16], "num_warps": [4, 8], "num_stages": [3, 4]},
    "full": {
        "BLOCK_N": [32, 64, 128, 256], "BLOCK_K": [64, 128, 256], "GROUP_M": [1, 16, 32, 64],
        "num_warps": [4, 8], "num_stages": [2, 3, 4, 5],
    },
}  # fmt: skip
# 256 rows (8 warps, as vLLM's tuner tries): each weight tile, loaded and (int experts) dequantized once a row block,
# then serves twice the rows. Built for sm90 here (scripts/dev/count_moe_sass.py; the int4 experts' gate+up by rows,
# BLOCK_N 64, BLOCK_K 64, 3 stages): at 128 rows on 4 warps, the tile tune_moe chose on an H100 (thirty-seventh
# session), each warp issues 532 instructions a K step against 512 clocks of wgmma for the program's 1 M MACs; at
# 256 rows on 8 warps 354 (two warps a scheduler: 708) against 1,024, 205 registers, no spills; bf16's 169 and 164
BLOCK_MS = [16, 32, 64, 128, 256]
MAX_ACC_PER_THREAD = 128  # fp32 accumulator registers per thread beyond which tiles spill
MIN_ACC_PER_THREAD_8_WARPS = 32  # a tile this small leaves 8 warps idle: 4 only
REL_TOL = 1e-2  # a candidate whose output is further from the reference is a kernel bug: stop


def candidates(
    space: dict, block_m: int, fused_gate_up: bool, elem: int, smem: int, num_blocks: int
) -> list[dict]:
    """Configs worth timing: they fit shared memory and registers, 8 warps only for big tiles, GROUP_M > 1
    only when there are enough row blocks (`num_blocks`, an estimate) to group."""
    out = []
    for bn, bk, gm, warps, stages in itertools.product(*space.values()):
        cfg = {"BLOCK_M": block_m, "BLOCK_N": bn, "BLOCK_K": bk}
        acc_per_thread = (2 if fused_gate_up else 1) * block_m * bn / (32 * warps)
        if smem_per_stage(cfg, elem, fused_gate_up) * stages > smem or acc_per_thread > MAX_ACC_PER_THREAD:
            continue
        if (warps == 8 and acc_per_thread < MIN_ACC_PER_THREAD_8_WARPS) or (gm > 1 and num_blocks < 2 * gm):
            continue
        out.append({"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "num_warps": warps, "num_stages": stages})
    return out


def block_ms(num_tokens: int, top_k: int, num_experts: int) -> list[int]:
    """BLOCK_M worth trying: above twice the average rows per expert only pads, far below it wastes
    tensor-core throughput once experts hold hundreds of rows (16 always stays for tiny batches)."""
    rows = num_tokens * top_k / num_experts
    keep = [bm for bm in BLOCK_MS if bm <= max(16, 2 * rows) and (bm >= 64 or 8 * bm >= rows)]
    return keep or [BLOCK_MS[-1]]


def wall_ms(fn, warmup: int, iters: int, repeats: int) -> float:
    """Median host milliseconds per call (the CPU smoke test's timer: no CUDA events there)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - start) * 1e3 / iters)
    return statistics.median(times)


def tune(args: argparse.Namespace, device: str = "cuda") -> dict[str, dict]:
    """num_tokens bucket -> best config (a CPU device under TRITON_INTERPRET=1 only smoke-tests this)."""
    from tqdm import tqdm

    from longserve.kernels.fused_moe import fused_moe, fused_moe_ref, moe_align_block_size
    from longserve.kernels.moe_config import max_smem
    from longserve.kernels.moe_gemm import moe_gemm
    from longserve.kernels.moe_reference import MoEQuant, route_topk
    from longserve.kernels.quant_fp8 import per_token_group_quant
    from longserve.kernels.quant_reference import pack_int_k
    from longserve.platform import cuda_graph_time_ms as graph_ms

    dtype = getattr(torch, args.dtype)
    num_experts, top_k, hidden = args.num_experts, args.top_k, args.hidden
    inter = args.intermediate // args.tp_size
    dev = torch.device(device)
    timer = graph_ms if dev.type == "cuda" else wall_ms  # graphs: device time, not launch time
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=dev, generator=gen) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=dev, generator=gen) * inter**-0.5).to(dtype)
    quant = None
    if args.weights == "fp8_e4m3":  # e4m3 experts, 128x128 blocks, the scales making the same weight scale
        block = args.fp8_block
        w13, w2 = (torch.randn(w.shape, device=dev, generator=gen).to(torch.float8_e4m3fn) for w in (w13, w2))
        s13 = torch.full((num_experts, 2 * inter // block, hidden // block), hidden**-0.5, device=dev)
        s2 = torch.full((num_experts, hidden // block, inter // block), inter**-0.5, device=dev)
        quant = MoEQuant("fp8_e4m3", block, s13, s2, block_n=block)
    elif args.weights in ("int4", "int8"):
        # GPTQ-style symmetric integers in groups of --int-group, packed along K
        bits, group = int(args.weights[3:]), args.int_group
        levels = 1 << bits

        def packed(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            e, n, k = w.shape
            q = torch.randint(0, levels, (e * n, k), device=dev, generator=gen)
            scale = torch.full((e, n, k // group), 2 * k**-0.5 / levels, device=dev, dtype=torch.float16)
            return pack_int_k(q, bits).view(e, n, -1), scale

        (w13, s13), (w2, s2) = packed(w13), packed(w2)
        quant = MoEQuant(args.weights, group, s13, s2)
    smem = max_smem()
    elem = w13.element_size()  # bytes of a weight (and, fp8, of an activation) in shared memory
    best: dict[str, dict] = {}
    for num_tokens in args.batch_sizes:
        x = torch.randn(num_tokens, hidden, device=dev, generator=gen).to(dtype)  # [T, H]
        logits = torch.randn(num_tokens, num_experts, device=dev, generator=gen)  # [T, E]
        weights, ids = route_topk(logits, top_k, True)  # [T, k] each
        weights = weights if args.fp32_routing_weights else weights.to(dtype)  # Mixtral / Qwen-MoE
        ref = fused_moe_ref(x, w13, w2, weights, ids, quant=quant).float()  # [T, H]
        inter_buf = torch.empty(num_tokens * top_k, inter, device=dev, dtype=dtype)  # [T*k, I]
        pair_out = torch.empty(num_tokens * top_k, hidden, device=dev, dtype=weights.dtype)  # [T*k, H]
        flat_w = weights.reshape(-1)  # [T*k]
        results = []
        for bm in block_ms(num_tokens, top_k, num_experts):
            align = moe_align_block_size(ids, num_experts, bm)
            chosen: dict = {}
            for gemm in ("up", "down"):
                fused = gemm == "up"
                a, b, c, div = (x, w13, inter_buf, top_k) if fused else (inter_buf, w2, pair_out, 1)
                proj = "w13" if fused else "w2"
                # fp8 experts read activations quantized per token-group (fused_moe's own first step)
                act: tuple = ()
                if quant is not None and not quant.is_int:
                    a, a_scale = per_token_group_quant(a, quant.group_size)
                    act = (quant, proj, a_scale, dtype)
                elif quant is not None:  # integer experts: 16-bit activations, weights dequantized in tiles
                    act = (quant, proj)
                timed = []
                num_blocks = num_tokens * top_k // bm + min(num_experts, num_tokens * top_k)
                cands = candidates(SPACES[args.space], bm, fused, elem, smem, num_blocks)
                if quant is not None:
                    # a K tile within one scale / activation group (fused_moe's _fit_block_k)
                    cands = [c for c in cands if quant.group_size % c["BLOCK_K"] == 0]
                for cand in tqdm(cands, desc=f"T={num_tokens} BLOCK_M={bm} {gemm}", leave=False):
                    cfg = {"BLOCK_M": bm, **cand}
                    run = partial(moe_gemm, a, b, c, flat_w, *align, div, cfg, fused, not fused, *act)
                    try:
                        run()
                    except Exception as exc:  # e.g. out of shared memory on this GPU: not a candidate
                        tqdm.write(f"skip {gemm} {cfg}: {type(exc).__name__}: {exc}"[:200])
                        continue
                    # once per candidate: the whole MoE with it (the other GEMM: the best so far) vs the reference
                    full = cfg if fused else {"BLOCK_M": bm, **chosen["up"], "down": cand}
                    got = fused_moe(x, w13, w2, weights, ids, quant=quant, config=full).float()  # [T, H]
                    rel = ((got - ref).norm() / ref.norm()).item()
                    if not rel < REL_TOL:
                        raise RuntimeError(
                            f"T={num_tokens} {gemm} {cfg}: relative error {rel:.2e} vs the reference"
                        )
                    timed.append((timer(run, warmup=2, iters=args.iters, repeats=args.repeats), cand))
                if not timed:
                    break
                ms, chosen[gemm] = min(timed, key=lambda t: t[0])
                chosen[gemm + "_ms"] = ms
                if fused:  # the down GEMM reads this GEMM's output: leave the best one's in the buffer
                    best_up = {"BLOCK_M": bm, **chosen["up"]}
                    moe_gemm(a, w13, inter_buf, flat_w, *align, top_k, best_up, True, False, *act)
            if "down" in chosen:
                results.append((chosen["up_ms"] + chosen["down_ms"], bm, chosen))
        if not results:
            raise RuntimeError(f"T={num_tokens}: no candidate compiled on this GPU")
        total, bm, chosen = min(results, key=lambda r: r[0])
        best[str(num_tokens)] = {"BLOCK_M": bm, **chosen["up"], "down": chosen["down"]}
        print(f"T={num_tokens}: {total * 1000:.1f} us  {best[str(num_tokens)]}", flush=True)
    return best


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-experts", type=int, required=True)
    p.add_argument("--top-k", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--intermediate", type=int, required=True, help="expert intermediate size (before TP)")
    p.add_argument("--tp-size", type=int, default=1, help="tune the per-rank shard: intermediate / tp")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument(
        "--weights",
        default=None,
        choices=["fp8_e4m3", "int4", "int8"],
        help="quantized experts (default: --dtype)",
    )
    p.add_argument("--int-group", type=int, default=128, help="--weights int4/int8: the scale groups along K")
    p.add_argument("--fp8-block", type=int, default=128, help="--weights fp8_e4m3: the scale blocks' side")
    default_sizes = "1,2,4,8,16,24,32,48,64,96,128,256,512,1024,1536,2048,3072,4096,8192"
    p.add_argument("--batch-sizes", default=default_sizes, type=lambda s: [int(v) for v in s.split(",")])
    p.add_argument("--space", default="quick", choices=list(SPACES))
    p.add_argument(
        "--fp32-routing-weights",
        action="store_true",
        help="weights kept in fp32 (Mixtral); default: rounded (Qwen)",
    )
    p.add_argument("--iters", type=int, default=10, help="calls per timed repeat")
    p.add_argument("--repeats", type=int, default=5, help="repeats; the median is kept")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=None, help="default: the package's moe_configs/")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tune_moe times the Triton kernel on a CUDA GPU, and none is visible here")
    from longserve.kernels.moe_config import CONFIG_DIR, config_file_name, current_device_name, load_table

    if args.intermediate % args.tp_size:
        raise SystemExit(f"--intermediate {args.intermediate} is not divisible by --tp-size {args.tp_size}")
    best = tune(args)
    name = config_file_name(
        args.num_experts,
        args.intermediate // args.tp_size,
        current_device_name(),
        getattr(torch, args.dtype),
        args.weights,
    )
    path = Path(args.output_dir or CONFIG_DIR) / name
    merged = {**{str(k): v for k, v in (load_table(str(path)) or {}).items()}, **best}  # keep other buckets
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(merged.items(), key=lambda kv: int(kv[0]))
    ]
    path.write_text("{\n" + ",\n".join(rows) + "\n}\n")  # one bucket a line: readable diffs
    load_table.cache_clear()
    print(f"wrote {path} ({len(best)} buckets tuned, {len(merged)} in the file)")


if __name__ == "__main__":
    main()
