"""GPU probe: the prefix hit's packed cuDNN call as one cudnn-frontend graph that a CUDA graph can hold.

The packed call (sdpa.packed_prefix_sdpa: each kv head's q heads as 256 rows, the prefix's keys split S ways as
the batch) took the hit's prefix part in ~70 us a layer where the Triton kernel takes ~122-148 (RESULTS.md,
seventeenth and thirty-third sessions), but torch's cuDNN plans fix the key count, so it ran eagerly between the
piecewise graphs and its host launches scattered the hit's TTFT (off since the sixteenth session). Here the same
call is built with cudnn-frontend, every per-request input a device tensor, in two forms:

- paged: split s reads its keys through a page table [S, 1, W, 1] (the request's pages cut S ways: any pages),
  its key count in seq_len_kv (padding mask), the plan sized for the longest context;
- ragged: split s reads a run of consecutive cache slots at a device offset (set_ragged_offset on K and V;
  consecutive pages only).

Each is checked against fp32 (the S outputs merged by their stats, and the merged log-sum-exp), captured in a CUDA
graph and replayed with another prefix and other pages, and timed eagerly and as graph replays; beside them, in
the same process: the eager packed call (torch, 2048-key splits), the Triton extend kernel over the whole hit as
the engine launches it, and what the packed path adds to the cuDNN part (the new tokens' causal partials and the
merge). Needs the `nvidia-cudnn-frontend` wheel in .whl/ (scripts/gpu/fetch_test_wheels.sh):

    PYTHONPATH=$PWD:/tmp/site python3 scripts/probes/probe_packed_cudnn_graph.py
"""

from __future__ import annotations

import math
import traceback
from functools import partial

import torch

from longserve.attention.sdpa import packed_prefix_sdpa
from longserve.attention.triton_backend import TritonAttentionBackend
from longserve.kernels.extend_attention import extend_attention
from longserve.kernels.merge_attention import merge_packed
from longserve.platform import capture_cuda_graph, cuda_graph_time_ms, cuda_time_ms

HQ, HKV, D, PAGE = 32, 8, 128, 16
G, R = HQ // HKV, 256  # q heads a kv head; packed rows (64 tokens x 4)
NEW, PREFIX, MAX_CONTEXT = 64, 32768, 131072
SCALE = D**-0.5
DEV = "cuda"


