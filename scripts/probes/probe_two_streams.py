"""Does a memory-bound write overlap a causal attention kernel when they run on two streams?

The question behind `8a4080e` (the A3B int4 experts dequantized a layer ahead on a side stream, beside the next
layer's attention; reverted after it measured no gain in the engine): one A3B-sized layer of attention at 8K
(torch's SDPA, causal, bf16, D 128, 32 q heads over the A3B's 4 kv heads repeated to 32) and a write of 0.8 GB of bf16 from 0.2 GB of bytes
(the experts' gate/up shape, two strided copies standing in for the dequantization), each alone, one after the
other, and on two streams. If the two-stream time is near the serial sum, the attention holds every SM while it
runs and the write can only fill the gaps as its blocks retire.

    python3 scripts/probes/probe_two_streams.py [--priority -1]

Measured on an H100 (2026-12-06, RESULTS.md thirty-ninth session): attention 0.903 ms, write 1.407 ms, serial
2.304 ms, two streams 2.232 ms (3% less); with the side stream at high priority 2.239 ms.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def timed(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--priority", type=int, default=0, help="the side stream's priority (-1: high)")
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(1, 32, args.tokens, 128, device=dev, dtype=bf16)
    k = torch.randn(1, 4, args.tokens, 128, device=dev, dtype=bf16).repeat_interleave(8, 1)
    v = k.clone()
    src = torch.randint(0, 255, (128 * 1536, 1024), device=dev, dtype=torch.uint8)
    dst = torch.empty(128 * 1536, 2048, device=dev, dtype=bf16)
    side = torch.cuda.Stream(priority=args.priority)

    def attention() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def write() -> None:
        dst.view(-1, 2)[:, 0].copy_(src.view(-1))
        dst.view(-1, 2)[:, 1].copy_(src.view(-1))

    def serial() -> None:
        write()
        attention()

    def two_streams() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            write()
        attention()
        torch.cuda.current_stream().wait_stream(side)

    print(
        f"{torch.cuda.get_device_name()}: attention {timed(attention):.3f} ms  write {timed(write):.3f} ms  "
        f"serial {timed(serial):.3f} ms  two streams {timed(two_streams):.3f} ms"
    )


if __name__ == "__main__":
    main()
