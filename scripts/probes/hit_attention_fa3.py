"""GPU probe: the prefix hit's attention (a few new tokens over a long cached prefix, one layer of the
Llama-3.1-8B shape) in our Triton extend kernel, as the backend launches it, against vLLM's FlashAttention-3
over the same paged cache (block table, page 16, pages scattered), on the same chip in the same process.

Issue 19's hit (32K cached + 64 new) spends ~32 x 0.18 ms of its ~11 ms of device time in this kernel, at
~190 TFLOP/s; our Gluon extend kernel (TMA, warp specialization) was no faster (RESULTS.md, thirty-second
session). This says what a kernel can reach at these shapes: FA3 packs the GQA rows and splits the keys too.
Needs vLLM's build on PYTHONPATH (`.anchor/`, ../shared/anchors/README.md):
`PYTHONPATH=.:/tmp/site python3 scripts/probes/hit_attention_fa3.py`. One JSON line a case (each FA3 output's
relative error against ours), and `$OUT/hit_attention_fa3.json`.
"""

from __future__ import annotations

import json
import os
import random

import torch
from attention_vs_fa3 import rel_err  # this folder (the script's own: first on sys.path)

from longserve.attention.metadata import build_metadata
from longserve.attention.triton_backend import TritonAttentionBackend
from longserve.platform import cuda_time_ms

HQ, HKV, D, PAGE = 32, 8, 128, 16
DT = torch.bfloat16
CASES = ((32768, 64), (32768, 16), (32768, 256), (32768, 1024), (131072, 64), (8192, 64))


def time_ms(fn) -> float:
    """Median ms a call of `fn` replayed from a CUDA graph (as the engine's lone-chunk graph runs it: no host
    launch cost in the figure; the Gluon path builds its descriptors on the host at every eager call)."""
    fn()  # builds
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_time_ms(graph.replay, warmup=3, iters=5, repeats=10)


def case(prefix: int, new: int) -> dict:
    dev = "cuda"
    total = prefix + new
    num_pages = -(-total // PAGE)
    pages = list(range(1, num_pages + 1))
    random.Random(0).shuffle(pages)  # scattered, as after a while of serving
    k_cache = torch.randn(num_pages + 1, PAGE, HKV, D, device=dev, dtype=DT)
    v_cache = torch.randn(num_pages + 1, PAGE, HKV, D, device=dev, dtype=DT)
    q = torch.randn(new, HQ, D, device=dev, dtype=DT)
    meta = build_metadata([prefix], [new], [pages], PAGE, dev)
    backend = TritonAttentionBackend(cold_path="triton")
    config, splits = backend.extend_launch([new], [total], HQ, HKV, D, DT, q.device)
    from longserve.kernels.extend_attention import extend_attention

    scale = D**-0.5

    def ours():
        return extend_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.prefix_lens, meta.seq_lens, meta.page_table,
            PAGE, new, scale, config=config, num_splits=splits,
        )  # fmt: skip

    from vllm.vllm_flash_attn import flash_attn_varlen_func

    cu_q = torch.tensor([0, new], dtype=torch.int32, device=dev)
    used = torch.tensor([total], dtype=torch.int32, device=dev)
    table = torch.tensor([pages], dtype=torch.int32, device=dev)

    def fa3(**kw):
        return lambda: flash_attn_varlen_func(
            q, k_cache, v_cache, new, cu_q, total, seqused_k=used, softmax_scale=scale, causal=True,
            block_table=table, fa_version=3, **kw,
        )  # fmt: skip

    flop = 4 * new * (prefix + (new + 1) / 2) * D * HQ
    ref = ours().float()
    row = {"prefix": prefix, "new": new, "triton_splits": splits, "triton_config": config}
    t = time_ms(ours)
    row["triton_ms"], row["triton_tflops"] = round(t, 4), round(flop / t / 1e9, 1)
    # larger row tiles read each key block for more of a kv head's packed rows (64 new tokens x 4 q heads = 256
    # rows: the backend's 64-row tiles read the K/V 4 times, from L2 for all but the first)
    if prefix >= 32768 and new <= 64:
        # 16 warps: four warpgroups of 64 rows each, so a 256-row tile's fp32 accumulator is 64 registers a thread
        for m, n, w in ((128, 64, 8), (128, 32, 8), (256, 32, 8), (256, 32, 16), (256, 64, 16), (64, 128, 4)):
            cfg = {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": 2}
            for s in (splits, splits // 2):
                key = f"triton_m{m}n{n}w{w}s{s}"
                try:
                    fn = lambda cfg=cfg, s=s: extend_attention(  # noqa: E731
                        q, k_cache, v_cache, meta.query_start_loc, meta.prefix_lens, meta.seq_lens,
                        meta.page_table, PAGE, new, scale, config=cfg, num_splits=s,
                    )  # fmt: skip
                    err = rel_err(fn(), ref)  # the same sums, other tiles
                    row[f"{key}_ms"], row[f"{key}_rel_err"] = round(time_ms(fn), 4), round(err, 6)
                except Exception as e:  # noqa: BLE001 - out of shared memory or registers: skip the tile
                    row[f"{key}_ms"] = type(e).__name__
    try:
        from longserve.kernels import gluon_extend

        g_splits = gluon_extend.choose_splits([new], [total], HQ // HKV, HKV)
        for name, n in (("gluon", g_splits), ("gluon_triton_splits", splits)):
            fn = lambda n=n: gluon_extend.extend_attention(  # noqa: E731
                q, k_cache, v_cache, meta.query_start_loc, meta.prefix_lens, meta.seq_lens, meta.page_table,
                PAGE, new, scale, num_splits=n,
            )  # fmt: skip
            err = rel_err(fn(), ref)
            t = time_ms(fn)
            row[f"{name}_splits"], row[f"{name}_ms"], row[f"{name}_rel_err"] = n, round(t, 4), round(err, 5)
    except Exception as e:  # noqa: BLE001 - the Gluon build is optional here
        row["gluon"] = f"not run: {type(e).__name__}: {e}"[:200]
    for name, kw in (("fa3", {}), ("fa3_1split", {"num_splits": 1})):
        try:
            fn = fa3(**kw)
            out = fn()
        except TypeError as e:  # an argument this build does not take
            row[name] = f"not run: {e}"
            continue
        t = time_ms(fn)
        err = rel_err(out, ref)
        row[f"{name}_ms"], row[f"{name}_tflops"], row[f"{name}_rel_err"] = (
            round(t, 4), round(flop / t / 1e9, 1), round(err, 5),
        )  # fmt: skip
    return row


def main() -> None:
    torch.manual_seed(0)
    print(json.dumps({"gpu": torch.cuda.get_device_name()}))
    rows = []
    for prefix, new in CASES:
        rows.append(case(prefix, new))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "hit_attention_fa3.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
