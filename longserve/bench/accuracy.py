"""`longserve bench accuracy`: a quantized model (or an fp8 KV cache) against its original, before going live.

One prompt set (built-in business questions, or --prompts FILE.jsonl) goes through both sides:
- greedy answers of each, side by side;
- teacher-forced on the reference's prompt + greedy answer, at every answer position: top-1 next-token
  agreement and the KL divergence KL(reference || model) of the next-token distributions;
- perplexity of each on a text (built-in, or --text FILE).
Sides are two checkpoints run offline (one after the other, so only one is in memory) or two running servers
(`--base-url`, `--reference-base-url`) through /v1/completions with prompt_logprobs. The KL uses each side's
top-k logprobs (--top-k, 20 by default: vLLM's and longserve's --max-logprobs; a server started with a larger
--max-logprobs takes more), on both paths: tokens of the reference's top k missing from the model's top k get the
model's k-th logprob (an upper bound of theirs), and the mass outside the top k is compared as one bucket; so it
is an approximation, exact as k covers the mass. `--top-k -1` with two checkpoints offline: every token of the
vocabulary, the exact KL (vocabulary x positions pairs in Python: for small vocabularies, as the test models').
Both sides must tokenize alike: a different tokenizer is refused (token ids would not mean the same).
Writes accuracy.json and accuracy.md to --output-dir.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

from longserve.bench.accuracy_sides import OfflineSide, ServerSide, Side

BUSINESS_QUESTIONS = [
    "What are the main differences between a lease and a loan when financing company vehicles?",
    "Write a short email to a customer explaining that their order will arrive two days late.",
    "How should a small business decide between hiring a full-time employee and a contractor?",
    "Summarize the purpose of a quarterly business review in three sentences.",
    "What is the difference between gross margin and net margin? Give an example.",
    "List four risks of expanding a retail business into a new country.",
    "How do you calculate the payback period of an investment of 50,000 dollars that saves 12,000 a year?",
    "Explain what a service level agreement is and what it usually contains.",
    "A customer asks for a refund after 45 days; the policy allows 30. Draft a polite reply.",
    "What metrics would you track to measure the success of a customer support team?",
    "Describe the steps of a simple sales pipeline from lead to closed deal.",
    "What should a company check before signing a contract with a new supplier?",
]
BUILTIN_TEXT = (
    "Quarterly results. Revenue grew eight percent compared with the same quarter last year, driven by higher "
    "demand from enterprise customers and the launch of two new products. Operating costs rose more slowly "
    "than revenue, so the operating margin improved by one and a half points. The company expects supply "
    "constraints to ease in the second half of the year and plans to hire additional staff in customer "
    "support and sales. Cash flow from operations remained strong, and the board approved a dividend in line "
    "with the previous quarter. Management noted that currency movements reduced reported growth slightly "
    "and that the outlook for the full year is unchanged."
)
DEFAULT_TOP_K = 20  # vLLM's and longserve's default --max-logprobs: what any server takes


def load_prompts(path: str | None) -> list[str]:
    """The built-in questions, or one JSON object per line with a "prompt" (or "question" / "text")."""
    if path is None:
        return [f"Question: {q}\nAnswer:" for q in BUSINESS_QUESTIONS]
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON object: {e}") from e
            text = next(
                (row[k] for k in ("prompt", "question", "text") if isinstance(row, dict) and k in row), None
            )
            if not isinstance(text, str) or not text:
                raise ValueError(f'{path}:{n}: expected an object with a "prompt" string')
            prompts.append(text)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def kl_topk(ref: dict[int, float], model: dict[int, float]) -> float:
    """KL(ref || model) from two top-k logprob maps (module docstring's approximation)."""
    floor = min(model.values())
    kl = 0.0
    for t, lp in ref.items():
        kl += math.exp(lp) * (lp - model.get(t, floor))
    rest_ref = max(0.0, 1.0 - sum(math.exp(v) for v in ref.values()))
    rest_model = max(0.0, 1.0 - sum(math.exp(model.get(t, floor)) for t in ref))
    if rest_ref > 1e-9:
        kl += rest_ref * (math.log(rest_ref) - math.log(max(rest_model, 1e-12)))
    return max(kl, 0.0)


def _progress(msg: str) -> None:
    print(f"[bench accuracy] {msg}", file=sys.stderr, flush=True)


def compare(
    model: Side, reference: Side, prompts: list[str], text: str, max_new_tokens: int, top_k: int
) -> dict:
    """Run both sides (reference first) and return the report's data."""
    t0 = time.perf_counter()
    sides = {}
    for name, side in (("reference", reference), ("model", model)):
        with side:
            _progress(f"{name}: {side.describe()}")
            ids = [side.encode(p) for p in prompts]
            text_ids = side.encode(text)
            if name == "model" and (
                ids != sides["reference"]["ids"] or text_ids != sides["reference"]["text_ids"]
            ):
                raise ValueError(
                    "the two sides tokenize the prompts differently: bench accuracy compares next-token "
                    "distributions token by token and needs the same tokenizer on both"
                )
            answers = []
            for i, p in enumerate(ids):
                answers.append(side.greedy(p, max_new_tokens))
                _progress(f"{name}: greedy answer {i + 1}/{len(ids)}")
            forced = sides["reference"]["answers"] if name == "model" else answers
            scored = []
            for i, (p, a) in enumerate(zip(ids, forced)):
                scored.append(side.score(p + a, top_k)[len(p) - 1 :])  # the positions predicting the answer
                _progress(f"{name}: teacher-forced scoring {i + 1}/{len(ids)}")
            text_lps = [e[0] for e in side.score(text_ids, 1)]
            _progress(f"{name}: perplexity text ({len(text_ids)} tokens)")
            sides[name] = dict(
                ids=ids, text_ids=text_ids, answers=answers, scored=scored,
                answer_texts=[side.decode(a) for a in answers], text_logprobs=text_lps,
            )  # fmt: skip
    ref, mod = sides["reference"], sides["model"]
    per_prompt = []
    agree = total = 0
    kls: list[float] = []
    for i, prompt in enumerate(prompts):
        a = n = 0
        kl_p: list[float] = []
        for (_, top_r), (_, top_m) in zip(ref["scored"][i], mod["scored"][i]):
            n += 1
            a += max(top_r, key=top_r.get) == max(top_m, key=top_m.get)
            kl_p.append(kl_topk(top_r, top_m))
        agree, total, kls = agree + a, total + n, kls + kl_p
        per_prompt.append(dict(
            prompt=prompt, reference_answer=ref["answer_texts"][i], model_answer=mod["answer_texts"][i],
            same_answer=ref["answers"][i] == mod["answers"][i], positions=n,
            top1_agreement=a / n if n else None, mean_kl=sum(kl_p) / n if n else None,
        ))  # fmt: skip

    def ppl(lps: list[float]) -> float:
        return math.exp(-sum(lps) / len(lps)) if lps else float("nan")

    return dict(
        model=model.describe(), reference=reference.describe(), num_prompts=len(prompts),
        max_new_tokens=max_new_tokens, top_k=top_k, positions=total,
        top1_agreement=agree / total if total else None,
        mean_kl=sum(kls) / len(kls) if kls else None, max_kl=max(kls) if kls else None,
        kl_note=(
            "KL(reference || model) over every token of the vocabulary (exact)"
            if top_k == -1
            else f"KL(reference || model) over each side's top-{top_k} logprobs (an approximation)"
        ),
        same_answers=sum(p["same_answer"] for p in per_prompt),
        perplexity={"model": ppl(mod["text_logprobs"]), "reference": ppl(ref["text_logprobs"])},
        perplexity_tokens=len(ref["text_ids"]), seconds=time.perf_counter() - t0, prompts=per_prompt,
    )  # fmt: skip


def markdown(r: dict) -> str:
    lines = [
        "# bench accuracy", "",
        f"- model: `{r['model']}`", f"- reference: `{r['reference']}`",
        f"- {r['num_prompts']} prompts, {r['positions']} teacher-forced answer positions "
        f"(greedy answers of up to {r['max_new_tokens']} tokens)", "",
        "| metric | value |", "|---|---|",
        f"| top-1 next-token agreement | {r['top1_agreement']:.4f} |",
        f"| mean KL(reference ‖ model) | {r['mean_kl']:.5f} |",
        f"| max KL | {r['max_kl']:.5f} |",
        f"| identical greedy answers | {r['same_answers']} / {r['num_prompts']} |",
        f"| perplexity, model | {r['perplexity']['model']:.4f} |",
        f"| perplexity, reference | {r['perplexity']['reference']:.4f} |", "",
        f"KL: {r['kl_note']}. Perplexity over {r['perplexity_tokens']} tokens of the text.", "",
        "## Answers side by side", "",
        "| # | prompt | reference | model | agreement | KL |", "|---|---|---|---|---|---|",
    ]  # fmt: skip

    def cell(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", "<br>").strip()

    for i, p in enumerate(r["prompts"], start=1):
        agree = "" if p["top1_agreement"] is None else f"{p['top1_agreement']:.3f}"
        kl = "" if p["mean_kl"] is None else f"{p['mean_kl']:.5f}"
        lines.append(
            f"| {i} | {cell(p['prompt'])} | {cell(p['reference_answer'])} | {cell(p['model_answer'])} | {agree} | {kl} |"
        )
    return "\n".join(lines) + "\n"


def add_accuracy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="the quantized (or otherwise changed) checkpoint, run offline")
    p.add_argument("--reference", help="the original checkpoint, run offline")
    p.add_argument("--base-url", help="a running server of the model (instead of --model)")
    p.add_argument("--reference-base-url", help="a running server of the reference (instead of --reference)")
    p.add_argument("--served-model-name", default=None, help="the `model` field sent to the servers")
    p.add_argument(
        "--prompts", default=None, help='JSONL of {"prompt": ...}; default: built-in business questions'
    )
    p.add_argument("--text", default=None, help="a text file for perplexity; default: a built-in paragraph")
    p.add_argument("--max-new-tokens", type=int, default=48, help="greedy answer length")
    p.add_argument(
        "--top-k",
        type=int,
        default=DEFAULT_TOP_K,
        help="logprobs per position for the KL (a server caps it by its --max-logprobs); -1, offline: the "
        "whole vocabulary (the exact KL)",
    )
    p.add_argument("--output-dir", default="accuracy-report", help="where accuracy.json and accuracy.md go")
    off = p.add_argument_group("offline engine options (both sides unless --reference-* says otherwise)")
    off.add_argument("--dtype", default="auto")
    off.add_argument("--device", default=None)
    off.add_argument("--max-total-tokens", type=int, default=None)
    off.add_argument("--quantization", default=None, help="the model side's --quantization")
    off.add_argument("--kv-cache-dtype", default="auto", help="the model side's KV cache (e.g. fp8)")
    off.add_argument("--reference-kv-cache-dtype", default="auto", help="the reference side's KV cache")
    off.add_argument("--load-format", default="auto")


def _side(path: str | None, url: str | None, what: str, args: argparse.Namespace, **engine: Any) -> Side:
    if (path is None) == (url is None):
        flags = "--model or --base-url" if what == "model" else "--reference or --reference-base-url"
        raise ValueError(f"give exactly one of {flags}")
    if url is not None:
        return ServerSide(url, args.served_model_name)
    kw = dict(dtype=args.dtype, load_format=args.load_format, **engine)
    if args.device:
        kw["device"] = args.device
    if args.max_total_tokens:
        kw["max_total_tokens"] = args.max_total_tokens
    return OfflineSide(path, **kw)


def run_from_args(args: argparse.Namespace) -> dict:
    if args.top_k < 1 and args.top_k != -1:
        raise ValueError("--top-k must be at least 1, or -1 (offline: the whole vocabulary)")
    if args.top_k == -1 and (args.base_url or args.reference_base_url):
        raise ValueError(
            "--top-k -1 (the whole vocabulary) needs both sides offline (--model and --reference)"
        )
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be at least 1")
    model = _side(args.model, args.base_url, "model", args, kv_cache_dtype=args.kv_cache_dtype,
                  quantization=args.quantization)  # fmt: skip
    reference = _side(args.reference, args.reference_base_url, "reference", args,
                      kv_cache_dtype=args.reference_kv_cache_dtype)  # fmt: skip
    if isinstance(model, OfflineSide) and isinstance(reference, OfflineSide):
        model.check_same_tokenizer(reference)
    prompts = load_prompts(args.prompts)
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    else:
        text = BUILTIN_TEXT
    report = compare(model, reference, prompts, text, args.max_new_tokens, args.top_k)
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "accuracy.json"), "w") as f:
        json.dump(report, f, indent=1)
    md = markdown(report)
    with open(os.path.join(args.output_dir, "accuracy.md"), "w") as f:
        f.write(md)
    print(md.split("## Answers")[0], flush=True)
    _progress(f"wrote {args.output_dir}/accuracy.md and accuracy.json")
    return report
