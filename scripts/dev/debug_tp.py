"""GPU debugging aid: start a TP=2 engine on a tiny checkpoint step by step with timestamps (eager, then
with CUDA graphs). Run with PYTHONFAULTHANDLER=1 and kill -ABRT the processes to see where one hangs."""

from __future__ import annotations

import logging
import sys
import tempfile
import time

from longserve import LLM, SamplingParams
from longserve.testing.checkpoints import make_tiny_checkpoint

logging.basicConfig(
    level=logging.INFO, format="%(asctime)s %(process)d %(name)s: %(message)s", stream=sys.stdout
)
t0 = time.time()


def say(msg: str) -> None:
    print(f"[{time.time() - t0:7.2f}s] {msg}", flush=True)


def main() -> None:
    path = make_tiny_checkpoint(tempfile.mkdtemp(), "llama", num_layers=2)
    for eager in (True, False):
        say(f"building TP=2 engine, enforce_eager={eager}")
        with LLM(
            path, dtype="float32", device="cuda", max_total_tokens=4096, tp_size=2, enforce_eager=eager
        ) as m:
            say("built; generating")
            out = m.generate(
                [[5, 6, 7, 8]], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
            )
            say(f"generated {out[0].token_ids}")
        say("closed")


if __name__ == "__main__":  # the workers are spawned: they import this module
    main()
