"""GPU probe: cuDNN's paged attention (cudnn-frontend's graph API: page tables and each request's query and key
lengths as device tensors; the plan fixed only by the batch, the longest query, the page-table width and the
longest key run) straight over longserve's KV cache, for the two cases issue 19 misses:

- the prefix hit, 64 new tokens over a 32K cached prefix: the Triton extend kernel in the lone chunk's graph takes
  ~148 us a layer, the packed cuDNN call ~70 us but only eagerly (its plan has the key count; RESULTS.md
  seventeenth session: torch's ragged form, which would not, rebuilds its cuDNN graph every call, 47 ms);
- a 128K prompt's last chunk, 8K new over 120K cached: today two library calls (the prefix, the new tokens
  causal) and a merge (`sdpa.prefix_split_sdpa`).

Here each is one call, the causal part aligned bottom-right (query i of L sees keys up to prefix + i), no merge.
The cache [pages, page_size, kv heads, D] is the container as it lies ([pages, kv heads, page_size, D] by
strides): nothing copied. The probe checks each case against fp32 (scattered and consecutive pages), captures
the hit in a CUDA graph and replays it with another page table and prefix length, and times everything against
the paths the engine runs now. Needs the `nvidia-cudnn-frontend` wheel (scripts/gpu/fetch_test_wheels.sh; 1.14.1
loads the cuDNN that torch loaded):

    PYTHONPATH=$PWD:/tmp/site python3 scripts/probes/probe_paged_cudnn.py   (PROBE_PAGE=64: pages of 64 tokens)
"""

from __future__ import annotations

import math
import os
import traceback
from functools import partial

import torch

from longserve.attention.metadata import build_metadata
from longserve.attention.sdpa import cold_sdpa, prefix_split_sdpa
from longserve.kernels.extend_attention import choose_extend_splits, extend_attention
from longserve.platform import capture_cuda_graph
from longserve.platform import cuda_time_ms as timed

HQ, HKV, D = 32, 8, 128
PAGE = int(
    os.environ.get("PROBE_PAGE", "16")
)  # the engine's default page size; 64 if cuDNN wants larger blocks
SCALE = D**-0.5
DEV = "cuda"


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.bfloat16).to(DEV)


class PagedCall:
    """One cuDNN graph: B requests of up to max_q new tokens over up to max_kv keys of the pool's pages; every
    input a static device tensor (so a CUDA graph of `run` replays with whatever is copied into them)."""

    def __init__(self, cudnn, handle, k_cache, v_cache, batch: int, max_q: int, max_kv: int) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
        self.q = torch.zeros(batch * max_q, HQ, D, dtype=torch.bfloat16, device=DEV)  # [B * max_q, HQ, D]
        self.o = torch.zeros_like(self.q)
        width = math.ceil(max_kv / PAGE)
        self.table = torch.zeros(batch, 1, width, 1, dtype=torch.int32, device=DEV)
        self.len_q = torch.zeros(batch, 1, 1, 1, dtype=torch.int32, device=DEV)
        self.len_kv = torch.zeros_like(self.len_q)
        self.batch, self.max_q = batch, max_q
        q4, o4 = (t.view(batch, max_q, HQ, D).permute(0, 2, 1, 3) for t in (self.q, self.o))  # [B, HQ, L, D]
        kc, vc = (c.permute(0, 2, 1, 3) for c in (k_cache, v_cache))  # [pages, HKV, PAGE, D], strided
        g = cudnn.pygraph(
            io_data_type=cudnn.data_type.BFLOAT16,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
            handle=handle,
        )
        self.tq, self.tk, self.tv = g.tensor_like(q4), g.tensor_like(kc), g.tensor_like(vc)
        self.tt_k, self.tt_v = g.tensor_like(self.table), g.tensor_like(self.table)
        self.tlq, self.tlkv = g.tensor_like(self.len_q), g.tensor_like(self.len_kv)
        kw = dict(
            name="paged", q=self.tq, k=self.tk, v=self.tv, attn_scale=SCALE, use_padding_mask=True,
            seq_len_q=self.tlq, seq_len_kv=self.tlkv, use_causal_mask_bottom_right=True,
            paged_attention_k_table=self.tt_k, paged_attention_v_table=self.tt_v,
            paged_attention_max_seq_len_kv=max_kv,
        )  # fmt: skip
        try:
            to, _ = g.sdpa(is_inference=True, **kw)
        except TypeError:  # frontends that name it generate_stats
            to, _ = g.sdpa(generate_stats=False, **kw)
        to.set_output(True).set_dim(list(o4.shape)).set_stride(list(o4.stride()))
        self.to = to
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph, self.handle, self.cudnn = g, handle, cudnn
        self.workspace = torch.empty(g.get_workspace_size(), dtype=torch.uint8, device=DEV)
        self.pack = {
            self.tq: self.q, self.tk: kc, self.tv: vc, self.tt_k: self.table, self.tt_v: self.table,
            self.tlq: self.len_q, self.tlkv: self.len_kv, self.to: self.o,
        }  # fmt: skip

    def load(self, requests: list[tuple[torch.Tensor, list[int], int]]) -> None:
        """requests: (q [L, HQ, D], page ids of its whole sequence, its key count) each, into the inputs."""
        self.table.zero_()
        for b, (q, pages, kv) in enumerate(requests):
            self.q[b * self.max_q : b * self.max_q + q.shape[0]] = q
            self.table[b, 0, : len(pages), 0] = torch.tensor(pages, dtype=torch.int32, device=DEV)
            self.len_q[b] = q.shape[0]
            self.len_kv[b] = kv

    def run(self) -> None:
        # on the current stream: a capture's side stream too (the handle would otherwise launch on its own)
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        self.graph.execute(self.pack, self.workspace, handle=self.handle)


