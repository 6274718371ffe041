"""GPU probe: can a prefill chunk over a long cached prefix run at cuDNN's rate instead of our Triton
kernel's? Split the chunk's attention into (new tokens x prefix, no mask) + (new x new, causal), each a
cuDNN SDPA call that returns its log-sum-exp, and merge the two. Prints correctness against the Triton
kernel and TFLOP/s of each piece. On a CUDA GPU: python3 scripts/probes/probe_prefix_sdpa.py
"""

from __future__ import annotations

import json
import os
import statistics

import torch

from longserve.attention.metadata import build_metadata
from longserve.kernels.extend_attention import extend_attention


def time_ms(fn, warmup=2, repeats=7):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def cudnn_lse(q, k, v, causal, scale):
    """q [1,H,L,D], k/v [1,H,S,D] -> (o [1,H,L,D], lse [1,H,L] natural log)."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    o, lse = out[0], out[1]
    return o, lse.reshape(q.shape[0], q.shape[1], q.shape[2]).float()


def merged(q, k_pre, v_pre, k_new, v_new, scale):
    o1, l1 = cudnn_lse(q, k_pre, v_pre, False, scale)  # new x prefix: every key visible
    o2, l2 = cudnn_lse(q, k_new, v_new, True, scale)  # new x new: causal square
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    return ((o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]).to(q.dtype)


def probe_case(prefix: int, new: int) -> dict:
    dev, dt = "cuda", torch.bfloat16
    hq, hkv, d, ps = 32, 8, 128, 16
    s = prefix + new
    num_pages = s // ps + 8
    k_cache = torch.randn(num_pages, ps, hkv, d, device=dev, dtype=dt)
    v_cache = torch.randn(num_pages, ps, hkv, d, device=dev, dtype=dt)
    pages = torch.randperm(num_pages - 1, device="cpu")[: -(-s // ps)] + 1
    meta = build_metadata([prefix], [new], [pages.tolist()], ps, dev)
    q = torch.randn(new, hq, d, device=dev, dtype=dt)
    scale = d**-0.5

    def triton_run():
        return extend_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.prefix_lens, meta.seq_lens, meta.page_table,
            ps, new, scale, None,
        )  # fmt: skip

    def gather():
        idx = meta.page_table[0, : -(-s // ps)].long()
        k = k_cache[idx].reshape(-1, hkv, d)[:s]  # [S, Hkv, D]
        v = v_cache[idx].reshape(-1, hkv, d)[:s]
        g = hq // hkv
        k = k.transpose(0, 1).repeat_interleave(g, 0)[None]  # [1, Hq, S, D]
        v = v.transpose(0, 1).repeat_interleave(g, 0)[None]
        return k, v

    def split_run():
        k, v = gather()
        qh = q.transpose(0, 1)[None]  # [1, Hq, L, D]
        o = merged(qh, k[:, :, :prefix], v[:, :, :prefix], k[:, :, prefix:], v[:, :, prefix:], scale)
        return o[0].transpose(0, 1)

    flops = 4 * new * (prefix + (new + 1) / 2) * d * hq
    ref = triton_run().float()
    try:
        got = split_run().float()
        err = ((got - ref).norm() / ref.norm()).item()
        t_split = time_ms(split_run)
        k, v = gather()
        t_gather = time_ms(gather)
    except Exception as e:  # noqa: BLE001 - a probe reports whatever breaks
        err, t_split, t_gather = repr(e)[:200], None, None
    t_triton = time_ms(triton_run)
    row = {
        "prefix": prefix, "new": new, "rel_err_vs_triton": err, "triton_ms": t_triton,
        "triton_tflops": flops / t_triton / 1e9, "split_cudnn_ms": t_split, "gather_ms": t_gather,
        "split_cudnn_tflops": flops / t_split / 1e9 if t_split else None,
    }  # fmt: skip
    print(json.dumps(row))
    return row


def main():
    torch.manual_seed(0)
    rows = [probe_case(p, n) for p, n in ((32768 - 8192, 8192), (122880, 8192), (32768, 64))]
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_prefix_sdpa.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
