"""GPU probe: our cold-prefill attention against vLLM's FlashAttention-3, one layer of the Llama-3.1-8B shape
(32 q heads, 8 kv heads, head dim 128, bf16), on the same chip in the same process. Issue 19's cold 32K/128K gap
to vLLM was put on "the attention kernel itself" (RESULTS.md, sixteenth session) without FA3 ever timed beside
cuDNN: this times both on the shapes a chunked prefill runs.

Cases, each per layer, median of CUDA-event timings:
- causal L x L (a cold chunk with no prefix): our `cold_sdpa` (cuDNN, padded rows) against FA3 varlen causal;
- a chunk of C new tokens over a prefix of P cached tokens on consecutive pages: our `prefix_split_sdpa` (a
  cuDNN call over the prefix, a causal one over the new tokens, the merge) against FA3 with the paged cache
  and block table (as vLLM runs it: one call, causal mask aligned to the bottom right);
- the pieces of ours alone (the two cuDNN calls, the merge), to say where a difference lies.
Each FA3 output is checked against ours (relative error). Needs vLLM's build on PYTHONPATH (`.anchor/`, see
`../shared/anchors/README.md`): `PYTHONPATH=.:/tmp/site python3 scripts/probes/attention_vs_fa3.py`. Prints one
JSON line a case and writes `$OUT/attention_vs_fa3.json`.

`PROBE_SUSTAINED=SECONDS` instead runs each library's calls back to back for that long, twice each, alternating
(cuDNN, FA3, cuDNN, FA3), with the chip's SM clock and power read every 100 ms (`nvidia-smi -lms`): the 128K
prompt's calls (8K new over 120K keys, no mask; the 8K causal square), as `with_fa3.py` substitutes them. In the
engine FA3's calls took 7.8% off a 128K prompt where these bursts found the prefix calls equal (RESULTS.md,
twenty-first session): whether a chip held at its 700 W limit runs one library's calls at a higher clock.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import threading
import time

import torch

from longserve.attention import sdpa
from longserve.attention.metadata import build_metadata
from longserve.platform import cuda_time_ms

HQ, HKV, D, PAGE = 32, 8, 128, 16
DT = torch.bfloat16


def time_ms(fn) -> float:
    return cuda_time_ms(fn, warmup=3, iters=1, repeats=10)  # median ms of 10 single calls


def fa3(q, k, v, cu_q, max_q, *, cu_k=None, max_k=None, seqused_k=None, block_table=None):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q, k, v, max_q, cu_q, max_k, cu_seqlens_k=cu_k, seqused_k=seqused_k, softmax_scale=D**-0.5,
        causal=True, block_table=block_table, fa_version=3,
    )  # fmt: skip


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def tflops(flop: float, ms: float) -> float:
    return round(flop / ms / 1e9, 1)


def cold_case(length: int) -> dict:
    dev = "cuda"
    q = torch.randn(length, HQ, D, device=dev, dtype=DT)
    k = torch.randn(length, HKV, D, device=dev, dtype=DT)
    v = torch.randn(length, HKV, D, device=dev, dtype=DT)
    cu = torch.tensor([0, length], dtype=torch.int32, device=dev)
    ours = lambda: sdpa.cold_sdpa(q, k, v, [length], D**-0.5)  # noqa: E731
    theirs = lambda: fa3(q, k, v, cu, length, cu_k=cu, max_k=length)  # noqa: E731
    flop = 4 * length * (length + 1) / 2 * D * HQ
    t_ours, t_fa3 = time_ms(ours), time_ms(theirs)
    return {
        "case": "cold", "new": length, "prefix": 0, "ours_ms": round(t_ours, 3), "fa3_ms": round(t_fa3, 3),
        "ours_tflops": tflops(flop, t_ours), "fa3_tflops": tflops(flop, t_fa3), "fa3_over_ours": round(t_fa3 / t_ours, 3),
        "rel_err": rel_err(theirs(), ours()),
    }  # fmt: skip


def chunk_case(prefix: int, new: int) -> dict:
    dev = "cuda"
    total = prefix + new
    num_pages = -(-total // PAGE)
    k_cache = torch.randn(
        num_pages + 1, PAGE, HKV, D, device=dev, dtype=DT
    )  # page 0: padding, as ours keeps it
    v_cache = torch.randn(num_pages + 1, PAGE, HKV, D, device=dev, dtype=DT)
    pages = list(range(1, num_pages + 1))  # consecutive, as a lone cold prompt gets them
    meta = build_metadata([prefix], [new], [pages], PAGE, dev)
    q = torch.randn(new, HQ, D, device=dev, dtype=DT)
    flat_k = k_cache[1:].flatten(0, 1)[:total]  # the new tokens' K/V as the cache holds them after the store
    flat_v = v_cache[1:].flatten(0, 1)[:total]
    k_new, v_new = flat_k[prefix:].contiguous(), flat_v[prefix:].contiguous()
    scale = D**-0.5
    ours = lambda: sdpa.prefix_split_sdpa(q, k_new, v_new, k_cache, v_cache, meta, scale)  # noqa: E731
    cu_q = torch.tensor([0, new], dtype=torch.int32, device=dev)
    used = torch.tensor([total], dtype=torch.int32, device=dev)
    table = torch.tensor([pages], dtype=torch.int32, device=dev)
    theirs = lambda: fa3(q, k_cache, v_cache, cu_q, new, max_k=total, seqused_k=used, block_table=table)  # noqa: E731
    flop = 4 * new * (prefix + (new + 1) / 2) * D * HQ
    t_ours, t_fa3 = time_ms(ours), time_ms(theirs)
    # ours in pieces: the causal call over the new tokens, the call over the prefix, the merge
    qh = sdpa._heads(q)
    kp, vp = sdpa._heads(flat_k[:prefix]), sdpa._heads(flat_v[:prefix])
    kn, vn = sdpa._heads(k_new), sdpa._heads(v_new)
    t_causal = time_ms(lambda: sdpa.attention_with_lse(qh, kn, vn, True, scale))
    t_prefix = time_ms(lambda: sdpa.attention_with_lse(qh, kp, vp, False, scale))
    from longserve.kernels.merge_attention import merge_two

    o_a, l_a = sdpa.attention_with_lse(qh, kp, vp, False, scale)
    o_b, l_b = sdpa.attention_with_lse(qh, kn, vn, True, scale)
    out = torch.empty_like(q)
    t_merge = time_ms(lambda: merge_two(o_a[0], l_a[0], o_b[0], l_b[0], out))
    return {
        "case": "chunk", "new": new, "prefix": prefix, "ours_ms": round(t_ours, 3), "fa3_ms": round(t_fa3, 3),
        "ours_tflops": tflops(flop, t_ours), "fa3_tflops": tflops(flop, t_fa3), "fa3_over_ours": round(t_fa3 / t_ours, 3),
        "rel_err": rel_err(theirs(), ours()), "ours_causal_ms": round(t_causal, 3),
        "ours_prefix_ms": round(t_prefix, 3), "ours_merge_ms": round(t_merge, 3),
        "prefix_tflops": tflops(4 * new * prefix * D * HQ, t_prefix),
        "causal_tflops": tflops(4 * new * (new + 1) / 2 * D * HQ, t_causal),
    }  # fmt: skip


def sustained(seconds: float) -> list[dict]:
    """Back-to-back calls of each library for `seconds`, twice each alternating; ms a call over each window's
    second half, and the SM clock / power read meanwhile."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    dev, scale = "cuda", D**-0.5
    new, keys = 8192, 122880
    qkv = torch.randn(new, (HQ + 2 * HKV) * D, device=dev, dtype=DT)  # the engine's fused layout
    q, k_new, v_new = (t.view(new, -1, D) for t in qkv.split([HQ * D, HKV * D, HKV * D], dim=1))
    k = torch.randn(keys, HKV, D, device=dev, dtype=DT)
    v = torch.randn(keys, HKV, D, device=dev, dtype=DT)

    def fa3_call(kk, vv, causal):
        n = kk.shape[0]
        cu_q = torch.tensor([0, new], dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, n], dtype=torch.int32, device=dev)
        return lambda: flash_attn_varlen_func(
            q, kk, vv, new, cu_q, n, cu_seqlens_k=cu_k, softmax_scale=scale, causal=causal,
            return_softmax_lse=True, fa_version=3,
        )  # fmt: skip

    def cudnn_call(kk, vv, causal):
        return lambda: sdpa.attention_with_lse(
            sdpa._heads(q), sdpa._heads(kk), sdpa._heads(vv), causal, scale
        )

    cases = {
        "prefix 8K over 120K": (4 * new * keys * D * HQ, {"cudnn": cudnn_call(k, v, False), "fa3": fa3_call(k, v, False)}),
        "causal 8K": (4 * new * (new + 1) / 2 * D * HQ,
                      {"cudnn": cudnn_call(k_new, v_new, True), "fa3": fa3_call(k_new, v_new, True)}),
    }  # fmt: skip
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "100"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    readings: list[tuple[float, float, float]] = []

    def read_smi() -> None:
        for line in smi.stdout:
            try:
                sm, watts = (float(x) for x in line.split(","))
            except ValueError:
                continue
            readings.append((time.monotonic(), sm, watts))

    threading.Thread(target=read_smi, daemon=True).start()
    rows = []
    for name, (flop, calls) in cases.items():
        for lib in ("cudnn", "fa3", "cudnn", "fa3"):
            fn = calls[lib]
            start = time.monotonic()
            times = []
            while time.monotonic() - start < seconds:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(4):
                    fn()
                b.record()
                torch.cuda.synchronize()
                times.append((time.monotonic() - start, a.elapsed_time(b) / 4))
            half = [ms for t, ms in times if t >= seconds / 2]
            mid = start + seconds / 2
            clocks = [(sm, w) for t, sm, w in readings if mid <= t <= start + seconds]
            row = {
                "case": name, "library": lib, "ms": round(statistics.median(half), 3),
                "tflops": tflops(flop, statistics.median(half)),
                "sm_mhz": statistics.median(c[0] for c in clocks) if clocks else None,
                "watts": round(statistics.median(c[1] for c in clocks), 1) if clocks else None,
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    smi.terminate()
    return rows


def main() -> None:
    torch.manual_seed(0)
    print(json.dumps({"cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name()}))
    if os.environ.get("PROBE_SUSTAINED"):
        rows = sustained(float(os.environ["PROBE_SUSTAINED"]))
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "attention_vs_fa3_sustained.json"), "w") as f:
            json.dump(rows, f, indent=1)
        return
    rows = []
    for length in (8192, 16384, 32768):
        rows.append(cold_case(length))
        print(json.dumps(rows[-1]), flush=True)
    for prefix, new in (
        (8192, 8192),
        (24576, 8192),
        (57344, 8192),
        (122880, 8192),
        (16384, 16384),
        (114688, 16384),
    ):
        rows.append(chunk_case(prefix, new))
        print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "attention_vs_fa3.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