class PackedPrefixGraph:
    """One cudnn-frontend SDPA over the packed rows [HKV, R, D] (q_rows) against the prefix's keys split S ways,
    outputs o [S, HKV, R, D] and lse [S, HKV, R] (natural log); `load` fills its device inputs for one prefix."""

    def __init__(self, cudnn, handle, k_cache, v_cache, splits: int, form: str, q_stride0: bool) -> None:
        self.cudnn, self.handle, self.form, self.splits = cudnn, handle, form, splits
        self.k_cache, self.v_cache = k_cache, v_cache
        S = splits
        self.max_keys = math.ceil(MAX_CONTEXT / S / PAGE) * PAGE  # one split's keys at the longest context
        self.q_rows = torch.zeros(HKV, R, D, dtype=torch.bfloat16, device=DEV)
        self.q_all = None if q_stride0 else torch.zeros(S, HKV, R, D, dtype=torch.bfloat16, device=DEV)
        self.o = torch.zeros(S, HKV, R, D, dtype=torch.bfloat16, device=DEV)
        self.stats = torch.zeros(S, HKV, R, 1, dtype=torch.float32, device=DEV)
        i32 = dict(dtype=torch.int32, device=DEV)
        self.len_q = torch.full((S, 1, 1, 1), R, **i32)
        self.len_kv = torch.zeros(S, 1, 1, 1, **i32)
        dt = cudnn.data_type
        g = cudnn.pygraph(
            io_data_type=dt.BFLOAT16,
            intermediate_data_type=dt.FLOAT,
            compute_data_type=dt.FLOAT,
            handle=handle,
        )
        q_stride = [0, R * D, D, 1] if q_stride0 else [HKV * R * D, R * D, D, 1]
        tq = g.tensor(name="q", dim=[S, HKV, R, D], stride=q_stride, data_type=dt.BFLOAT16)
        tlq, tlkv = g.tensor_like(self.len_q), g.tensor_like(self.len_kv)
        kw = dict(
            name="packed", attn_scale=SCALE, use_padding_mask=True, seq_len_q=tlq, seq_len_kv=tlkv,
            generate_stats=True,
        )  # fmt: skip
        if form == "paged":
            pages_w = self.max_keys // PAGE
            self.table = torch.zeros(S, 1, pages_w, 1, **i32)
            kc, vc = (c.permute(0, 2, 1, 3) for c in (k_cache, v_cache))  # [pages, HKV, PAGE, D], strided
            tk, tv = g.tensor_like(kc), g.tensor_like(vc)
            tt = g.tensor_like(self.table)
            kw.update(paged_attention_k_table=tt, paged_attention_v_table=tt,
                      paged_attention_max_seq_len_kv=self.max_keys)  # fmt: skip
            pack_kv = {tk: kc, tv: vc, tt: self.table}
        else:  # ragged: the cache's slots as [S, HKV, max_keys, D]; split s starts at offsets[s] elements
            dims, strides = [S, HKV, self.max_keys, D], [self.max_keys * HKV * D, D, HKV * D, 1]
            tk = g.tensor(name="k", dim=dims, stride=strides, data_type=dt.BFLOAT16)
            tv = g.tensor(name="v", dim=dims, stride=strides, data_type=dt.BFLOAT16)
            self.offsets = torch.zeros(S + 1, 1, 1, 1, **i32)
            to_k, to_v = g.tensor_like(self.offsets), g.tensor_like(self.offsets)
            tk.set_ragged_offset(to_k)
            tv.set_ragged_offset(to_v)
            pack_kv = {tk: k_cache, tv: v_cache, to_k: self.offsets, to_v: self.offsets}
        to, tstats = g.sdpa(q=tq, k=tk, v=tv, **kw)
        to.set_output(True).set_dim(list(self.o.shape)).set_stride(list(self.o.stride()))
        tstats.set_output(True).set_data_type(dt.FLOAT).set_dim(list(self.stats.shape))
        tstats.set_stride(list(self.stats.stride()))
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph = g
        self.workspace = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=DEV)
        q_in = self.q_rows.unsqueeze(0).expand(S, -1, -1, -1) if q_stride0 else self.q_all
        self.pack = {tq: q_in, tlq: self.len_q, tlkv: self.len_kv, to: self.o, tstats: self.stats, **pack_kv}

    def load(self, q: torch.Tensor, pages: list[int], prefix: int) -> int:
        """q [NEW, HQ, D] into the packed rows; the prefix's keys (on `pages`) cut into S page-aligned runs.
        Returns how many splits hold keys."""
        self.q_rows.view(HKV, R // G, G * D)[:, :NEW] = q.reshape(NEW, HKV, G * D).transpose(0, 1)
        if self.q_all is not None:
            self.q_all.copy_(self.q_rows.unsqueeze(0).expand_as(self.q_all))
        run = math.ceil(prefix / self.splits / PAGE) * PAGE
        assert run <= self.max_keys
        lens = [max(0, min(run, prefix - s * run)) for s in range(self.splits)]
        self.len_kv.copy_(torch.tensor(lens, dtype=torch.int32).view(-1, 1, 1, 1))
        if self.form == "paged":
            table = torch.zeros(self.table.shape[0], self.table.shape[2], dtype=torch.int32)
            for s, n in enumerate(lens):
                first = s * run // PAGE
                chunk = pages[first : first + math.ceil(n / PAGE)]
                table[s, : len(chunk)] = torch.tensor(chunk, dtype=torch.int32)
            self.table.copy_(table.view(self.table.shape))
        else:
            assert pages == list(range(pages[0], pages[0] + len(pages))), "ragged runs need consecutive pages"
            offs = [(pages[0] * PAGE + s * run) * HKV * D for s in range(self.splits + 1)]
            self.offsets.copy_(torch.tensor(offs, dtype=torch.int32).view(-1, 1, 1, 1))
        return sum(1 for n in lens if n)

    def run(self) -> None:
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        self.graph.execute(self.pack, self.workspace, handle=self.handle)

    def merged(self, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The used splits merged by their stats: (o [HKV, R, D] fp32, lse [HKV, R])."""
        lse = self.stats[:used, ..., 0]  # [S, HKV, R]
        top = lse.max(0).values
        w = torch.exp(lse - top)
        o = (w.unsqueeze(-1) * self.o[:used].float()).sum(0) / w.sum(0).unsqueeze(-1)
        return o, top + torch.log(w.sum(0))


def reference(q_rows: torch.Tensor, k_cache, v_cache, pages: list[int], prefix: int):
    """fp32 attention of the packed rows over the prefix's keys (no mask): (o [HKV, R, D], lse [HKV, R])."""
    idx = torch.tensor(pages, device=DEV)
    k = k_cache[idx].flatten(0, 1)[:prefix].float().transpose(0, 1)  # [HKV, P, D]
    v = v_cache[idx].flatten(0, 1)[:prefix].float().transpose(0, 1)
    s = torch.einsum("hrd,hkd->hrk", q_rows.float(), k) * SCALE
    return torch.einsum("hrk,hkd->hrd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


def check(call: PackedPrefixGraph, replay, q, pages, prefix: int, what: str) -> None:
    used = call.load(q, pages, prefix)
    replay()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    o, lse = call.merged(used)
    ro, rlse = reference(call.q_rows, call.k_cache, call.v_cache, pages, prefix)
    rows = NEW * G  # the real rows (the rest are zero padding)
    e_o = (o[:, :rows] - ro[:, :rows]).abs().max().item()
    e_l = (lse[:, :rows] - rlse[:, :rows]).abs().max().item()
    print(f"    {what}: prefix {prefix}, {used} splits used: max err o {e_o:.2e}, lse {e_l:.2e}", flush=True)


def one_form(cudnn, handle, k_cache, v_cache, form: str, splits: int, scattered, consecutive) -> None:
    call = None
    for q_stride0 in (True, False):
        try:
            call = PackedPrefixGraph(cudnn, handle, k_cache, v_cache, splits, form, q_stride0)
            break
        except Exception as e:
            print(f"  {form}, {splits} splits, q batch stride {'0' if q_stride0 else 'full'}: build failed: "
                  f"{str(e)[:400]}", flush=True)  # fmt: skip
    if call is None:
        return
    q = torch.randn(NEW, HQ, D, dtype=torch.bfloat16, device=DEV)
    page_sets = [("consecutive", consecutive)] + ([("scattered", scattered)] if form == "paged" else [])
    print(f"  {form}, {splits} splits (q batch stride {'0' if call.q_all is None else 'full'}), plan for "
          f"{call.max_keys} keys a split:", flush=True)  # fmt: skip
    for name, pages in page_sets:
        check(call, call.run, q, pages, PREFIX, f"eager, {name}")
        call.load(q, pages, PREFIX)
        eager = cuda_time_ms(call.run) * 1e3
        replay = cuda_graph_time_ms(call.run, warmup=2, iters=20, repeats=5) * 1e3
        print(f"    {name}: eager {eager:.1f} us, graph replay {replay:.1f} us", flush=True)
    try:  # one capture, replayed with other prefixes and pages
        call.load(q, consecutive, PREFIX)
        graph = capture_cuda_graph(call.run, warmup=2)
        for prefix2, (name, pages) in ((20000, page_sets[-1]), (8192, page_sets[0]), (PREFIX, page_sets[0])):
            q2 = torch.randn(NEW, HQ, D, dtype=torch.bfloat16, device=DEV)
            pages2 = pages[: math.ceil(prefix2 / PAGE)]
            check(call, graph.replay, q2, pages2, prefix2, f"captured once, replayed ({name})")
    except Exception:
        print(f"    capture failed:\n{traceback.format_exc()[-1500:]}", flush=True)


def baselines(k_cache, v_cache, scattered, consecutive) -> None:
    """What runs today over the same hit, graph replays: the Triton kernel as the engine launches it; and the
    eager packed call (torch's cuDNN, 16 splits of 2048 keys) with the causal partials and merge it needs."""
    q = torch.randn(NEW, HQ, D, dtype=torch.bfloat16, device=DEV)
    i32 = dict(dtype=torch.int32, device=DEV)
    kv = PREFIX + NEW
    backend = TritonAttentionBackend()
    cfg, splits = backend.extend_launch([NEW], [kv], HQ, HKV, D, torch.bfloat16, torch.device(DEV))
    qsl, pre, seq = (torch.tensor(x, **i32) for x in ([0, NEW], [PREFIX], [kv]))
    for name, pages in (("scattered", scattered), ("consecutive", consecutive)):
        table = torch.tensor([pages[: math.ceil(kv / PAGE)]], **i32)
        fn = partial(
            extend_attention, q, k_cache, v_cache, qsl, pre, seq, table, PAGE, NEW, SCALE, config=cfg,
            num_splits=splits,
        )  # fmt: skip
        us = cuda_graph_time_ms(fn, warmup=2, iters=20, repeats=5) * 1e3
        print(
            f"  Triton extend kernel, whole hit ({cfg['BLOCK_M']} rows, {splits} splits), {name}: {us:.1f} us"
        )
    first = consecutive[0]
    k_pre = k_cache[first : first + PREFIX // PAGE].flatten(0, 1)
    v_pre = v_cache[first : first + PREFIX // PAGE].flatten(0, 1)
    rows = torch.zeros(HKV, R, D, dtype=torch.bfloat16, device=DEV)
    us = cuda_time_ms(lambda: packed_prefix_sdpa(q, k_pre, v_pre, PREFIX // 2048, SCALE, rows)) * 1e3
    print(f"  eager packed call (torch cuDNN, {PREFIX // 2048} splits of 2048), prefix part: {us:.1f} us")
    # the rest of the packed path: the new tokens' causal partials (one request over NEW keys) and the merge
    table = torch.tensor([consecutive[PREFIX // PAGE : math.ceil(kv / PAGE)]], **i32)
    qsl, pre, seq = (torch.tensor(x, **i32) for x in ([0, NEW], [0], [NEW]))
    ccfg, _ = backend.extend_launch([NEW], [NEW], HQ, HKV, D, torch.bfloat16, torch.device(DEV))
    o_pre, lse_pre = packed_prefix_sdpa(q, k_pre, v_pre, PREFIX // 2048, SCALE, rows)
    out = torch.empty(NEW, HQ, D, dtype=torch.bfloat16, device=DEV)

    def rest() -> None:
        part, lse = extend_attention(
            q, k_cache, v_cache, qsl, pre, seq, table, PAGE, NEW, SCALE, config=ccfg, num_splits=1,
            partials=True,
        )  # fmt: skip
        o_c, lse_c = part[:, :, 0].transpose(0, 1), lse[:, :, 0].transpose(0, 1)
        merge_packed(o_pre, lse_pre, o_c, lse_c, out, 0, causal_log2=True)

    us = cuda_graph_time_ms(rest, warmup=2, iters=20, repeats=5) * 1e3
    print(f"  the packed path's causal partials + merge (graph replays): {us:.1f} us", flush=True)


def main() -> None:
    try:
        import cudnn
    except Exception:
        print(f"no cudnn frontend (carry nvidia-cudnn-frontend in .whl/):\n{traceback.format_exc()}")
        return
    print(f"cudnn frontend {getattr(cudnn, '__version__', '?')}, backend {cudnn.backend_version()}, "
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)  # fmt: skip
    torch.manual_seed(0)
    handle = cudnn.create_handle()
    num_pages = (MAX_CONTEXT + 4096) // PAGE
    k_cache = torch.randn(num_pages, PAGE, HKV, D, dtype=torch.bfloat16, device=DEV)
    v_cache = torch.randn_like(k_cache)
    need = math.ceil((PREFIX + NEW) / PAGE)
    scattered = (torch.randperm(num_pages - 1)[:need] + 1).tolist()  # page 0 reserved, as in the engine
    consecutive = list(range(1, need + 1))
    for form, splits in (("paged", 16), ("ragged", 16), ("paged", 8), ("paged", 32), ("ragged", 32)):
        try:
            one_form(cudnn, handle, k_cache, v_cache, form, splits, scattered, consecutive)
        except Exception:
            print(f"  {form}, {splits} splits failed:\n{traceback.format_exc()[-1500:]}", flush=True)
    try:
        baselines(k_cache, v_cache, scattered, consecutive)
    except Exception:
        print(f"  baselines failed:\n{traceback.format_exc()[-1500:]}", flush=True)


if __name__ == "__main__":
    main()
