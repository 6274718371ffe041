"""GPU timing of the attention kernels at serving shapes: TFLOP/s for prefill/extend, GB/s for decode.

`bench_attention()` returns one dict per (case, implementation) and prints nothing; CUDA only.
Timing: CUDA events around each call, after warm-up, median of the repeats.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from longserve.attention.metadata import build_metadata
from longserve.attention.sdpa import cold_sdpa, prefix_split_sdpa
from longserve.kernels import split_k
from longserve.kernels.decode_attention import choose_num_splits, decode_attention
from longserve.kernels.extend_attention import choose_extend_splits, extend_attention, extend_config


@dataclass(frozen=True)
class BenchCase:
    name: str
    prefix_len: int  # cached tokens per request
    query_len: int  # new tokens per request (1 = decode)
    num_reqs: int = 1


DEFAULT_CASES = (
    BenchCase("cold_8k", 0, 8192),
    BenchCase("cold_32k", 0, 32768),
    BenchCase("chunk_8k_over_120k", 122880, 8192),
    BenchCase("suffix_64_over_32k", 32768, 64),
    BenchCase("decode_32k", 32767, 1),
    BenchCase("decode_128k", 131071, 1),
)


def time_ms(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median milliseconds of `fn` over `repeats` CUDA-event-timed calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_attention(
    cases: tuple[BenchCase, ...] | list[BenchCase] = DEFAULT_CASES,
    dtype: torch.dtype = torch.bfloat16,
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
    warmup: int = 3,
    repeats: int = 10,
    extend_config: dict[str, int] | None = None,
    decode_config: dict[str, int] | None = None,
    num_splits: int | None = None,
    extend_splits: int | None = None,
    device: str = "cuda",
) -> list[dict[str, object]]:
    """Time triton (and SDPA for cold prompts, the split cuDNN path over a prefix) per case; rows: case, impl, ms, tflops, gbps, shapes."""
    assert torch.cuda.is_available(), "bench_attention needs a CUDA GPU"
    shapes = {"num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    knobs = {
        "extend_cfg": extend_config, "decode_cfg": decode_config, "num_splits": num_splits,
        "extend_splits": extend_splits,
    }  # fmt: skip
    rows: list[dict[str, object]] = []
    for case in cases:
        rows += _bench_case(case, dtype, page_size, warmup, repeats, device, **shapes, **knobs)
        torch.cuda.empty_cache()
    return rows


def _bench_case(
    case: BenchCase,
    dtype: torch.dtype,
    page_size: int,
    warmup: int,
    repeats: int,
    device: str,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    extend_cfg: dict[str, int] | None,
    decode_cfg: dict[str, int] | None,
    num_splits: int | None,
    extend_splits: int | None,
) -> list[dict[str, object]]:
    scale = head_dim**-0.5
    elem = torch.empty((), dtype=dtype).element_size()
    prefix_lens, query_lens = [case.prefix_len] * case.num_reqs, [case.query_len] * case.num_reqs
    seq_len = case.prefix_len + case.query_len
    pages_per_req = -(-seq_len // page_size)
    pool = list(range(pages_per_req * case.num_reqs))
    random.Random(0).shuffle(pool)  # scattered pages, as after a while of serving
    page_tables = [pool[r * pages_per_req : (r + 1) * pages_per_req] for r in range(case.num_reqs)]
    meta = build_metadata(prefix_lens, query_lens, page_tables, page_size, device)
    shape = (len(pool), page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)  # [num_pages, page_size, Hkv, D]
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    num_tokens = meta.num_tokens
    q = torch.randn(num_tokens, num_q_heads, head_dim, dtype=dtype, device=device)  # [T, Hq, D]
    common = {
        "case": case.name, "prefix_len": case.prefix_len, "query_len": case.query_len,
        "num_reqs": case.num_reqs, "dtype": str(dtype).removeprefix("torch."), "page_size": page_size,
    }  # fmt: skip

    if case.query_len == 1:
        num_sms = split_k.num_sms(q.device.index or 0)
        splits = num_splits or choose_num_splits(seq_len, case.num_reqs, num_kv_heads, num_sms)

        def decode() -> torch.Tensor:
            return decode_attention(
                q, k_cache, v_cache, meta.seq_lens, meta.page_table, page_size, scale, None, splits,
                config=decode_cfg,
            )  # fmt: skip

        ms = time_ms(decode, warmup, repeats)
        kv_bytes = 2 * case.num_reqs * seq_len * num_kv_heads * head_dim * elem
        flops = 4 * case.num_reqs * num_q_heads * head_dim * seq_len
        row = {**common, "impl": "triton", "num_splits": splits, "ms": ms}
        return [{**row, "tflops": flops / ms / 1e9, "gbps": kv_bytes / ms / 1e6}]

    cfg = extend_cfg or extend_config(head_dim, dtype)
    num_sms = split_k.num_sms(q.device.index or 0)
    splits = extend_splits or choose_extend_splits(
        query_lens, meta.seq_lens_cpu, num_q_heads, num_kv_heads, cfg["BLOCK_M"], num_sms
    )

    def triton_extend() -> torch.Tensor:
        return extend_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.prefix_lens, meta.seq_lens, meta.page_table,
            page_size, meta.max_query_len, scale, None, config=cfg, num_splits=splits,
        )  # fmt: skip

    impls: dict[str, Callable[[], object]] = {"triton": triton_extend}
    k_new = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)  # [T, Hkv, D]
    v_new = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)  # [T, Hkv, D]
    if case.prefix_len == 0:
        impls["sdpa"] = lambda: cold_sdpa(q, k_new, v_new, query_lens, scale)
    elif dtype in (torch.float16, torch.bfloat16):  # the backend's cuDNN path for long chunks over a prefix
        impls["split_sdpa"] = lambda: prefix_split_sdpa(q, k_new, v_new, k_cache, v_cache, meta, scale)
    # causal area: each new token sees the prefix plus the new tokens up to itself
    visible = case.query_len * case.prefix_len + case.query_len * (case.query_len + 1) // 2
    flops = 4 * case.num_reqs * num_q_heads * head_dim * visible
    rows = []
    for impl, fn in impls.items():
        ms = time_ms(fn, warmup, repeats)
        row = {**common, "impl": impl, "num_splits": splits if impl == "triton" else None, "ms": ms}
        rows.append({**row, "tflops": flops / ms / 1e9, "gbps": None})
    return rows
