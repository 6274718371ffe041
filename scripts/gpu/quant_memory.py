"""Weight memory and the KV tokens that fit, per shape and weight format (dummy weights on one GPU, the default
--mem-fraction-static): what `bench latency` does not report (it sizes its pool to its cases).

    python scripts/gpu/quant_memory.py --config llama-3.1-8b --variant int4 [--output-json F]

variants: bf16; fp8 (the official FP8 checkpoints' 128x128 blocks, through --hf-overrides' quantization_config);
int4 (GPTQ, group 128, symmetric: --quantization gptq with dummy weights).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from longserve import LLM
from longserve.bench.configs import BUILTIN_CONFIGS

FP8_BLOCK = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [128, 128]}}  # fmt: skip
VARIANTS = {"bf16": {}, "fp8": {"hf_overrides": FP8_BLOCK}, "int4": {"quantization": "gptq"}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, choices=sorted(BUILTIN_CONFIGS))
    p.add_argument("--variant", required=True, choices=sorted(VARIANTS))
    p.add_argument("--kv-cache-dtype", default=None, help="passed on when the engine has the setting")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    extra = dict(VARIANTS[args.variant])
    if args.kv_cache_dtype:
        extra["kv_cache_dtype"] = args.kv_cache_dtype
    with tempfile.TemporaryDirectory() as model:
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(BUILTIN_CONFIGS[args.config], f)
        with LLM(model, load_format="dummy", dtype="bfloat16", device="cuda", context_length=32768,
                 enforce_eager=True, **extra) as llm:  # fmt: skip
            plan = dict(llm.engine.runner.memory_plan)
    row = {"config": args.config, "variant": args.variant, "kv_cache_dtype": args.kv_cache_dtype,
           "weight_gib": plan["weight_bytes"] / 2**30, "kv_pool_tokens": plan["kv_pool_tokens"],
           "kv_bytes_per_token": plan["kv_bytes_per_token"]}  # fmt: skip
    print(json.dumps(row), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(row, f)


if __name__ == "__main__":
    main()
