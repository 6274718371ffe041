"""GPU probe: the prefix hit's attention (64 new tokens of the Llama-3.1-8B shape over 32K cached keys) through
cuDNN instead of the Triton extend kernel. The Triton kernel runs this at ~180-190 TFLOP/s in every tile, split
and register cap tried (RESULTS.md thirteenth and fifteenth sessions); cuDNN reaches ~590 on long prompts but
gives one program per 128 query rows of a head, so 64 tokens x 32 heads are 32 programs for 132 SMs. Here the
4 q heads of a kv head are packed as 256 query rows (GQA packing) and the keys split S ways as a batch of S
(strided views of consecutive pages, no copy), then merged by their log-sum-exps: 8 x 2 x S programs.

Prints each variant's time (CUDA events over 20 replays, after warm-up), its error against an fp32 reference
of the prefix part, and the Triton kernel's time for the whole attention (prefix and the causal new part).
On a CUDA GPU: python3 scripts/probes/probe_hit_cudnn.py
"""

from __future__ import annotations

from functools import partial

import torch

from longserve.attention.sdpa import attention_with_lse
from longserve.kernels.extend_attention import choose_extend_splits, extend_attention
from longserve.platform import cuda_time_ms as timed

T, HQ, HKV, D, PREFIX, PAGE = 64, 32, 8, 128, 32768, 16
GROUP = HQ // HKV


def packed_prefix(q, k_pre, v_pre, splits, scale, expand_contiguous):
    """o [T, HQ, D] of the new tokens over the prefix keys alone, GQA-packed and split `splits` ways."""
    qg = q.view(T, HKV, GROUP, D).permute(1, 0, 2, 3).reshape(HKV, T * GROUP, D)  # rows: token * GROUP + g
    length = PREFIX // splits
    k_s = k_pre.view(splits, length, HKV, D).permute(0, 2, 1, 3)  # [S, HKV, L, D] strided view
    v_s = v_pre.view(splits, length, HKV, D).permute(0, 2, 1, 3)
    q_s = qg.unsqueeze(0).expand(splits, HKV, T * GROUP, D)
    if expand_contiguous:
        q_s = q_s.contiguous()
    o, lse = attention_with_lse(q_s, k_s, v_s, False, scale)  # [S, HKV, R, D], [S, HKV, R]
    w = torch.softmax(lse.float(), dim=0)  # [S, HKV, R]
    merged = (o.float() * w.unsqueeze(-1)).sum(0)  # [HKV, R, D]
    return merged.view(HKV, T, GROUP, D).permute(1, 0, 2, 3).reshape(T, HQ, D)


def unpacked_prefix(q, k_pre, v_pre, splits, scale):
    """The same with the q heads as heads (cuDNN's GQA): 32 heads x 1 row block x S programs."""
    length = PREFIX // splits
    k_s = k_pre.view(splits, length, HKV, D).permute(0, 2, 1, 3)
    v_s = v_pre.view(splits, length, HKV, D).permute(0, 2, 1, 3)
    q_s = q.permute(1, 0, 2).unsqueeze(0).expand(splits, HQ, T, D).contiguous()
    o, lse = attention_with_lse(q_s, k_s, v_s, False, scale)
    w = torch.softmax(lse.float(), dim=0)
    return (o.float() * w.unsqueeze(-1)).sum(0).permute(1, 0, 2)  # [T, HQ, D]


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    scale = D**-0.5
    pages = -(-(PREFIX + T) // PAGE)
    k_cache = torch.randn(pages, PAGE, HKV, D, dtype=torch.bfloat16, device=dev)
    v_cache = torch.randn(pages, PAGE, HKV, D, dtype=torch.bfloat16, device=dev)
    q = torch.randn(T, HQ, D, dtype=torch.bfloat16, device=dev)
    k_pre = k_cache.flatten(0, 1)[:PREFIX]  # consecutive pages: [S, HKV, D] views
    v_pre = v_cache.flatten(0, 1)[:PREFIX]

    # fp32 reference of the prefix part on a few heads' worth: all of it (32K x 64 x 32 fits)
    kf = k_pre.float().repeat_interleave(GROUP, 1).permute(1, 0, 2)  # [HQ, S, D]
    vf = v_pre.float().repeat_interleave(GROUP, 1).permute(1, 0, 2)
    ref = torch.softmax(q.float().permute(1, 0, 2) @ kf.transpose(1, 2) * scale, -1) @ vf  # [HQ, T, D]
    ref = ref.permute(1, 0, 2)
    del kf, vf

    # the Triton kernel over the whole hit (prefix + causal new part), as the engine runs it
    i32 = dict(dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, T], **i32)
    prefix_lens = torch.tensor([PREFIX], **i32)
    seq_lens = torch.tensor([PREFIX + T], **i32)
    page_table = torch.arange(pages, **i32).view(1, -1)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    splits = choose_extend_splits([T], [PREFIX + T], HQ, HKV, cfg["BLOCK_M"])
    tri_ms = timed(
        lambda: extend_attention(
            q,
            k_cache,
            v_cache,
            qsl,
            prefix_lens,
            seq_lens,
            page_table,
            PAGE,
            T,
            scale,
            config=cfg,
            num_splits=splits,
        )  # fmt: skip
    )
    flops = 4 * T * HQ * D * PREFIX
    print(
        f"triton extend (whole hit, {splits} splits): {tri_ms * 1e3:.1f} us, {flops / tri_ms / 1e9:.0f} TFLOP/s"
    )
    for s in (1, 4, 8, 16, 32):
        for label, fn in (
            ("packed", partial(packed_prefix, q, k_pre, v_pre, s, scale, True)),
            ("packed, q expanded as a view", partial(packed_prefix, q, k_pre, v_pre, s, scale, False)),
            ("unpacked", partial(unpacked_prefix, q, k_pre, v_pre, s, scale)),
        ):
            try:
                err = (fn() - ref).abs().max().item()
                ms = timed(fn)
                length = PREFIX // s
                print(
                    f"cuDNN {label}, {s} splits of {length} keys: {ms * 1e3:.1f} us with the torch merge "
                    f"({flops / ms / 1e9:.0f} TFLOP/s), max err {err:.2e}",
                    flush=True,
                )
            except RuntimeError as e:
                print(f"cuDNN {label}, {s} splits: failed: {str(e)[:200]}", flush=True)
    # the cuDNN call alone at its best split, without the merge
    for s in (8, 16, 32):
        length = PREFIX // s
        k_s = k_pre.view(s, length, HKV, D).permute(0, 2, 1, 3)
        v_s = v_pre.view(s, length, HKV, D).permute(0, 2, 1, 3)
        qg = q.view(T, HKV, GROUP, D).permute(1, 0, 2, 3).reshape(HKV, T * GROUP, D)
        q_s = qg.unsqueeze(0).expand(s, HKV, T * GROUP, D).contiguous()
        ms = timed(partial(attention_with_lse, q_s, k_s, v_s, False, scale))
        print(f"cuDNN packed call alone, {s} splits: {ms * 1e3:.1f} us ({flops / ms / 1e9:.0f} TFLOP/s)")


if __name__ == "__main__":
    main()
