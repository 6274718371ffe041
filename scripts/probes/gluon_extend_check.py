"""Checks of the Gluon extend kernel (longserve/kernels/gluon_extend.py): on an H200 against the fp32 reference
(`extend_attention_ref`) and timed beside the Triton extend kernel the engine runs, on the prefix hit's shapes;
built for sm90 on any machine (`--compile-only`, Triton 3.6-3.9); its work split in torch on the CPU (`--emulate`:
the tiles, key splits, per-token masks and finite running max, merged as `merge_splits` does). Writes
$OUT/gluon_extend.json on a GPU. GLUON_EXTEND_WAVES picks the split count (gluon_extend.choose_splits; the
engine passes the Triton kernel's, timed too).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import sys

import torch

from longserve.kernels.attention_reference import extend_attention_ref

TILE_M, PART_M, BLOCK_N = 128, 64, 128
HQ, HKV, D = 32, 8, 128  # the Llama-3.1-8B shape


def make_case(
    prefix_lens,
    query_lens,
    page_size,
    hq=HQ,
    hkv=HKV,
    scattered=True,
    device="cpu",
    seed=0,
    pad=0,
    stale=False,
):
    """q and a paged bf16 cache holding every request's prefix and new tokens, with its metadata. pad: each request's
    query that many tokens longer than its seq_len counts, as a CUDA graph's bucket pads it (cuda_graph.py). stale:
    every slot no request owns non-finite (page 0, and each last page's slots past its request's end), as an earlier
    owner's broken K/V could leave them."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefix_lens, query_lens)]
    query_lens = [n + pad for n in query_lens]
    pages = [-(-s // page_size) for s in seq_lens]
    pool = list(range(1, sum(pages) + 2))  # page 0 reserved, as in the engine
    if scattered:
        random.Random(seed).shuffle(pool)
    tables, at = [], 0
    for n in pages:
        tables.append(pool[at : at + n])
        at += n
    width = max(pages)
    page_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    num_pages = len(pool) + 1
    k_cache = torch.randn(num_pages, page_size, hkv, D, generator=g).bfloat16()
    v_cache = torch.randn(num_pages, page_size, hkv, D, generator=g).bfloat16()
    if stale:
        k_cache[0], v_cache[0] = float("nan"), float("inf")
        for t, n in zip(tables, seq_lens):
            k_cache[t[(n - 1) // page_size], n % page_size or page_size :] = float("nan")
            v_cache[t[(n - 1) // page_size], n % page_size or page_size :] = float("inf")
    q = torch.randn(sum(query_lens), hq, D, generator=g).bfloat16()
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = [torch.tensor(x, dtype=torch.int32) for x in (starts, prefix_lens, seq_lens)]
    to = lambda t: t.to(device)  # noqa: E731
    return to(q), to(k_cache), to(v_cache), *map(to, meta), to(page_table)


def emulate(
    q, k_cache, v_cache, query_start_loc, prefix_lens, seq_lens, page_table, page_size, num_splits, scale
):
    """The kernel's programs in torch: per (row tile, request, kv head, split) the key range, each block as its TMA
    boxes bring it (page-table slots clamped to the request's last page, stale slots and all), the request's last V
    block zeroed past its end as the first consumer does (`_zero_past_end`, on the block the loader lands apart),
    masks only from `first_masked` on, the finite running max, the partial and its base-2 LSE; then the merge."""
    num_tokens, hq, _ = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    qk_scale = scale * 1.4426950408889634
    part = torch.full(
        (num_tokens, hq, num_splits, D), float("nan")
    )  # unwritten: NaN, which the merge would show
    lse = torch.full((num_tokens, hq, num_splits), float("nan"))
    starts, prefixes, seqs = query_start_loc.tolist(), prefix_lens.tolist(), seq_lens.tolist()
    for req, (prefix_len, seq_len) in enumerate(zip(prefixes, seqs)):
        q_start, num_rows = starts[req], (starts[req + 1] - starts[req]) * group
        last_slot = (seq_len - 1) // page_size
        for row0 in range(0, num_rows, TILE_M):
            hi = min(prefix_len + (min(row0 + TILE_M, num_rows) - 1) // group + 1, seq_len)
            chunk = math.ceil(math.ceil(hi / num_splits) / BLOCK_N) * BLOCK_N
            for kv_head in range(hkv):
                for split in range(num_splits):
                    s_lo = split * chunk
                    n_blocks = -(-max(min(s_lo + chunk, hi) - s_lo, 0) // BLOCK_N)
                    # the loader lands a block holding the request's end on a barrier the first consumer waits on
                    # once (gluon_extend._extend_loader): only the split's last block may hold it
                    ends = [j for j in range(n_blocks) if s_lo + (j + 1) * BLOCK_N > seq_len]
                    assert ends in ([], [n_blocks - 1]), (req, row0, split, ends, n_blocks)
                    blocks = []
                    for j in range(n_blocks):
                        cols = s_lo + j * BLOCK_N + torch.arange(BLOCK_N)  # absolute keys
                        page = page_table[req, torch.clamp(cols // page_size, max=last_slot)].long()
                        kt = k_cache[page, cols % page_size, kv_head].float()
                        vt = v_cache[page, cols % page_size, kv_head].float()
                        if j in ends:  # _zero_past_end: the groups of 8 rows holding a key past the end
                            for i in range(BLOCK_N // 8):
                                if int(cols[0]) + (i + 1) * 8 > seq_len:
                                    group8 = slice(i * 8, (i + 1) * 8)
                                    vt[group8][cols[group8] >= seq_len] = 0.0
                        blocks.append((cols, kt, vt))
                    for r0 in (row0, row0 + PART_M):
                        rows = torch.arange(r0, r0 + PART_M)
                        tok = rows // group
                        qt = torch.zeros(PART_M, D)
                        real = rows < num_rows
                        qt[real] = q[q_start + tok[real], kv_head * group + rows[real] % group].float()
                        m_i, l_i, acc = (
                            torch.full((PART_M,), -1.0e30),
                            torch.zeros(PART_M),
                            torch.zeros(PART_M, D),
                        )
                        # blocks from first_masked on cross this part's first token's diagonal or the request's end
                        first_masked = (
                            max(min(seq_len - s_lo, prefix_len - s_lo + r0 // group + 1), 0) // BLOCK_N
                        )
                        for j, (cols, kt, vt) in enumerate(blocks):
                            s = qt @ kt.T
                            if j >= first_masked:
                                keep = (cols[None, :] < seq_len) & (
                                    cols[None, :] <= (prefix_len + tok)[:, None]
                                )
                                s = torch.where(keep, s, torch.tensor(-float("inf")))
                            m_new = torch.maximum(m_i, s.max(1).values * qk_scale)
                            p = torch.exp2(s * qk_scale - m_new[:, None])
                            alpha = torch.exp2(m_i - m_new)
                            l_i = l_i * alpha + p.sum(1)
                            acc = acc * alpha[:, None] + p.bfloat16().float() @ vt
                            m_i = m_new
                        has = l_i > 0
                        l_safe = torch.where(has, l_i, torch.ones_like(l_i))
                        for i in torch.nonzero(real).flatten().tolist():
                            t, h = q_start + int(tok[i]), kv_head * group + int(rows[i]) % group
                            part[t, h, split] = acc[i] / l_safe[i]
                            lse[t, h, split] = m_i[i] + torch.log2(l_safe[i]) if has[i] else -float("inf")
    assert not torch.isnan(lse).any(), "a (token, head, split) no program wrote"
    w = torch.exp2(lse - lse.max(-1, keepdim=True).values)  # merge_splits
    return (part * w[..., None]).sum(2) / w.sum(-1, keepdim=True)


# (prefix_lens, query_lens, page_size, splits, padding tokens a request); every stale slot non-finite
EMULATED = [
    ([300], [20], 16, 1, 0),
    ([300], [20], 16, 3, 0),  # a split past the tile's keys: empty, weighs nothing
    ([0, 1000, 77], [40, 33, 5], 16, 4, 0),  # a cold chunk, a suffix, a short one; scattered pages
    ([500], [70], 32, 2, 0),  # 280 packed rows: three tiles, the last partial
    ([1000], [17], 16, 1, 239),  # a graph's bucket of 256 over 17 tokens: keys end at seq_len
    ([1000], [17], 16, 7, 239),  # the same bucket in 7 splits
    ([896], [128], 32, 3, 128),  # seq_len 1024, a multiple of the key block, padded
    ([300, 0, 90], [1, 100, 5], 64, 5, 0),  # a decode row, a cold chunk under 128 keys; empty splits
]


def time_ms(fn) -> float:
    from longserve.platform import cuda_time_ms

    return cuda_time_ms(fn, warmup=3, iters=5, repeats=10)


def check_case(prefix_lens, query_lens, page_size: int, scattered: bool) -> dict:
    """One batch: the kernel against fp32 and timed beside the Triton extend kernel at its own split count."""
    from longserve.kernels import gluon_extend as ge
    from longserve.kernels.extend_attention import choose_extend_splits, extend_attention

    q, k_cache, v_cache, qsl, pre, seq, pt = make_case(prefix_lens, query_lens, page_size, scattered=scattered,
                                                       device="cuda")  # fmt: skip
    args = (q, k_cache, v_cache, qsl, pre, seq, pt, page_size, max(query_lens), D**-0.5)
    row = {
        "prefix_lens": prefix_lens,
        "query_lens": query_lens,
        "page_size": page_size,
        "scattered": scattered,
    }
    ref = extend_attention_ref(q.float(), *args[1:])
    waves = float(os.environ.get("GLUON_EXTEND_WAVES", "2"))
    splits = ge.choose_splits(query_lens, seq.tolist(), HQ // HKV, HKV, waves=waves)
    t_splits = choose_extend_splits(query_lens, seq.tolist(), HQ, HKV, 128)
    row.update(gluon_splits=splits, triton_splits=t_splits)
    try:
        row["max_err"] = (ge.extend_attention(*args, splits).float() - ref).abs().max().item()
        row["gluon_ms"] = round(time_ms(lambda: ge.extend_attention(*args, splits)), 4)
        # at the Triton kernel's split count, as the engine calls it
        row["gluon_at_triton_splits_ms"] = round(time_ms(lambda: ge.extend_attention(*args, t_splits)), 4)
    except Exception as e:  # noqa: BLE001 - a probe reports whatever breaks
        row["error"] = repr(e)[:400]
    row["triton_err"] = (extend_attention(*args, num_splits=t_splits).float() - ref).abs().max().item()
    row["triton_ms"] = round(time_ms(lambda: extend_attention(*args, num_splits=t_splits)), 4)
    return row


def gpu_check() -> None:
    rows = []
    cases = [([32768], [64], 16, True), ([32768], [64], 16, False), ([32768], [1024], 16, True),
             ([32768], [256], 16, True), ([8192, 4000, 100], [64, 512, 30], 16, True), ([2000], [300], 64, True),
             ([32768 * 3], [64], 16, True)]  # fmt: skip
    for case in cases:
        rows.append(check_case(*case))
        print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "gluon_extend.json"), "w") as f:
        json.dump(rows, f, indent=1)


def compile_only() -> None:
    """Build the kernel for sm90 here (no GPU): registers, spills, shared memory, the key-block loop's SASS."""
    from triton.runtime.jit import mangle_type

    from longserve.kernels import gluon_extend as ge
    from longserve.testing.kernel_compile import gluon_sm90_report

    cache = torch.zeros(64 * 16, HKV * D, dtype=torch.bfloat16)
    layout = ge.gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], ge.gl.bfloat16)
    desc = ge.TensorDescriptor(cache, list(cache.shape), list(cache.stride()), [ge.KEY_BOX, D], layout)
    signature = {"q_ptr": "*bf16", "k_desc": mangle_type(desc), "v_desc": mangle_type(desc), "o_ptr": "*fp32",
                 "lse_ptr": "*fp32", "query_start_loc_ptr": "*i32", "prefix_lens_ptr": "*i32", "seq_lens_ptr": "*i32",
                 "page_table_ptr": "*i32", "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32",
                 "stride_oh": "i32", "stride_os": "i32", "stride_pt": "i32", "page_size": "i32", "qk_scale": "fp32",
                 "num_splits": "i32", "num_q_heads": "i32"}  # fmt: skip
    constexprs = {"GROUP": HQ // HKV, "TILE_M": TILE_M, "PART_M": PART_M, "BLOCK_N": BLOCK_N, "HEAD_DIM": D,
                  "STAGES": ge.STAGES, "num_warps": 4}  # fmt: skip
    signature.update({n: "constexpr" for n in constexprs})
    print(
        json.dumps(gluon_sm90_report(ge.extend_fwd_kernel, signature, constexprs, num_warps=4, maxnreg=168))
    )


if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        compile_only()
    elif "--emulate" in sys.argv:
        for prefix_lens, query_lens, page_size, splits, pad in EMULATED:
            q, k_cache, v_cache, qsl, pre, seq, pt = make_case(
                prefix_lens, query_lens, page_size, hq=8, hkv=2, pad=pad, stale=True
            )
            args = (qsl, pre, seq, pt, page_size)
            out = emulate(q, k_cache, v_cache, *args, splits, D**-0.5)
            # the real tokens: each request's first query_lens of its rows, against attention without the padding
            real = torch.cat([torch.arange(a, a + n) for a, n in zip(qsl[:-1].tolist(), query_lens)])
            real_qsl = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
            ref = extend_attention_ref(q[real].float(), k_cache, v_cache, real_qsl, pre, seq, pt, page_size,
                                       max(query_lens), D**-0.5)  # fmt: skip
            print(json.dumps({"prefix_lens": prefix_lens, "query_lens": query_lens, "page_size": page_size,
                              "splits": splits, "padding": pad, "finite": bool(torch.isfinite(out[real]).all()),
                              "max_err": (out[real] - ref).abs().max().item()}))  # fmt: skip
    else:
        gpu_check()
