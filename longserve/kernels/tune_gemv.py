"""Tune the decode GEMVs' tiles on this GPU and write them into `gemv_configs/` (kernels/gemv_tables.py; CUDA only).

`python -m longserve.kernels.tune_gemv --shapes llama-3.1-8b,qwen3-30b-a3b --kernels int4,fp8_block,fp8_channel`:
for each projection of the shapes (N x K) and each kernel, at M = 1 (--tokens), the candidates (BLOCK_N x
SPLIT_K x num_warps) are timed as CUDA graphs (median of --repeats), each one's output checked against the
default tiles' once; the fastest is written only where it beats the default by --min-gain (a tie keeps the
defaults: no entry). The kernels are the one-row int4 GEMV (GPTQ g128, kernels/int4_gemv.py via quant_gemv), the
block-FP8 GEMV (128x128 blocks) and the per-channel FP8 GEMV (kernels/fp8_gemv.py). Compiling dominates:
each (BLOCK_N, num_warps, split or not) compiles once per kernel and serves every shape.

`--kernels dense --tokens 1,2,4,8,16,32,64,128`: the 16-bit GEMM of kernels/dense_gemm.py (its num_stages tuned
too) against cuBLAS (F.linear) as the default: an entry, where one is written, sends that product there at
decode batches of those rows (dense_gemm.DENSE_GEMM_TABLES). `dense_gated`: the same GEMM making a down
projection's input silu(gate) * up on its loads, against silu_and_mul then cuBLAS (the MLPs' down projections
only, GATED_PROJECTIONS), into a table of its own.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = [
    "DENSE_KERNELS",
    "DENSE_SPACE",
    "GATED_PROJECTIONS",
    "KERNELS",
    "PROJECTIONS",
    "SPACE",
    "candidates",
    "main",
    "rotating_weights",
    "tune_kernel",
]

# the decode GEMVs' (N, K) of each built-in shape: its fused qkv, o, gate_up and down (dense MLP only)
PROJECTIONS = {
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "qwen3-30b-a3b": {"qkv": (5120, 2048), "o": (2048, 4096)},
    # the seed's Qwen3.5-35B-A3B, its bf16 products (the GPTQ checkpoint quantizes only the routed experts): the
    # linear-attention layers' in_proj_qkv / in_proj_z|b|a / the two stacked (gated_delta_net) / out_proj, the
    # attention layers' q+gate|k|v and o, the MoE block's router, shared gate, shared gate|up and down, those
    # three inputs stacked (moe_block)
    "qwen3.5-35b-a3b": {
        "gdn_qkv": (8192, 2048), "gdn_zba": (4160, 2048), "gdn_stacked": (12352, 2048), "gdn_out": (2048, 4096),
        "attn_qkv": (9216, 2048), "attn_o": (2048, 4096), "router": (256, 2048), "shared_gate": (1, 2048),
        "shared_gate_up": (1024, 2048), "shared_down": (2048, 512), "moe_inputs": (1281, 2048),
    },
}  # fmt: skip
KERNELS = ("int4", "fp8_block", "fp8_channel", "dense", "dense_gated")
DENSE_KERNELS = ("dense", "dense_gated")
# the projections a gated kernel (a down projection made from gate|up) is tuned for: MLPs' down projections
GATED_PROJECTIONS = ("down", "shared_down")
SPACE = {"BLOCK_N": [32, 64, 128, 256], "SPLIT_K": [1, 2, 3, 4, 6, 8, 12, 16, 24, 32], "num_warps": [4, 8]}
# the dense GEMM's: BLOCK_N 64 or 128 (its sweep's winners, forty-ninth session), 2-4 stages of tl.dot's loads
DENSE_SPACE = {
    "BLOCK_N": [64, 128],
    "SPLIT_K": [1, 2, 3, 4, 6, 8, 12, 16],
    "num_warps": [4],
    "num_stages": [3, 4],
}
REL_TOL = 1e-2  # a candidate further than this from the default tiles' output is a kernel bug: stop


def candidates(kernel: str, n: int, k: int, space: dict | None = None) -> list[dict[str, int]]:
    """Tiles worth timing: splits of at least two K tiles of 128, BLOCK_N within N (the dense GEMM: at most N's
    power of two, 64 at least), the int4 kernel's 32-row tiles left out (a thread's 4 words serve fewer rows than
    its activations cost)."""
    space = space or (DENSE_SPACE if kernel in DENSE_KERNELS else SPACE)
    widest = max(64, 1 << (n - 1).bit_length()) if kernel in DENSE_KERNELS else max(16, n)
    out = []
    for bn, split, warps, stages in itertools.product(
        space["BLOCK_N"], space["SPLIT_K"], space["num_warps"], space.get("num_stages", [None])
    ):
        if split > 1 and k // 128 < 2 * split or bn > widest or (kernel == "int4" and bn < 64 <= n):
            continue
        cfg = {"BLOCK_N": bn, "SPLIT_K": split, "num_warps": warps}
        out.append(cfg if stages is None else {**cfg, "num_stages": stages})
    return out


# A timed call reads its weights from one of several identical copies, in turn, that hold at least this many
# bytes in all, as the engine's decode reads each layer's from HBM: an H200's L2 (50 MB) otherwise keeps a
# projection's weights between calls. Tuned L2-warm on an H200 (ninth session), the int4 tiles timed 10% faster
# per 8B layer (76.2 -> 68.8 us) and left the 8B int4 decode where it was (4.75 -> 4.78 ms).
ROTATE_BYTES = 256 << 20


def weight_copies(weights: tuple) -> list[tuple]:
    """`weights` and identical copies of them (None entries kept) holding ROTATE_BYTES in all."""
    size = sum(w.numel() * w.element_size() for w in weights if w is not None)
    return [weights] + [
        tuple(w if w is None else w.clone() for w in weights) for _ in range(-(-ROTATE_BYTES // size) - 1)
    ]


def rotating_weights(call: Callable, weights: tuple[torch.Tensor, ...], device: torch.device) -> Callable:
    """run(cfg) = call(cfg, *weights), over ROTATE_BYTES of identical copies of `weights` in turn on CUDA."""
    copies = weight_copies(weights) if device.type == "cuda" else [weights]
    turn = itertools.count()
    return lambda cfg: call(cfg, *copies[next(turn) % len(copies)])


def rotating_time_us(call: Callable, weights: tuple, repeats: int = 5) -> float:
    """Device us per call(*copy) on CUDA over `weight_copies` in turn, four rounds of them in one CUDA graph
    (platform.cuda_graph_time_ms): a GEMV's time with its weights from HBM."""
    from longserve.platform import cuda_graph_time_ms

    copies = weight_copies(weights)
    turn = itertools.count()
    run = lambda: call(*copies[next(turn) % len(copies)])  # noqa: E731
    return cuda_graph_time_ms(run, 2, 4 * len(copies), repeats) * 1e3


