"""GPU probe: can the prefix hit's packed cuDNN call live inside a CUDA graph? (RESULTS.md sixteenth session: the
packed call, eager between the piecewise graphs, scattered the 8B hit over 11.9-22.1 ms where the Triton kernel in
one graph held 13.4-14.3 ms; its plan fixes the key count, so the graph cannot hold it.)

The candidate is cuDNN's ragged (THD) form, `aten::_cudnn_attention_forward(q, k, v, None, cum_seq_q, cum_seq_k,
max_q, max_k, ...)` (what `torch.nn.attention.varlen` calls): its plan fixes only the batch and the longest
query and key runs, and each run's start comes from the device tensors cum_seq_q / cum_seq_k (torch multiplies
them by the token stride into cuDNN's ragged offsets). So the whole layer's cache can be the key tensor and the
prefix's splits runs of at most 2048 keys starting at its first slot, unused splits empty: one plan per context,
no pointer or length baked into the graph. This probe answers, for 64 new tokens of the Llama-3.1-8B shape (4 q
heads a kv head packed as 256 rows of 8 "heads") over a cached prefix:

1. does the op take key runs that start past 0 (cum_seq_k[0] = the prefix's first slot), a last run shorter
   than the others, and empty runs after it, and what do its log-sum-exps hold for the empty ones;
2. is it right (against an fp32 reference of the prefix part), at two prefixes and first slots;
3. does a CUDA graph captured once give the right answer after new q rows and new cum_seq_k are copied in;
4. how long it takes against the packed call as the engine runs it (`sdpa.packed_prefix_sdpa`) and the Triton
   extend kernel over the whole hit, at split counts for 40K and 128K contexts.

On a CUDA GPU: python3 scripts/probes/probe_ragged_cudnn.py
"""

from __future__ import annotations

import traceback
from functools import partial

import torch

from longserve.attention.sdpa import packed_prefix_sdpa
from longserve.kernels.extend_attention import choose_extend_splits, extend_attention
from longserve.platform import capture_cuda_graph
from longserve.platform import cuda_time_ms as timed

T, HQ, HKV, D, PAGE, KEYS = 64, 32, 8, 128, 16, 2048
GROUP = HQ // HKV
ROWS = T * GROUP  # packed rows a kv head
SLOTS = 48 * 1024  # the cache of one layer: [SLOTS // PAGE, PAGE, HKV, D]


def rand(*shape: int, device: str = "cuda") -> torch.Tensor:
    """bf16 normal values drawn on the CPU's generator: a failed capture leaves the CUDA one in capture state
    (its first run, 2026-12-04, stopped at its next torch.randn: "Offset increment outside graph capture")."""
    return torch.randn(*shape, dtype=torch.bfloat16).to(device)


def pack(q: torch.Tensor) -> torch.Tensor:
    """[T, HQ, D] -> [ROWS, HKV, D]: row t * GROUP + g of kv head h is q head h * GROUP + g of token t."""
    return q.view(T, HKV, GROUP, D).permute(0, 2, 1, 3).reshape(ROWS, HKV, D)


def unpack(rows: torch.Tensor) -> torch.Tensor:
    return rows.view(T, GROUP, HKV, D).permute(0, 2, 1, 3).reshape(T, HQ, D)


def cum_keys(first: int, prefix: int, batch: int, device) -> torch.Tensor:
    """Run b reads keys [first + b * KEYS, min(first + (b + 1) * KEYS, first + prefix)): empty past the prefix."""
    ends = torch.arange(batch + 1, device=device, dtype=torch.int64) * KEYS
    return (first + ends.clamp(max=prefix)).to(torch.int32)


def ragged(q_all, k_flat, v_flat, cum_q, cum_k, scale):
    """(o [B * ROWS, HKV, D], lse natural log, as the op returns it) of the ragged call."""
    out = torch.ops.aten._cudnn_attention_forward(
        q_all, k_flat, v_flat, None, cum_q, cum_k, ROWS, KEYS, True, 0.0, False, False, scale=scale
    )
    return out[0], out[1]


def keep_result(outs: list, fn) -> None:
    outs.append(fn())


def merge(o, lse, cum_k, batch):
    """Softmax-weighted sum of the runs that hold keys -> [T, HQ, D] fp32 (empty runs weigh 0 whatever they hold)."""
    lengths = (cum_k[1:] - cum_k[:-1]).view(batch, 1, 1)
    lse = lse.reshape(HKV, -1).T if lse.shape[0] == HKV else lse  # [H, T] or [T, H(, 1)]: printed above
    lse = lse.reshape(batch, ROWS, HKV).float()
    lse = torch.where(lengths > 0, lse, torch.full_like(lse, float("-inf")))
    w = torch.softmax(lse, dim=0).nan_to_num(0.0)
    merged = (o.view(batch, ROWS, HKV, D).float() * w.unsqueeze(-1)).sum(0)
    return unpack(merged)


