"""Host time of the engine with the forward pass stubbed out (CPU, no GPU needed): what a step costs in
Python and numpy before and after the GPU's share. Prints the mean host time of a decode step at
--batch x --context, and the TTFT of a --prefix-hit cached:new hit, then the top functions by self time.
The tiny checkpoint has a real tokenizer, so detokenization is counted as a server would pay it.

    python scripts/dev/host_time.py --batch 64 --context 4096 --prefix-hit 32768:64
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time

import torch

from longserve import LLM, SamplingParams
from longserve.runner.inputs import to_model_inputs
from longserve.testing.checkpoints import make_tiny_checkpoint


def stub_forward(llm: LLM) -> None:
    """Keep the input preparation (numpy, host-to-device copies) but skip the model: zero logits."""
    runner = llm.engine.runner
    vocab = runner.model.vocab_size

    def forward_step(step, prev_tokens=None, early=None):
        to_model_inputs(step, runner.page_size, runner.device, prev_tokens)
        if early is not None:
            early()
        n = len(step.logits_indices)
        return torch.zeros(n, vocab) if n else None

    runner.forward_step = forward_step


def top(prof: cProfile.Profile, calls: int, n: int = 12) -> None:
    rows = sorted(
        ((v[2] / calls * 1e3, v[3] / calls * 1e3, f"{k[0].rsplit('/', 1)[-1]}:{k[1]}({k[2]})")
         for k, v in pstats.Stats(prof).stats.items()),
        reverse=True,
    )  # fmt: skip
    for self_ms, cum_ms, where in rows[:n]:
        print(f"  {self_ms:7.3f} ms self {cum_ms:7.3f} ms cumulative  {where}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--prefix-hit", default="32768:64")
    p.add_argument("--steps", type=int, default=32)
    args = p.parse_args()
    cached, new = map(int, args.prefix_hit.split(":"))
    longest = max(args.context + args.steps + 16, cached + new + 16)
    pool = max(args.batch * (args.context + args.steps + 32), 2 * (cached + new) + 64)
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_checkpoint(d, "llama", num_layers=2)
        llm = LLM(path, dtype="float32", device="cpu", max_total_tokens=pool, context_length=longest,
                  attention_backend="torch")  # fmt: skip
    stub_forward(llm)
    engine, vocab = llm.engine, llm.engine.runner.model.vocab_size

    params = SamplingParams(max_new_tokens=args.steps * 3, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(torch.randint(0, vocab, (args.context,), generator=g).tolist(), params)
           for _ in range(args.batch)]  # fmt: skip
    while engine.stats().num_waiting or engine.last_step_stats.num_prefill_tokens:
        engine.step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    prof.disable()
    print(f"decode step, {args.batch} x {args.context}: host {step_ms:.3f} ms")
    top(prof, args.steps)
    for rid in ids:
        engine.abort(rid)

    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    ttfts = []
    prof = cProfile.Profile()
    for i in range(6):
        engine.flush_cache()
        prefix = torch.randint(0, vocab, (cached,), generator=g).tolist()
        llm.generate(prefix + torch.randint(0, vocab, (new,), generator=g).tolist(), one, use_tqdm=False)
        second = [int(str(t)) for t in prefix]  # fresh int objects, as a server's parsed request has
        second += torch.randint(0, vocab, (new,), generator=g).tolist()
        if i == 5:
            prof.enable()
        ttfts.append(llm.generate(second, one, use_tqdm=False)[0].ttft * 1e3)
        prof.disable()
    print(f"prefix hit {cached}:{new}: host TTFT {sorted(ttfts)[len(ttfts) // 2]:.3f} ms (median of 6)")
    top(prof, 1)


if __name__ == "__main__":
    main()
