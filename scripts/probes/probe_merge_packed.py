"""GPU probe: the packed path's merge (merge_attention.merge_packed) at the 8B prefix hit's shape, by prefix splits
(packed_graph.PACKED_GRAPH_SPLITS). In the hit with the packed graph on, the merge took 14.7 us a layer on an H100
at 16 splits (RESULTS.md thirty-fifth session, `hit-profile`): ~8 MB of partials, ~3 us at the chip's bandwidth.
Here it took 13.9 us at 16 splits and 5.8 at 8; a variant taking a kv head's 4 q heads a program was slower (24.2
and 12.8 us, `ec8880e`).

Each variant is checked against the torch reference, then timed as graph replays over copies of the inputs that
L2 cannot hold together:

    python3 scripts/probes/probe_merge_packed.py
"""

from __future__ import annotations

import torch

from longserve.kernels.attention_reference import merge_packed_ref
from longserve.kernels.merge_attention import merge_packed
from longserve.platform import cuda_graph_time_ms

TOKENS, Q_HEADS, KV_HEADS, HEAD_DIM, ROWS = 64, 32, 8, 128, 256  # the 8B's 64 new tokens, 4 q heads a kv head
COPIES = 16  # x 4 MB (8 splits) or 8 MB (16): past the H100's 50 MB L2


def rotating(inputs: list[tuple[torch.Tensor, ...]], out: torch.Tensor):
    """A call merging the next copy of the inputs into `out` each time."""
    i = [0]

    def call() -> None:
        merge_packed(*inputs[i[0] % len(inputs)], out, 0, True)
        i[0] += 1

    return call


def main() -> None:
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for splits in (16, 8):
        inputs = [
            (
                torch.randn(splits, KV_HEADS, ROWS, HEAD_DIM, dtype=bf16, device=dev),
                torch.randn(splits, KV_HEADS, ROWS, device=dev) * 3,
                torch.randn(TOKENS, Q_HEADS, HEAD_DIM, dtype=bf16, device=dev).transpose(0, 1),
                (torch.randn(TOKENS, Q_HEADS, device=dev) * 3).t(),
            )
            for _ in range(COPIES)
        ]
        out = torch.empty(TOKENS, Q_HEADS, HEAD_DIM, dtype=bf16, device=dev)
        expected = merge_packed_ref(*inputs[0], torch.empty_like(out), 0, True)
        merge_packed(*inputs[0], out, 0, True)
        err = (out.float() - expected.float()).abs().max().item()
        us = cuda_graph_time_ms(rotating(inputs, out), warmup=2, iters=4 * COPIES, repeats=7) * 1e3
        traffic = splits * KV_HEADS * ROWS * HEAD_DIM * 2 / (us * 1e-6) / 1e12
        print(
            f"  {splits} splits: {us:.1f} us ({traffic:.2f} TB/s of partials), max err {err:.2e}", flush=True
        )


if __name__ == "__main__":
    main()
