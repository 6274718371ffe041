"""GPU probe: one cuDNN call per prefill chunk (the causal mask aligned bottom-right over [cached prefix, new
tokens]) instead of the engine's split (a call over the prefix, a causal call over the new tokens, a merge).
`cudnn_sdpa_plans.py` timed 8K new over 24K + 8K keys at 5.88 ms a layer in one call against 6.56 for the split:
this asks whether one plan built for the longest shape (a chunk's rows, the longest context's keys; the actual
lengths as device tensors under a padding mask) keeps that rate at every prefix length, which would let a few
plans built at start-up serve every chunk, and what a plan costs to build.

The engine's layouts: q a view of the fused qkv output (row stride (32 + 2 * 8) * 128), K/V a contiguous view of
consecutive cache pages [keys, 8, 128], the output a [rows, 32, 128] buffer. Needs `nvidia-cudnn-frontend` (.whl):
    PYTHONPATH=$PWD:/tmp/site python3 scripts/probes/cudnn_one_call.py
"""

from __future__ import annotations

import json
import os
import time

import torch

from longserve.attention import sdpa
from longserve.kernels.merge_attention import merge_two
from longserve.platform import cuda_time_ms

HQ, HKV, D = 32, 8, 128
SCALE = D**-0.5
WIDTH = (HQ + 2 * HKV) * D


def heads(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [T, H, D] -> [1, H, T, D]


class OneCall:
    """A bottom-right causal cuDNN graph for up to `max_q` new rows over up to `max_kv` keys; the lengths of a
    call are device tensors (padding mask)."""

    def __init__(self, cudnn, handle, max_q: int, max_kv: int, padded: bool) -> None:
        dev = "cuda"
        self.cudnn, self.handle, self.padded = cudnn, handle, padded
        q4 = heads(
            torch.empty(max_q, WIDTH, device=dev, dtype=torch.bfloat16)[:, : HQ * D].view(max_q, HQ, D)
        )
        k4 = heads(torch.empty(max_kv, HKV, D, device=dev, dtype=torch.bfloat16))
        o4 = heads(torch.empty(max_q, HQ, D, device=dev, dtype=torch.bfloat16))
        g = cudnn.pygraph(
            io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT, handle=handle,
        )  # fmt: skip
        self.tq, self.tk, self.tv = g.tensor_like(q4), g.tensor_like(k4), g.tensor_like(k4)
        kw = dict(
            name="one", q=self.tq, k=self.tk, v=self.tv, attn_scale=SCALE, use_causal_mask_bottom_right=True
        )
        if padded:
            self.len_q = torch.zeros(1, 1, 1, 1, dtype=torch.int32, device=dev)
            self.len_kv = torch.zeros_like(self.len_q)
            self.tlq, self.tlkv = g.tensor_like(self.len_q), g.tensor_like(self.len_kv)
            kw.update(use_padding_mask=True, seq_len_q=self.tlq, seq_len_kv=self.tlkv)
        try:
            to, _ = g.sdpa(is_inference=True, **kw)
        except TypeError:
            to, _ = g.sdpa(generate_stats=False, **kw)
        to.set_output(True).set_dim(list(o4.shape)).set_stride(list(o4.stride()))
        self.to = to
        start = time.perf_counter()
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.build_s = time.perf_counter() - start
        self.g = g
        self.workspace = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=dev)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        """q [L, HQ, D] (fused view), k/v [S, HKV, D], out [>= max_q rows when padded, HQ, D]."""
        pack = {self.tq: heads(q), self.tk: heads(k), self.tv: heads(v), self.to: heads(out)}
        if self.padded:
            self.len_q.fill_(q.shape[0])
            self.len_kv.fill_(k.shape[0])
            pack.update({self.tlq: self.len_q, self.tlkv: self.len_kv})
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        self.g.execute(pack, self.workspace, handle=self.handle)


def main() -> None:
    import cudnn

    dev = "cuda"
    torch.manual_seed(0)
    handle = cudnn.create_handle()
    max_q, max_kv = 8192, 131072
    t0 = time.perf_counter()
    big = OneCall(cudnn, handle, max_q, max_kv, padded=True)
    print(json.dumps({"plan": f"padded {max_q} x {max_kv}", "build_s": round(time.perf_counter() - t0, 2)}))
    qkv = torch.randn(max_q, WIDTH, device=dev, dtype=torch.bfloat16)
    cache = torch.randn(2, max_kv, HKV, D, device=dev, dtype=torch.bfloat16)
    out = torch.empty(max_q, HQ, D, device=dev, dtype=torch.bfloat16)
    rows = []
    for new, prefix in (
        (8192, 8192),
        (8192, 24576),
        (8192, 57344),
        (8192, 122880),
        (2048, 30000),
        (1000, 9000),
    ):
        keys = prefix + new
        q = qkv[:new, : HQ * D].view(new, HQ, D)
        k, v = cache[0, :keys], cache[1, :keys]
        flop = 4 * new * (prefix + (new + 1) / 2) * D * HQ
        split_out = torch.empty(new, HQ, D, device=dev, dtype=torch.bfloat16)

        def split(q=q, k=k, v=v, prefix=prefix, split_out=split_out):
            o_a, l_a = sdpa.attention_with_lse(heads(q), heads(k[:prefix]), heads(v[:prefix]), False, SCALE)
            o_b, l_b = sdpa.attention_with_lse(heads(q), heads(k[prefix:]), heads(v[prefix:]), True, SCALE)
            return merge_two(o_a[0], l_a[0], o_b[0], l_b[0], split_out)

        ref = split().float()
        t_split = cuda_time_ms(split, 2, 3, 3)
        t0 = time.perf_counter()
        exact = OneCall(cudnn, handle, new, keys, padded=False)
        exact_build = time.perf_counter() - t0
        exact_out = torch.empty(new, HQ, D, device=dev, dtype=torch.bfloat16)
        t_exact = cuda_time_ms(lambda: exact(q, k, v, exact_out), 2, 3, 3)  # noqa: B023
        t_big = cuda_time_ms(lambda: big(q, k, v, out), 2, 3, 3)  # noqa: B023
        err = lambda o, new=new, ref=ref: ((o[:new].float() - ref).norm() / ref.norm()).item()  # noqa: E731
        row = {
            "new": new, "prefix": prefix, "split_ms": round(t_split, 3), "exact_ms": round(t_exact, 3),
            "padded_plan_ms": round(t_big, 3), "split_tflops": round(flop / t_split / 1e9, 1),
            "exact_tflops": round(flop / t_exact / 1e9, 1), "padded_tflops": round(flop / t_big / 1e9, 1),
            "exact_build_s": round(exact_build, 2), "exact_err": round(err(exact_out), 5),
            "padded_err": round(err(out), 5),
        }  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "cudnn_one_call.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
