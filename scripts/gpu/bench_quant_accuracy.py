"""`longserve bench accuracy` of each quantized format against its original, one command (issue 18's quality
check on the GPU's kernels). One small float model (longserve.testing.quant_checkpoints' dims, random weights:
the figures show the mechanics and each format's rounding, not a real model's quality) is written as its float
original and in every format by the writers the CPU tests use (GPTQ, AWQ by AutoAWQ, compressed-tensors by
its own library, FP8 blocks by transformers' quantizer), plus the fp8 KV cache against auto (kv-fp8); then each
variant runs against the original and one table collects top-1 agreement, mean KL, perplexities and same
answers.

    python3 scripts/gpu/bench_quant_accuracy.py --device cuda --output-dir /tmp/quant_accuracy
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# name -> (writer, its keyword arguments); every writer takes (path, arch, seed=...) and makes the same float
# model for one seed, so the original below is what each variant quantized
VARIANTS: dict[str, tuple[str, dict]] = {
    "gptq-int4-g128": ("write_gptq", {"bits": 4, "group_size": 128}),
    "gptq-int4-actorder": ("write_gptq", {"bits": 4, "group_size": 128, "desc_act": True}),
    "gptq-int8": ("write_gptq", {"bits": 8, "group_size": 128}),
    "awq-int4": ("write_awq", {"group_size": 128}),
    "ct-w4a16": ("write_compressed_tensors", {"scheme": "W4A16"}),
    "ct-w8a16": ("write_compressed_tensors", {"scheme": "W8A16"}),
    "ct-fp8-dynamic": ("write_compressed_tensors", {"scheme": "FP8_DYNAMIC"}),
    "ct-int8-w8a8": ("write_compressed_tensors", {"scheme": "W8A8"}),
    "fp8-block": ("write_fp8_block", {}),
}


def log(msg: str) -> None:
    print(f"[quant accuracy {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--variants",
        default=",".join([*VARIANTS, "kv-fp8"]),
        help="comma-separated names of VARIANTS, and kv-fp8",
    )
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (head_dim 128 from 512 on, else 32)")
    p.add_argument("--max-new-tokens", default="16")
    p.add_argument("--output-dir", default="/tmp/quant_accuracy")
    args = p.parse_args(argv)

    from longserve.cli import main as cli
    from longserve.testing import quant_checkpoints as qc

    head_dim = 128 if args.hidden >= 512 else 32
    heads = args.hidden // head_dim
    # every writer reads these dims (each K a multiple of 128; k/v rows a multiple of the fp8 block)
    qc.DENSE_DIMS = {"hidden_size": args.hidden, "intermediate_size": 2 * args.hidden, "head_dim": head_dim,
                     "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4)}  # fmt: skip
    fp8_block = (128, 128) if (max(1, heads // 4) * head_dim) % 128 == 0 else (32, 32)
    VARIANTS["fp8-block"] = ("write_fp8_block", {"block": fp8_block})
    os.makedirs(args.output_dir, exist_ok=True)
    original = qc.write_float(os.path.join(args.output_dir, "original"), args.arch, seed=args.seed)
    # --top-k -1: each position's KL over the whole vocabulary (exact; the test models' is 512 tokens)
    common = ["--dtype", args.dtype, "--device", args.device, "--max-total-tokens", "8192",
              "--max-new-tokens", args.max_new_tokens, "--top-k", "-1"]  # fmt: skip
    runs: list[tuple[str, list[str]]] = []
    names = args.variants.split(",")
    for name in names:
        if name == "kv-fp8":  # the original with an fp8 KV cache (below)
            continue
        writer, kwargs = VARIANTS[name]
        log(f"{name}: writing the checkpoint ({writer})")
        path = getattr(qc, writer)(os.path.join(args.output_dir, name), args.arch, seed=args.seed, **kwargs)
        runs.append((name, ["--model", path, "--reference", original]))
    if "kv-fp8" in names:
        runs.append(("kv-fp8", ["--model", original, "--reference", original, "--kv-cache-dtype", "fp8"]))
    rows = []
    for i, (name, sides) in enumerate(runs):
        log(f"{name} ({i + 1}/{len(runs)}): bench accuracy against the original")
        out = os.path.join(args.output_dir, "reports", name)
        rc = cli(["bench", "accuracy", *sides, *common, "--output-dir", out])
        if rc != 0:
            rows.append({"variant": name, "error": f"bench accuracy exited {rc}"})
            continue
        with open(os.path.join(out, "accuracy.json")) as f:
            r = json.load(f)
        rows.append({"variant": name, "top1_agreement": r["top1_agreement"], "mean_kl": r["mean_kl"],
                     "ppl_model": r["perplexity"]["model"], "ppl_reference": r["perplexity"]["reference"],
                     "same_answers": r["same_answers"], "num_prompts": r["num_prompts"]})  # fmt: skip
    with open(os.path.join(args.output_dir, "quant_accuracy.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(
        f"| variant ({args.arch}, {args.dtype}, {args.device}) | top-1 agreement | mean KL | ppl / original | same answers |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | {r['error']} | | | |")
            continue
        print(f"| {r['variant']} | {r['top1_agreement']:.3f} | {r['mean_kl']:.4f} | "
              f"{r['ppl_model']:.2f} / {r['ppl_reference']:.2f} | {r['same_answers']}/{r['num_prompts']} |")  # fmt: skip
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
