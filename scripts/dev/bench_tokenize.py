"""Time the server's tokenization of a conversation's next turn, with and without the prefix token cache.

A chat of `--history` tokens (the embedded default model's tokenizer, or --tokenizer DIR) gets a new user
message of ~`--new` tokens each turn; each turn is tokenized as the server's TokenizerPool.chat does for
/v1/chat/completions (chat template, then tokens), with the prefix token cache (--tokenizer-prefix-cache-size
64) and without it (0). Prints the median time per turn of each and their ratio; the ids are checked equal.
Tokenization runs on the CPU, before the engine sees the prompt: its time is part of every request's time to
first token. Needs no server packages (fastapi and the like), so it runs where only the engine is installed.

    python3 scripts/dev/bench_tokenize.py [--history 8192,32768,131072] [--new 64] [--turns 8]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from longserve.assets import default_model_path
from longserve.tokenization.prefix_token_cache import PromptTokenizer
from longserve.tokenization.tokenizer import load_tokenizer

_PROSE = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there been one all we their has would when if so what no more out up said about into "
    "time 2024 3.5 , . ; : ! ? ( ) \" ' - \n"
)
WORDS = _PROSE.split(" ")


def text_of(rng: random.Random, tok, target_tokens: int) -> str:
    """Random prose of about `target_tokens` tokens."""
    words = [rng.choice(WORDS) for _ in range(target_tokens)]
    text = " ".join(words)
    n = len(tok.encode(text, add_special_tokens=False))
    return " ".join(words[: max(1, int(len(words) * target_tokens / n))])


def run(tokenizer_dir: str, history: int, new: int, turns: int, cache_size: int) -> tuple[list[float], list]:
    tok = load_tokenizer(tokenizer_dir)
    rng = random.Random(history)
    messages = [{"role": "user", "content": text_of(rng, tok, history)}]
    prompts = PromptTokenizer(tok, cache_size)  # what TokenizerPool.chat calls (size 0: no cache)
    times, ids = [], []
    for _ in range(turns + 1):  # the first turn fills the cache: not timed
        t0 = time.perf_counter()
        out = prompts.chat(messages)
        times.append(time.perf_counter() - t0)
        ids.append(out)
        messages += [
            {"role": "assistant", "content": text_of(rng, tok, 32)},
            {"role": "user", "content": text_of(rng, tok, new)},
        ]
    return times[1:], ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", default=default_model_path())
    p.add_argument("--history", default="8192,32768,131072", help="tokens of the conversation so far")
    p.add_argument("--new", type=int, default=64, help="tokens of each turn's new user message")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--output-json")
    args = p.parse_args(argv)
    rows = []
    print(f"{'history':>8} {'no cache ms':>12} {'cache ms':>9} {'ratio':>6}")
    for history in (int(x) for x in args.history.split(",")):
        off, ids_off = run(args.tokenizer, history, args.new, args.turns, 0)
        on, ids_on = run(args.tokenizer, history, args.new, args.turns, 64)
        if ids_on != ids_off:
            print(f"history {history}: the cached ids differ from the uncached ones", file=sys.stderr)
            return 1
        row = {
            "history_tokens": history,
            "prompt_tokens": len(ids_on[-1]),
            "new_tokens": args.new,
            "no_cache_ms": 1e3 * statistics.median(off),
            "cache_ms": 1e3 * statistics.median(on),
        }
        row["ratio"] = row["no_cache_ms"] / row["cache_ms"]
        rows.append(row)
        print(
            f"{history:>8} {row['no_cache_ms']:>12.2f} {row['cache_ms']:>9.2f} {row['ratio']:>6.1f}",
            flush=True,
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
