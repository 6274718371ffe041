"""Cold-prompt time of longserve against one transformers forward of the same model, interleaved in one
process so that the ratio holds on a loaded machine: each round runs every longserve variant (chunk sizes,
optionally the reference attention backend) and one HF forward, each on a fresh random prompt, and each
round's ratio divides by that round's HF time. What `bench latency --compare-hf` measures (HF after all of
the engine's runs), made robust to other work on the same cores.

    python scripts/dev/cpu_vs_hf.py --config tiny-4l --prompt-len 16384 --chunks 8192,16384 --rounds 5
    python scripts/dev/cpu_vs_hf.py ... --reference-rounds 1   # also the masked float32 oracle backend
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch

from longserve import LLM, SamplingParams
from longserve.attention import TorchAttentionBackend
from longserve.bench.configs import BUILTIN_CONFIGS
from longserve.config import EngineConfig


def load_average() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny-4l", choices=sorted(BUILTIN_CONFIGS), help="random weights")
    p.add_argument("--model-path", default=None, help="a checkpoint instead (both load its weights)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-len", type=int, default=16384)
    p.add_argument("--chunks", default="8192,16384", help="chunked-prefill sizes, one engine each")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up round)")
    p.add_argument("--reference-rounds", type=int, default=0, help="rounds that also time the oracle backend")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {load_average()}", flush=True)

    if args.model_path:
        model, load_format = args.model_path, "auto"
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
    else:
        model, load_format = tempfile.mkdtemp(prefix="cpu-vs-hf-"), "dummy"
        cfg = dict(BUILTIN_CONFIGS[args.config])
        cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], args.prompt_len + 16)
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(cfg, f)
    engines: dict[str, LLM] = {}
    for chunk in chunks:
        engines[f"sdpa-{chunk}"] = LLM.from_config(
            EngineConfig(
                model=model, load_format=load_format, device="cpu", dtype=args.dtype,
                chunked_prefill_size=chunk, context_length=args.prompt_len + 16,
                max_total_tokens=args.prompt_len + 64,
            )
        )  # fmt: skip
    if args.reference_rounds:
        for chunk in chunks:
            llm = LLM.from_config(engines[f"sdpa-{chunk}"].config)
            llm.engine.runner.backend = TorchAttentionBackend()  # the oracle: masked float32 SDPA
            engines[f"reference-{chunk}"] = llm

    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = next(iter(engines.values())).engine.runner.dtype
    if args.model_path:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa").eval()
    else:
        hf_config = AutoConfig.from_pretrained(model, local_files_only=True)
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa").eval()
    gen = torch.Generator().manual_seed(0)
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)

    def prompt() -> list[int]:
        return torch.randint(0, cfg["vocab_size"], (args.prompt_len,), generator=gen).tolist()

    def time_longserve(llm: LLM) -> float:
        llm.engine.flush_cache()
        ids = prompt()
        t0 = time.perf_counter()
        out = llm.generate(ids, one, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        assert out.error is None and out.cached_tokens == 0
        return wall

    def time_hf() -> float:
        ids = torch.tensor([prompt()])
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf(input_ids=ids, use_cache=True, logits_to_keep=1).logits[0, -1].argmax().item()
        return time.perf_counter() - t0

    # each longserve run sits between two HF runs, and its ratio divides by their mean: load that changes
    # over a minute moves both sides alike
    rows: list[dict] = []
    for rnd in range(args.rounds + args.reference_rounds + 1):  # round 0 warms up; the oracle's come last
        oracle = rnd > args.rounds
        row: dict = {"round": rnd, "load": load_average().split("load average:")[-1].strip()}
        row["hf"] = [time_hf()]
        for name, llm in engines.items():
            if name.startswith("reference") != oracle:
                continue
            row[name] = time_longserve(llm)
            row["hf"].append(time_hf())
            row[f"{name}/hf"] = row[name] / ((row["hf"][-2] + row["hf"][-1]) / 2)
        print(json.dumps(row, default=lambda x: x), flush=True)
        if rnd:
            rows.append(row)

    summary = {}
    for name in engines:
        ratios = [r[f"{name}/hf"] for r in rows if name in r]
        walls = [r[name] for r in rows if name in r]
        summary[name] = dict(
            median_s=statistics.median(walls), median_ratio=statistics.median(ratios), ratios=ratios
        )
        print(
            f"{name:>16}: median {summary[name]['median_s']:.3f} s, longserve/HF median "
            f"{summary[name]['median_ratio']:.2f} (rounds: {', '.join(f'{x:.2f}' for x in ratios)})"
        )
    summary["hf"] = dict(median_s=statistics.median(t for r in rows for t in r["hf"]))
    print(f"{'hf':>16}: median {summary['hf']['median_s']:.3f} s")
    print(load_average())
    if args.output_json:
        meta = dict(config=args.model_path or args.config, prompt_len=args.prompt_len, threads=torch.get_num_threads(),
                    torch=torch.__version__, cpus=os.cpu_count())  # fmt: skip
        with open(args.output_json, "w") as f:
            json.dump(dict(meta=meta, rounds=rows, summary=summary), f, indent=1)


if __name__ == "__main__":
    main()
