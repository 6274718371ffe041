"""The lone chunk's packed graph on the GPU (attention/packed_graph.py): the prefix in one cudnn-frontend call
through page tables, the tail and new tokens in the extend kernel's partials, merged; against the Triton kernel's
whole-hit attention over the same scattered pages, eagerly and as one CUDA graph replayed with other prefixes and
pages. Needs the `nvidia-cudnn-frontend` wheel (scripts/gpu/fetch_test_wheels.sh)."""

from __future__ import annotations

import pytest
import torch

from longserve.attention import GraphShape, KVCache, build_metadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HQ, HKV, D, PAGE, BUCKET = 32, 8, 128, 16, 64
TOL = 2e-2


@pytest.mark.parametrize("fused", [False, True])  # PACKED_TAIL_FUSED: the causal part and merge in one kernel
def test_packed_graph_equals_the_triton_kernel(monkeypatch: pytest.MonkeyPatch, fused: bool) -> None:
    pytest.importorskip("cudnn")
    from longserve.attention import packed_graph
    from longserve.attention.triton_backend import TritonAttentionBackend
    from longserve.platform import capture_cuda_graph

    monkeypatch.setattr(packed_graph, "PACKED_GRAPHS", True)
    monkeypatch.setattr(packed_graph, "PACKED_TAIL_FUSED", fused)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    num_pages = 49152 // PAGE + 64
    cache = KVCache(1, num_pages, PAGE, HKV, D, torch.bfloat16, dev)
    cache.k[0].normal_()
    cache.v[0].normal_()
    shape = GraphShape(49152, HQ, HKV, D, torch.bfloat16, dev)
    packed = TritonAttentionBackend().prepare_for_packed_capture(BUCKET, shape, cache)
    assert isinstance(packed, packed_graph.PackedPrefixBackend)
    plain = TritonAttentionBackend(cold_path="triton")
    scale = D**-0.5
    q = torch.empty(BUCKET, HQ, D, dtype=torch.bfloat16, device=dev)  # the graph's static rows
    kv = torch.zeros(BUCKET, HKV, D, dtype=torch.bfloat16, device=dev)  # (stored already: kv_stored)
    out: list[torch.Tensor] = []

    def step(prefix: int, new: int, seed: int):
        """A step's metadata over scattered pages (K/V already in them), its rows in q; the Triton kernel's
        output over them."""
        g = torch.Generator().manual_seed(seed)
        pages = (torch.randperm(num_pages - 1, generator=g)[: -(-(prefix + new) // PAGE)] + 1).tolist()
        meta = build_metadata([prefix], [new], [pages], PAGE, dev)
        q.normal_()
        want = plain.forward(q[:new], kv[:new], kv[:new], 0, meta, cache, scale, kv_stored=True)
        return meta, want

    def run(meta) -> None:
        out[:] = [packed.forward(q, kv, kv, 0, meta, cache, scale, kv_stored=True)]

    for prefix, new in ((32768, 64), (20000, 50), (8200, 64), (45000, 7)):
        meta, want = step(prefix, new, prefix)
        assert packed.takes(meta)
        packed.prepare_for_replay(meta)
        run(meta)
        torch.testing.assert_close(out[0][:new].float(), want.float(), atol=TOL, rtol=TOL)
    # one capture, replayed with other prefixes and pages (the graph's metadata is the capture's; what differs
    # reaches the device through prepare_for_replay alone)
    meta, _ = step(32768, 64, 1)
    packed.prepare_for_replay(meta)
    graph = capture_cuda_graph(lambda: run(meta), warmup=2)
    for prefix, new in ((40000, 64), (12000, 33), (32768, 64)):
        meta2, want = step(prefix, new, prefix + 7)
        packed.prepare_for_replay(meta2)
        graph.replay()
        torch.testing.assert_close(out[0][:new].float(), want.float(), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("q_by_rope", [False, True])
def test_prefix_hits_through_the_packed_graph(tmp_path, monkeypatch: pytest.MonkeyPatch, q_by_rope) -> None:
    """Short questions over a cached 9,000-token head replay the lone chunk's packed graph (PACKED_GRAPHS on), and
    their first tokens' logprobs match those of the same engine with it off (the plain graph, the Triton kernel)
    within bf16's rounding; every page back. q_by_rope: the rotary kernel fills the packed rows
    (PACKED_Q_BY_ROPE)."""
    pytest.importorskip("cudnn")
    from longserve import LLM, SamplingParams
    from longserve.attention import packed_graph
    from longserve.testing.checkpoints import make_tiny_checkpoint

    monkeypatch.setattr(packed_graph, "PACKED_Q_BY_ROPE", q_by_rope)

    ckpt = make_tiny_checkpoint(tmp_path, "qwen3", num_layers=3)
    g = torch.Generator().manual_seed(7)
    head = torch.randint(10, 500, (9000,), generator=g).tolist()
    ps = [head + torch.randint(10, 500, (n,), generator=g).tolist() for n in (4, 9, 16, 40)]
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True)
    firsts = []
    for on in (False, True):
        monkeypatch.setattr(packed_graph, "PACKED_GRAPHS", on)
        llm = LLM(
            ckpt, dtype="bfloat16", device="cuda", attention_backend="triton", max_total_tokens=16384,
            hf_overrides={"max_position_embeddings": 16384},
        )  # fmt: skip
        runner = llm.engine.runner.extend_graphs
        assert runner is not None and bool(runner.packed) == on
        llm.generate(head, SamplingParams(max_new_tokens=1))  # the head into the prefix cache
        firsts.append([dict(o.outputs[0].top_logprobs[0]) for o in (llm.generate(p, sp)[0] for p in ps)])
        llm.engine.check_integrity()
        assert runner.num_packed_runs == (len(ps) if on else 0)
    for off, on in zip(*firsts):
        shared = set(off) & set(on)
        assert len(shared) >= 3
        assert all(abs(off[t] - on[t]) < 0.05 for t in shared)


def test_packed_tail_kernel_at_the_8b_shape() -> None:
    """kernels/packed_tail.py in bf16 at the 8B hit's shape (64 new tokens, a tail of 9 keys, 8 splits of 512 rows)
    against its fp32 reference and the extend kernel's partials merged by merge_packed (what it replaces)."""
    from longserve.kernels.attention_reference import packed_tail_ref
    from longserve.kernels.extend_attention import extend_attention
    from longserve.kernels.merge_attention import merge_packed
    from longserve.kernels.packed_tail import packed_tail

    dev = torch.device("cuda")
    torch.manual_seed(1)
    splits, rows, tail, new = 8, 256, 9, 61
    cache_k = torch.randn(200, PAGE, HKV, D, device=dev).bfloat16()
    cache_v = torch.randn(200, PAGE, HKV, D, device=dev).bfloat16()
    pages = (torch.randperm(190, device=dev)[:6] + 2).to(torch.int32)
    q = torch.randn(BUCKET, HQ, D, device=dev).bfloat16()
    part = torch.randn(splits, HKV, rows, D, device=dev).bfloat16()
    part_lse = torch.randn(splits, HKV, rows, device=dev) * 3 + 8
    tail_t = torch.tensor([tail], dtype=torch.int32, device=dev)
    seq_t = torch.tensor([tail + new], dtype=torch.int32, device=dev)
    scale = D**-0.5
    got = packed_tail(q, cache_k, cache_v, pages, tail_t, seq_t, part, part_lse, scale)
    want = packed_tail_ref(q, cache_k, cache_v, pages, tail_t, seq_t, part, part_lse, scale)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL, rtol=TOL)
    qsl = torch.tensor([0, BUCKET], dtype=torch.int32, device=dev)
    o_c, lse_c = extend_attention(
        q,
        cache_k,
        cache_v,
        qsl,
        tail_t,
        seq_t,
        pages.view(1, -1),
        PAGE,
        BUCKET,
        scale,
        num_splits=1,
        partials=True,
    )
    before = merge_packed(
        part, part_lse, o_c[:, :, 0].transpose(0, 1), lse_c[:, :, 0].transpose(0, 1), torch.empty_like(q), 0,
        causal_log2=True,
    )  # fmt: skip
    torch.testing.assert_close(got[:new].float(), before[:new].float(), atol=TOL, rtol=TOL)