def products(kernel: str, n: int, k: int, m: int, device: torch.device, gen: torch.Generator):
    """(table name, run(config) -> output) for one kernel at one shape, on random weights of that format
    (rotated over ROTATE_BYTES of copies: timed from HBM, not L2)."""
    from longserve.kernels.fp8_gemv import fp8_block_gemv, fp8_channel_gemv
    from longserve.kernels.quant_fp8 import per_token_group_quant
    from longserve.kernels.quant_gemv import wna16_gemv
    from longserve.kernels.quant_reference import pack_int_k

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gated = kernel == "dense_gated"  # x is gate|up [m, 2k]: the down projection's input made on its loads
    x = torch.randn(m, 2 * k if gated else k, device=device, generator=gen).to(dtype)
    if kernel in DENSE_KERNELS:  # cuBLAS (after silu_and_mul, gated) as the default: config None
        from longserve.kernels.activation import silu_and_mul
        from longserve.kernels.dense_gemm import dense_gemm

        w = (torch.randn(n, k, device=device, generator=gen) * k**-0.5).to(dtype)

        def call(cfg, w):
            if cfg is None:
                return F.linear(silu_and_mul(x) if gated else x, w)
            return dense_gemm(x, w, config=cfg, gated=gated)

        return "dense_gemm_gated" if gated else "dense_gemm", rotating_weights(call, (w,), device)
    if kernel == "int4":
        q = pack_int_k(torch.randint(0, 16, (n, k), device=device, generator=gen), 4)
        scales = (torch.rand(n, k // 128, device=device, generator=gen) * 0.02 + 0.001).half()
        call = lambda cfg, q, s: wna16_gemv(x, q, s, None, None, 4, 128, config=cfg)  # noqa: E731
        return "int4_fast_gemv_bk128", rotating_weights(call, (q, scales), device)
    w = torch.randn(n, k, device=device, generator=gen).to(torch.float8_e4m3fn)
    if kernel == "fp8_block":
        scale = torch.rand(-(-n // 128), k // 128, device=device, generator=gen) * k**-0.5 + 1e-3
        call = lambda cfg, w, s: fp8_block_gemv(x, w, s, (128, 128), config=cfg)  # noqa: E731
        return "fp8_block_gemv_bk128", rotating_weights(call, (w, scale), device)
    assert kernel == "fp8_channel", kernel
    xq, x_scale = per_token_group_quant(x, 0)
    scale = torch.rand(n, device=device, generator=gen) * k**-0.5 + 1e-3
    call = lambda cfg, w, s: fp8_channel_gemv(xq, x_scale, w, s, dtype, config=cfg)  # noqa: E731
    return "fp8_channel_gemv", rotating_weights(call, (w, scale), device)


def tune_kernel(
    run: Callable[[dict | None], torch.Tensor], cands: list[dict], timer: Callable, iters: int, repeats: int
) -> tuple[float, float, dict]:
    """(default ms, the fastest candidate's ms, its tiles) of one product; every candidate checked against the
    default tiles' output."""
    ref = run(None).float()
    default_ms = timer(lambda: run(None), warmup=2, iters=iters, repeats=repeats)
    best_ms, best = float("inf"), {}
    for cfg in cands:
        try:
            got = run(cfg).float()
        except Exception as exc:  # noqa: BLE001  (a tile this GPU's compiler refuses is not a candidate)
            print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        rel = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if not rel < REL_TOL:
            raise RuntimeError(f"{cfg}: relative error {rel:.2e} against the default tiles' output")
        ms = timer(lambda cfg=cfg: run(cfg), warmup=2, iters=iters, repeats=repeats)
        if ms < best_ms:
            best_ms, best = ms, cfg
    return default_ms, best_ms, best


def tune(args: argparse.Namespace, device: str = "cuda") -> dict[str, dict[str, dict]]:
    """table name -> {"N,K,M": tiles} for the products whose fastest candidate beats the default tiles by
    args.min_gain, None for the others (main drops an older entry of theirs)."""
    from tqdm import tqdm

    from longserve.kernels.tune_moe import wall_ms
    from longserve.platform import cuda_graph_time_ms

    dev = torch.device(device)
    timer = cuda_graph_time_ms if dev.type == "cuda" else wall_ms  # graphs: device time, not launch time
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    tables: dict[str, dict[str, dict]] = {}
    jobs = [(shape, proj, nk) for shape in args.shapes for proj, nk in args.projections[shape].items()]
    work = [
        (job, kernel, m)
        for job, kernel, m in itertools.product(jobs, args.kernels, args.tokens)
        if kernel != "dense_gated" or job[1] in GATED_PROJECTIONS  # a gated product: a down projection only
    ]
    for (shape, proj, (n, k)), kernel, m in tqdm(work, desc="gemv tiles"):
        name, run = products(kernel, n, k, m, dev, gen)
        cands = candidates(kernel, n, k, args.space)
        default_ms, best_ms, best = tune_kernel(run, cands, timer, args.iters, args.repeats)
        keep = best and best_ms < (1 - args.min_gain) * default_ms
        base = {"dense": "cuBLAS", "dense_gated": "silu_and_mul + cuBLAS"}.get(kernel, "default")
        tqdm.write(f"{shape} {proj} {kernel} N={n} K={k} M={m}: {base} {default_ms * 1e3:.1f} us, best "
                   f"{best_ms * 1e3:.1f} us {best}{'' if keep else ' - not written'}")  # fmt: skip
        tables.setdefault(name, {})[f"{n},{k},{m}"] = best if keep else None  # None: drop an older entry
    return tables


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="llama-3.1-8b,qwen3-30b-a3b", help=f"of {sorted(PROJECTIONS)}")
    p.add_argument("--kernels", default="int4,fp8_block,fp8_channel", help=f"of {', '.join(KERNELS)}")
    p.add_argument(
        "--tokens", default="1", help="the M values (the one-row int4 kernel: 1; dense: powers of two to 128)"
    )
    p.add_argument("--min-gain", type=float, default=0.03, help="write an entry only if this much faster")
    p.add_argument("--iters", type=int, default=20, help="calls per timed repeat")
    p.add_argument("--repeats", type=int, default=5, help="repeats; the median is kept")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=None, help="default: the package's gemv_configs/")
    args = p.parse_args(argv)
    args.shapes = args.shapes.split(",")
    unknown = [s for s in args.shapes if s not in PROJECTIONS]
    if unknown:
        p.error(f"--shapes {unknown}: known {sorted(PROJECTIONS)}")
    args.kernels = args.kernels.split(",")
    if not set(args.kernels) <= set(KERNELS):
        p.error(f"--kernels {args.kernels}: of {', '.join(KERNELS)}")
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if "int4" in args.kernels and args.tokens != [1]:
        p.error("the one-row int4 kernel takes M = 1 only: --tokens 1")
    if set(DENSE_KERNELS) & set(args.kernels) and not all(
        0 < t <= 128 and t & (t - 1) == 0 for t in args.tokens
    ):
        p.error("the dense GEMM's table is read at M's next power of two: --tokens of 1, 2, 4, ..., 128")
    args.projections, args.space = PROJECTIONS, None  # None: each kernel's own (candidates)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tune_gemv times the Triton kernels on a CUDA GPU, and none is visible here")
    from longserve.kernels.gemv_tables import TABLE_DIR, gemv_table_name, load_gemv_table
    from longserve.kernels.moe_config import current_device_name

    for kernel, entries in tune(args).items():
        path = Path(args.output_dir or TABLE_DIR) / gemv_table_name(kernel, current_device_name())
        old = {",".join(map(str, key)): cfg for key, cfg in load_gemv_table(str(path)).items()}
        merged = {key: cfg for key, cfg in {**old, **entries}.items() if cfg}  # keep the shapes not tuned now
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [f"  {json.dumps(key)}: {json.dumps(cfg)}" for key, cfg in sorted(merged.items())]
        path.write_text("{\n" + ",\n".join(rows) + "\n}\n")
        load_gemv_table.cache_clear()
        tuned = sum(1 for cfg in entries.values() if cfg)
        print(f"wrote {path} ({tuned} entries tuned, {len(merged)} in the file)")


if __name__ == "__main__":
    main()
