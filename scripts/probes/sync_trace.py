"""Where a step waits for the device: run a long prompt's chunks (and then its decode) through the engine
with CUDA's sync debug mode on, and print the Python stack of every synchronizing call a step makes.

    python3 scripts/probes/sync_trace.py [--chunk 512] [--prompt-len 4000] [--steps 6]

The overlapped schedule (Engine.step) must not wait for the device while it plans and launches a step:
tests/gpu/test_overlap_gpu.py checks that it does not, this says where it does when that test fails.
A tiny random Qwen3 checkpoint (3 layers), bf16, CUDA graphs on, the attention warm-up done first (as the
server's engine thread does).
"""

from __future__ import annotations

import argparse
import tempfile
import traceback
import warnings

import torch

from longserve import LLM, SamplingParams
from longserve.testing.checkpoints import make_tiny_checkpoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=4000)
    p.add_argument("--steps", type=int, default=6, help="steps traced after the first two")
    p.add_argument(
        "--decoding", type=int, default=0, help="short requests decoding beside the prompt (mixed steps)"
    )
    args = p.parse_args()
    ckpt = make_tiny_checkpoint(tempfile.mkdtemp(), "qwen3", num_layers=3)
    llm = LLM(ckpt, dtype="bfloat16", device="cuda", max_total_tokens=16384, overlap_schedule=True,
              chunked_prefill_size=args.chunk, context_length=8192)  # fmt: skip
    engine = llm.engine
    gen = torch.Generator().manual_seed(2)
    for _ in range(args.decoding):  # decoding before the prompt arrives: its chunks share steps with them
        engine.add_request(
            torch.randint(10, 500, (64,), generator=gen).tolist(), SamplingParams(max_new_tokens=32)
        )
        engine.step()
    ids = torch.randint(10, 500, (args.prompt_len,), generator=gen).tolist()
    engine.add_request(ids, SamplingParams(max_new_tokens=4))
    engine.step()
    engine.step()
    seen: dict[str, int] = {}

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        if "prototype feature" in str(message):  # torch's notice that the debug mode itself is experimental
            return
        stack = "".join(traceback.format_stack(limit=14)[:-2])
        key = stack[-400:]
        seen[key] = seen.get(key, 0) + 1
        if seen[key] == 1:
            print(f"--- sync: {message}\n{stack}", flush=True)

    warnings.showwarning = show
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    for i in range(args.steps):
        if not engine.has_unfinished():
            break
        stats_before = len(seen)
        engine.step()
        s = engine.last_step_stats
        print(f"step {i + 3}: prefill {s.num_prefill_tokens}, decode {s.num_decode_tokens} tokens; "
              f"new sync sites {len(seen) - stats_before}", flush=True)  # fmt: skip
    torch.cuda.set_sync_debug_mode("default")
    print(f"{len(seen)} distinct synchronizing call sites ({sum(seen.values())} calls)")


if __name__ == "__main__":
    main()
