"""What structured output costs decode: the same batch of requests decoded with and without a JSON-schema
grammar (the target: at most 5% of decode throughput at batch 64).

Both runs decode `--output-len` tokens per request at batch `--batch-size` (ignore_eos; the schema needs
`minItems` objects, so no grammar completes early), with random weights of a built-in shape. Only steps that
decode every request count (prefill steps are left out); the grammar's host time is measured too: the mask
fills (which also apply the tokens sampled the step before: the engine defers them to the fill, while the
forward pass runs) and the engine's per-token calls after sampling ("accept"). xgrammar needs a tokenizer of the model's vocab: `--tokenizer DIR` (the real
model's, e.g. a Llama-3.1 checkout's), else one is trained here on Python's own sources (byte-level BPE,
as many tokens as that text yields, the rest of the vocab padding that no grammar allows).

  python3 scripts/gpu/bench_structured.py --config llama-3.1-8b --batch-size 64 --output-len 256 \
      [--tokenizer DIR] [--output-json $OUT/structured.json]
  python3 scripts/gpu/bench_structured.py --config tiny --device cpu --batch-size 8 --output-len 32  # smoke
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import sysconfig
import tempfile
import time

import torch

from longserve import LLM, SamplingParams
from longserve.bench.configs import BUILTIN_CONFIGS
from longserve.structured.spec import GrammarSpec

EOS = "<|eos|>"
# a list of records: each item a closed object of bounded strings, integers and a short list; minItems keeps
# the grammar from completing within any --output-len of interest
SCHEMA = {
    "type": "array",
    "minItems": 10_000,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 60},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "email", "tags", "active"],
        "additionalProperties": False,
    },
}


def train_tokenizer(vocab_size: int, out_dir: str) -> None:
    """A byte-level BPE on the standard library's sources, as large as that text allows (< vocab_size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts(limit: int = 24 * 2**20):  # ~1 min of training on a 16-core host
        for path in files:
            with open(path, encoding="utf-8", errors="ignore") as f:
                text = f.read()
            yield text
            limit -= len(text)
            if limit <= 0:
                return

    tok.train_from_iterator(texts(), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(out_dir)


def model_dir(args: argparse.Namespace, out_dir: str) -> str:
    cfg = dict(BUILTIN_CONFIGS[args.config])
    if args.tokenizer:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(args.tokenizer).save_pretrained(out_dir)
    else:
        t = time.perf_counter()
        train_tokenizer(cfg["vocab_size"], out_dir)
        print(f"trained a tokenizer in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir)
    assert len(tok) <= cfg["vocab_size"], (len(tok), cfg["vocab_size"])
    cfg["eos_token_id"] = tok.eos_token_id
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out_dir


def log(msg: str) -> None:
    print(f"[bench structured] {msg}", file=sys.stderr, flush=True)


def decode_run(llm: LLM, args: argparse.Namespace, constrained: bool) -> dict:
    """Decode throughput over the steps that decode every request (tok/s), and the grammar's host time."""
    engine = llm.engine
    masker = engine.runner.step_sampler.grammar_masker
    host = {"fill_s": 0.0, "accept_s": 0.0}
    prepare, advance = masker.prepare, engine.tokens.advance_grammar

    def timed_prepare(reqs):
        t = time.perf_counter()
        try:
            return prepare(reqs)
        finally:
            host["fill_s"] += time.perf_counter() - t

    def timed_advance(req, token):
        t = time.perf_counter()
        try:
            return advance(req, token)
        finally:
            host["accept_s"] += time.perf_counter() - t

    masker.prepare, engine.tokens.advance_grammar = timed_prepare, timed_advance
    spec = GrammarSpec.json_schema(SCHEMA) if constrained else None
    g = torch.Generator().manual_seed(0)
    vocab = min(len(engine.tokenizer), engine.runner.model.vocab_size)
    for i in range(args.batch_size):
        prompt = torch.randint(10, vocab - 1, (args.prompt_len,), generator=g).tolist()
        params = SamplingParams(
            max_new_tokens=args.output_len, temperature=args.temperature, ignore_eos=True, seed=i,
            structured_outputs=spec,
        )  # fmt: skip
        engine.add_request(prompt, params)
    decode_s, decode_tokens, steps = 0.0, 0, 0
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    while engine.has_unfinished():
        sync()
        t = time.perf_counter()
        engine.step()
        sync()
        dt = time.perf_counter() - t
        stats = engine.last_step_stats
        if stats.num_prefill_tokens == 0 and stats.num_decode_tokens == args.batch_size:
            decode_s += dt
            decode_tokens += stats.num_decode_tokens
            steps += 1
    masker.prepare, engine.tokens.advance_grammar = prepare, advance
    engine.check_integrity()
    return {
        "constrained": constrained,
        "decode_steps": steps,
        "decode_tok_s": decode_tokens / decode_s,
        "step_ms": 1e3 * decode_s / steps,
        "grammar_fill_ms_per_step": 1e3 * host["fill_s"] / max(steps, 1),
        "grammar_accept_ms_per_step": 1e3 * host["accept_s"] / max(steps, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama-3.1-8b", choices=sorted(BUILTIN_CONFIGS))
    p.add_argument("--tokenizer", help="a tokenizer directory of the model's vocab (default: train one)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=2, help="runs of each kind (the best counts)")
    p.add_argument("--output-json")
    args = p.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="longserve-structured-") as d:
        path = model_dir(args, d)
        total = args.batch_size * (args.prompt_len + args.output_len) + 4096
        llm = LLM(
            path, load_format="dummy", dtype=args.dtype, device=args.device, max_total_tokens=total,
            max_running_requests=args.batch_size, context_length=args.prompt_len + args.output_len + 16,
        )  # fmt: skip
        log(f"engine up ({time.perf_counter() - t0:.0f} s)")
        try:
            t = time.perf_counter()
            llm.engine.grammar_compiler.compile(GrammarSpec.json_schema(SCHEMA))
            compile_s = time.perf_counter() - t
            log(f"schema compiled in {compile_s:.1f} s")
            decode_run(llm, argparse.Namespace(**{**vars(args), "output_len": 8}), True)  # warm up both paths
            log(f"warmed up ({time.perf_counter() - t0:.0f} s)")
            runs = []
            for i in range(args.repeat):
                for c in (False, True):
                    runs.append(decode_run(llm, args, c))
                    log(f"run {i + 1}/{args.repeat} {'structured' if c else 'plain'}: "
                        f"{runs[-1]['step_ms']:.2f} ms/step ({time.perf_counter() - t0:.0f} s)")  # fmt: skip
        finally:
            llm.close()
        vocab = len(llm.engine.tokenizer)
    best = {
        c: max((r for r in runs if r["constrained"] == c), key=lambda r: r["decode_tok_s"])
        for c in (False, True)
    }
    cost = 1 - best[True]["decode_tok_s"] / best[False]["decode_tok_s"]
    result = {
        "config": args.config,
        "tokenizer_tokens": vocab,
        "batch_size": args.batch_size,
        "output_len": args.output_len,
        "schema_compile_s": compile_s,
        "plain": best[False],
        "structured": best[True],
        "decode_cost": cost,
        "target": "decode_cost <= 0.05",
        "runs": runs,
    }
    for name in ("plain", "structured"):
        r = result[name]
        print(
            f"{name:10s} {r['decode_tok_s']:10.0f} tok/s  step {r['step_ms']:.2f} ms  grammar host: fill "
            f"{r['grammar_fill_ms_per_step']:.2f} ms + accept {r['grammar_accept_ms_per_step']:.2f} ms per step"
        )
    print(f"structured output costs {100 * cost:.1f}% of decode throughput at batch {args.batch_size} "
          f"({vocab:,}-token tokenizer; target <= 5%)")  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
