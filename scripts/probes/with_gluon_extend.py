"""GPU probe: run a module with the engine's Triton extend calls (`kernels.extend_attention.extend_attention`, the
chunks the split cuDNN path does not take: the prefix hit's 64 new tokens over 32K, in the lone chunk's CUDA graph)
answered by the Gluon extend draft (gluon_extend.py) where it applies: bf16 cache and q, D = 128, page sizes of 16n,
no sliding window, merged outputs (the packed path's partials stay Triton's). What the draft would give the hit end
to end, before it is wired in.

    PYTHONPATH=$PWD python3 scripts/probes/with_gluon_extend.py -- longserve.bench.latency --config llama-3.1-8b \
        --load-format dummy --dtype bfloat16 --warmup 1 --repeat 5 --prompt-lens 32768 --prefix-hit 32768:64

The split count is the Triton kernel's choice (the backend fixes it per graph), times GLUON_EXTEND_SPLIT_SCALE
(default 1).
"""

from __future__ import annotations

import os
import runpy
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from longserve.kernels import extend_attention as ext  # noqa: E402

_triton_call = ext.extend_attention
calls = {"gluon": 0, "triton": 0}
SCALE = float(os.environ.get("GLUON_EXTEND_SPLIT_SCALE", "1"))


def extend_attention(q, k_cache, v_cache, query_start_loc, prefix_lens, seq_lens, page_table, page_size, max_query_len,
                     scale, sliding_window=None, out=None, config=None, num_splits=1, k_scale=1.0, v_scale=1.0,
                     partials=False):  # fmt: skip
    if (
        partials
        or sliding_window is not None
        or q.dtype != torch.bfloat16
        or k_cache.dtype != torch.bfloat16
        or q.shape[2] != 128
        or page_size % 16
    ):
        calls["triton"] += 1
        return _triton_call(
            q, k_cache, v_cache, query_start_loc, prefix_lens, seq_lens, page_table, page_size, max_query_len,
            scale, sliding_window, out, config, num_splits, k_scale, v_scale, partials,
        )  # fmt: skip
    import gluon_extend

    calls["gluon"] += 1
    splits = max(1, round(num_splits * SCALE))
    return gluon_extend.extend_attention(
        q, k_cache, v_cache, query_start_loc, prefix_lens, seq_lens, page_table, page_size, max_query_len, scale,
        splits, out,
    )  # fmt: skip


def main(argv: list[str]) -> None:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise SystemExit(__doc__)
    target, *args = argv[argv.index("--") + 1 :]
    ext.extend_attention = (
        extend_attention  # before the engine builds its backend (it binds the function then)
    )
    sys.argv = [target, *args]
    try:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    finally:
        print(f"[with_gluon_extend] extend calls: {calls}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