def reference(q: torch.Tensor, k_cache, v_cache, pages: list[int], kv: int, rows=None) -> torch.Tensor:
    """fp32 attention of q [L, HQ, D] (the last L of kv positions) over the sequence's keys, causal."""
    idx = torch.tensor(pages, device=DEV)
    k = k_cache[idx].flatten(0, 1)[:kv].float()  # [kv, HKV, D]
    v = v_cache[idx].flatten(0, 1)[:kv].float()
    L = q.shape[0]
    rows = range(L) if rows is None else rows
    out = []
    for i in rows:
        end = kv - L + i + 1
        kk = k[:end].repeat_interleave(HQ // HKV, 1)  # [end, HQ, D]
        vv = v[:end].repeat_interleave(HQ // HKV, 1)
        s = torch.einsum("hd,khd->hk", q[i].float(), kk) * SCALE
        out.append(torch.einsum("hk,khd->hd", torch.softmax(s, -1), vv))
    return torch.stack(out)


def err(call: PagedCall, b: int, q: torch.Tensor, pages, kv, rows=None) -> float:
    got = call.o[b * call.max_q : b * call.max_q + q.shape[0]].float()
    rows = list(range(q.shape[0])) if rows is None else rows
    return (got[rows] - reference(q, call.k_cache, call.v_cache, pages, kv, rows)).abs().max().item()


def case_hit(cudnn, handle, k_cache, v_cache, num_pages: int) -> None:
    new, prefix = 64, 32768
    kv = prefix + new
    need = math.ceil(kv / PAGE)
    scattered = torch.randperm(num_pages - 1)[:need].add(1).tolist()  # page 0 reserved, as in the engine
    consecutive = list(range(1, need + 1))
    for width in (49152, 131072):  # the plan's longest context: 48K, 128K (the page table's width)
        call = PagedCall(cudnn, handle, k_cache, v_cache, batch=1, max_q=new, max_kv=width)
        for name, pages in (("scattered", scattered), ("consecutive", consecutive)):
            q = rand(new, HQ, D)
            call.load([(q, pages, kv)])
            call.run()
            e = err(call, 0, q, pages, kv)
            ms = timed(call.run)
            print(
                f"hit 64 over 32K, {name} pages, plan for {width} keys: max err {e:.2e}, {ms * 1e3:.1f} us",
                flush=True,
            )
        # a CUDA graph captured once, replayed with another table and another prefix length
        try:
            graph = capture_cuda_graph(call.run, warmup=2)
            for prefix2, pages in ((20000, scattered), (prefix, consecutive)):
                kv2 = prefix2 + new
                pages2 = pages[: math.ceil(kv2 / PAGE)]
                q = rand(new, HQ, D)
                call.load([(q, pages2, kv2)])
                graph.replay()
                print(
                    f"  graph replay, prefix {prefix2}: max err {err(call, 0, q, pages2, kv2):.2e}",
                    flush=True,
                )
            print(f"  graph replay alone: {timed(graph.replay) * 1e3:.1f} us", flush=True)
        except Exception:
            print(f"  capture failed:\n{traceback.format_exc()}", flush=True)
            return
    # what the engine runs now: the Triton extend kernel over the whole hit (the lone chunk's graph)
    q = rand(new, HQ, D)
    i32 = dict(dtype=torch.int32, device=DEV)
    qsl, pre, seq = (torch.tensor(x, **i32) for x in ([0, new], [prefix], [kv]))
    table = torch.tensor([scattered], **i32)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    splits = choose_extend_splits([new], [kv], HQ, HKV, cfg["BLOCK_M"])
    ms = timed(
        lambda: extend_attention(
            q, k_cache, v_cache, qsl, pre, seq, table, PAGE, new, SCALE, config=cfg, num_splits=splits
        )
    )
    print(f"hit: Triton extend kernel ({splits} splits), scattered pages: {ms * 1e3:.1f} us", flush=True)


def case_chunk(cudnn, handle, k_cache, v_cache, new: int, prefix: int) -> None:
    kv = prefix + new
    pages = list(range(1, math.ceil(kv / PAGE) + 1))  # a lone prompt's pages: consecutive
    call = PagedCall(cudnn, handle, k_cache, v_cache, batch=1, max_q=new, max_kv=kv)
    q = rand(new, HQ, D)
    call.load([(q, pages, kv)])
    call.run()
    rows = [0, 1, new // 2, new - 2, new - 1]
    e = err(call, 0, q, pages, kv, rows)
    ms = timed(call.run, warmup=2, iters=5, repeats=3)
    flops = 4 * new * HQ * D * (prefix + new / 2)
    print(
        f"chunk {new} over {prefix}: paged one call, max err {e:.2e} (rows {rows}), {ms:.3f} ms, "
        f"{flops / ms / 1e9:.0f} TFLOP/s",
        flush=True,
    )
    # what the engine runs now over the same pages (torch's cuDNN plans built in the warm-up calls): a cold prompt
    # in one causal call, a chunk over a prefix as the split path
    k_new, v_new = rand(new, HKV, D), rand(new, HKV, D)
    if prefix:
        meta = build_metadata([prefix], [new], [pages], PAGE, DEV)
        now = partial(prefix_split_sdpa, q, k_new, v_new, k_cache, v_cache, meta, SCALE)
        name = "the split path (prefix, causal, merge)"
    else:
        now, name = partial(cold_sdpa, q, k_new, v_new, [new], SCALE), "the cold path (one causal call)"
    try:
        print(f"  the engine's {name}: {timed(now, warmup=2, iters=5, repeats=3):.3f} ms", flush=True)
    except Exception as e:
        print(f"  the engine's {name} failed: {str(e)[:300]}", flush=True)


def main() -> None:
    try:
        import cudnn
    except Exception:
        print(f"no cudnn frontend (carry nvidia-cudnn-frontend in .whl/):\n{traceback.format_exc()}")
        return
    print(
        f"cudnn frontend {getattr(cudnn, '__version__', '?')}, backend {cudnn.backend_version()}, "
        f"torch {torch.__version__}, pages of {PAGE} tokens"
    )
    torch.manual_seed(0)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    num_pages = 132 * 1024 // PAGE + 8
    k_cache, v_cache = rand(num_pages, PAGE, HKV, D), rand(num_pages, PAGE, HKV, D)
    for fn in (
        partial(case_hit, cudnn, handle, k_cache, v_cache, num_pages),
        partial(case_chunk, cudnn, handle, k_cache, v_cache, 8192, 0),
        partial(case_chunk, cudnn, handle, k_cache, v_cache, 8192, 24576),
        partial(case_chunk, cudnn, handle, k_cache, v_cache, 8192, 122880),
    ):
        try:
            fn()
        except Exception:
            print(f"{fn.func.__name__}{fn.args[4:]} failed:\n{traceback.format_exc()}", flush=True)


if __name__ == "__main__":
    main()