def reference(q, k_flat, v_flat, first, prefix, scale):
    k = k_flat[first : first + prefix].float().repeat_interleave(GROUP, 1).permute(1, 0, 2)  # [HQ, P, D]
    v = v_flat[first : first + prefix].float().repeat_interleave(GROUP, 1).permute(1, 0, 2)
    return (torch.softmax(q.float().permute(1, 0, 2) @ k.transpose(1, 2) * scale, -1) @ v).permute(1, 0, 2)


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    scale = D**-0.5
    k_cache = rand(SLOTS // PAGE, PAGE, HKV, D)
    v_cache = rand(SLOTS // PAGE, PAGE, HKV, D)
    k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [SLOTS, HKV, D] views
    cases = [(0, 32768), (16 * 257, 32768 + 100), (16 * 1000, 20000)]  # (first slot, prefix length)
    # a 32K prefix's own run count (no empty run: in case the op refuses empty ones), a 48K context's, a 128K one's
    capturable = True  # until a capture fails: the process's CUDA state is not to be trusted with another
    for batch in (32768 // KEYS, SLOTS // KEYS, 64):
        cum_q = (torch.arange(batch + 1, device=dev, dtype=torch.int32) * ROWS).contiguous()
        print(f"== {batch} runs of up to {KEYS} keys (max_q {ROWS}, max_k {KEYS})", flush=True)
        fitting = [(first, prefix) for first, prefix in cases if prefix <= batch * KEYS]
        for first, prefix in fitting:
            q = rand(T, HQ, D)
            q_all = pack(q).repeat(batch, 1, 1).contiguous()
            cum_k = cum_keys(first, prefix, batch, dev)
            try:
                o, lse = ragged(q_all, k_flat, v_flat, cum_q, cum_k, scale)
            except RuntimeError as e:
                print(f"first slot {first}, prefix {prefix}: the op failed: {str(e)[:300]}", flush=True)
                continue
            used = -(-prefix // KEYS)
            empty = lse.reshape(batch, ROWS, HKV)[used:]
            err = (
                (merge(o, lse, cum_k, batch) - reference(q, k_flat, v_flat, first, prefix, scale)).abs().max()
            )
            print(
                f"first slot {first}, prefix {prefix}: o {tuple(o.shape)}, lse {tuple(lse.shape)} "
                f"{lse.dtype}; max err {err.item():.2e}; empty runs' lse: "
                f"{'none' if empty.numel() == 0 else f'{empty.min().item()}..{empty.max().item()}'}",
                flush=True,
            )
        # a graph captured once, replayed with new rows and key runs copied into its static inputs
        first, prefix = cases[0]
        q_static = pack(rand(T, HQ, D)).repeat(batch, 1, 1).contiguous()
        cum_k_static = cum_keys(first, prefix, batch, dev)
        fresh = [rand(T, HQ, D) for _ in fitting]  # drawn before the capture
        try:
            if not capturable:
                raise RuntimeError("not tried: an earlier capture failed")
            outs = []  # the last entry: the captured call's outputs, which each replay rewrites
            call = partial(ragged, q_static, k_flat, v_flat, cum_q, cum_k_static, scale)
            graph = capture_cuda_graph(partial(keep_result, outs, call), warmup=2)
            o_g, lse_g = outs[-1]
            for (first, prefix), q in zip(fitting[1:] or fitting, fresh):
                q_static.copy_(pack(q).repeat(batch, 1, 1))
                cum_k_static.copy_(cum_keys(first, prefix, batch, dev))
                graph.replay()
                ref = reference(q, k_flat, v_flat, first, prefix, scale)
                err = (merge(o_g, lse_g, cum_k_static, batch) - ref).abs().max()
                print(
                    f"graph replay, first slot {first}, prefix {prefix}: max err {err.item():.2e}", flush=True
                )
            ms = timed(graph.replay)
            print(f"graph replay alone ({batch} runs, prefix {prefix}): {ms * 1e3:.1f} us", flush=True)
        except RuntimeError as e:
            if capturable:  # the whole first error: the first run cut it at 300 characters
                print(f"capture failed ({batch} runs):\n{traceback.format_exc()}", flush=True)
            else:
                print(f"capture ({batch} runs): {e}", flush=True)
            capturable = False
        q_all = pack(rand(T, HQ, D)).repeat(batch, 1, 1).contiguous()
        cum_k = cum_keys(0, 32768, batch, dev)
        try:
            ms = timed(partial(ragged, q_all, k_flat, v_flat, cum_q, cum_k, scale))
            print(f"eager ragged call, 32K prefix, {batch} runs: {ms * 1e3:.1f} us", flush=True)
        except RuntimeError as e:
            print(f"eager ragged call, {batch} runs: failed: {str(e)[:300]}", flush=True)

    # the packed call as the engine runs it now (a plan per split count), and the Triton kernel over the whole hit
    q = rand(T, HQ, D)
    rows = q.new_zeros(HKV, 256, D)
    ms = timed(lambda: packed_prefix_sdpa(q, k_flat[:32768], v_flat[:32768], 16, scale, rows))
    print(f"packed_prefix_sdpa, 16 splits of 2048: {ms * 1e3:.1f} us", flush=True)
    i32 = dict(dtype=torch.int32, device=dev)
    qsl, pre, seq = (torch.tensor(x, **i32) for x in ([0, T], [32768], [32768 + T]))
    table = torch.arange(SLOTS // PAGE, **i32).view(1, -1)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    splits = choose_extend_splits([T], [32768 + T], HQ, HKV, cfg["BLOCK_M"])
    ms = timed(
        lambda: extend_attention(
            q, k_cache, v_cache, qsl, pre, seq, table, PAGE, T, scale, config=cfg, num_splits=splits
        )
    )
    print(f"Triton extend over the whole hit ({splits} splits): {ms * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    main()
