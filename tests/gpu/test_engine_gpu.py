"""The engine on a GPU: the triton backend, CUDA graphs and the torch reference give the same greedy tokens
as transformers (fp32), and bf16 logits stay within tolerance of the fp32 reference."""

from __future__ import annotations

import pytest
import torch

from longserve import LLM, SamplingParams
from longserve.testing.checkpoints import make_tiny_checkpoint
from tests.fixtures.spies import record_in_place_padding

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)


def prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(10, 500, (40,), generator=g).tolist()
    return [head + torch.randint(10, 500, (3 + 17 * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gpu"), "qwen3", num_layers=3)


def run(path, ps, sequential=False, **kw):
    """Greedy tokens of each prompt (one generate call, or one per prompt when sequential) and the LLM."""
    llm = LLM(path, dtype=kw.pop("dtype", "float32"), device="cuda", max_total_tokens=8192, **kw)
    outs = [llm.generate(p, GREEDY)[0] for p in ps] if sequential else llm.generate(ps, GREEDY)
    llm.engine.check_integrity()
    return [o.token_ids for o in outs], llm


def test_triton_backend_and_cuda_graphs_equal_reference(ckpt):
    ps = prompts()
    ref, _ = run(ckpt, ps, attention_backend="torch", enforce_eager=True)
    eager, _ = run(ckpt, ps, attention_backend="triton", enforce_eager=True, chunked_prefill_size=32)
    graphs, llm = run(ckpt, ps, attention_backend="triton", chunked_prefill_size=32, page_size=16)
    assert llm.engine.runner.graph_runner is not None
    assert eager == ref
    assert graphs == ref
    cached, _ = run(ckpt, ps + ps, attention_backend="triton")  # second half hits the prefix cache
    assert cached == ref + ref


def test_bf16_first_token_logits_close_to_fp32(ckpt):
    from transformers import AutoModelForCausalLM

    ids = prompts(1)[0]
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).cuda()
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device="cuda")).logits[0, -1].float()
    llm = LLM(ckpt, dtype="bfloat16", device="cuda", attention_backend="triton", max_total_tokens=4096)
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, logprobs=5)
    out = llm.generate(ids, sp)[0]
    top_ref = torch.log_softmax(ref, -1).topk(5)
    assert out.token_ids[0] in top_ref.indices.tolist()[:2]
    ours = dict(out.outputs[0].top_logprobs[0])
    for tok, lp in zip(top_ref.indices.tolist(), top_ref.values.tolist()):
        if tok in ours:
            assert abs(ours[tok] - lp) < 0.1


@pytest.mark.parametrize("prefix_lens,query_lens", [([3000], [2048]), ([0, 1500, 4100], [1024, 1100, 2000])])
def test_prefix_split_sdpa_matches_reference_bf16(prefix_lens, query_lens):
    from longserve.attention import KVCache, TorchAttentionBackend, build_metadata
    from longserve.attention.triton_backend import TritonAttentionBackend

    torch.manual_seed(0)
    ps, hq, hkv, d = 16, 32, 8, 128
    needs = [-(-(p + q) // ps) for p, q in zip(prefix_lens, query_lens)]
    perm = (torch.randperm(sum(needs) + 4) + 1).tolist()
    tables, i = [], 0
    for n in needs:
        tables.append(perm[i : i + n])
        i += n
    meta = build_metadata(prefix_lens, query_lens, tables, ps, "cuda")
    num_pages = sum(needs) + 6
    t = sum(query_lens)
    q, k, v = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    cache = KVCache(1, num_pages, ps, hkv, d, torch.bfloat16, "cuda")
    cache.k[0].normal_()
    cache.v[0].normal_()
    ref_cache = KVCache(1, num_pages, ps, hkv, d, torch.float32, "cuda")
    ref_cache.k[0].copy_(cache.k[0])
    ref_cache.v[0].copy_(cache.v[0])
    out = TritonAttentionBackend(cold_path="sdpa").forward(q, k, v, 0, meta, cache, d**-0.5)
    ref = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), 0, meta, ref_cache, d**-0.5)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err


def test_prefill_graphs_equal_eager(ckpt):
    """Short chunks replayed from prefill CUDA graphs (a prefix-cache hit's suffix, chunks of a prompt
    chunked at 48 tokens, the last chunk padded to its bucket) give the tokens of an eager engine."""
    ps = prompts()
    # one request at a time: only a lone request's chunk replays a prefill graph
    kw = dict(attention_backend="triton", chunked_prefill_size=48, sequential=True)
    eager, _ = run(ckpt, ps + ps, enforce_eager=True, **kw)
    graphs, llm = run(ckpt, ps + ps, **kw)
    runner = llm.engine.runner.extend_graphs
    assert runner is not None and runner.num_runs >= len(ps)
    assert graphs == eager
    off, llm_off = run(ckpt, ps, cuda_graph_max_prefill_tokens=0, **kw)
    assert llm_off.engine.runner.extend_graphs is None and off == eager[: len(ps)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_piecewise_graphs_equal_eager(ckpt, dtype):
    """Mixed steps (chunks beside decodes, prefix hits) replayed as piecewise graphs, the attention eager
    between the pieces (runner/piecewise_graph.py), give the tokens of an eager engine; the pieces ran."""
    ps = prompts(8, seed=3)
    kw = dict(attention_backend="triton", chunked_prefill_size=256, dtype=dtype)
    eager, _ = run(ckpt, ps + ps, enforce_eager=True, **kw)
    pieces, llm = run(ckpt, ps + ps, piecewise_cuda_graph_max_tokens=256, **kw)
    runner = llm.engine.runner.piecewise_graphs
    assert runner is not None and runner.graphs and runner.num_runs >= 2
    if dtype == "float32":
        assert pieces == eager
    else:  # bf16: GEMMs at a padded M may round differently; the first tokens agree
        assert [p[:4] for p in pieces] == [e[:4] for e in eager]


def test_cold_cudnn_prompts_beside_decodes_in_pieces_equal_eager(ckpt, monkeypatch):
    """Cold prompts long enough for the cuDNN call (sdpa_shapes.MIN_COLD_QUERY), padded to their plans' rows,
    arriving one by one while the earlier ones decode: in the piecewise graphs their calls read the static qkv
    buffer's next rows (the decodes', stale ones) as the padding, in place (sdpa.allow_padding_rows); the tokens
    agree with an eager engine's, whose calls copy q/k/v into zeroed rows (bf16: the first 4, as above)."""
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (700, 1100, 1300, 900, 1500)]

    def staggered(**kw) -> tuple[list[list[int]], LLM]:  # each prompt two steps after the one before
        llm = LLM(ckpt, dtype="bfloat16", device="cuda", max_total_tokens=8192, attention_backend="triton",
                  hf_overrides={"max_position_embeddings": 4096}, **kw)  # fmt: skip
        eng, ids, tokens = llm.engine, [], {}
        for p in ps:
            ids.append(eng.add_request(p, GREEDY))
            for _ in range(2):
                eng.step()
        while eng.has_unfinished():
            for out in eng.step():
                tokens[out.request_id] = out.token_ids
        eng.check_integrity()
        return [tokens[i] for i in ids], llm

    eager, _ = staggered(enforce_eager=True)
    in_place = record_in_place_padding(monkeypatch)
    pieces, llm = staggered(piecewise_cuda_graph_max_tokens=4096)
    assert llm.engine.runner.piecewise_graphs.num_runs >= len(ps) - 1
    assert in_place.count(True) >= 3  # padded calls read the static buffer in place
    assert [p[:4] for p in pieces] == [e[:4] for e in eager]


def test_prefix_hits_through_the_packed_cudnn_call(ckpt, monkeypatch):
    """Short questions over a cached 9,000-token head (over the packed path's 8,192-token minimum, its pages
    consecutive in a fresh pool) run the packed cuDNN call in the piecewise graphs (the lone chunk's graph steps
    aside), and their first tokens' logprobs match those of the same engine with the packed calls off (the Triton
    kernel in the lone chunk's graph) within bf16's rounding; every page back."""
    from longserve.attention import sdpa_shapes
    from longserve.attention.triton_backend import TritonAttentionBackend

    g = torch.Generator().manual_seed(7)
    head = torch.randint(10, 500, (9000,), generator=g).tolist()
    ps = [head + torch.randint(10, 500, (n,), generator=g).tolist() for n in (4, 9, 16)]
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True)
    packed: list[int] = []
    real = TritonAttentionBackend._packed
    monkeypatch.setattr(
        TritonAttentionBackend, "_packed", lambda self, *a: packed.append(a[4]) or real(self, *a)
    )
    firsts = []
    for on in (False, True):
        monkeypatch.setattr(sdpa_shapes, "PACKED_PREFIX_CALLS", on)
        long_context = {"max_position_embeddings": 16384}  # the tiny checkpoint's 512 would refuse the head
        llm = LLM(
            ckpt, dtype="bfloat16", device="cuda", attention_backend="triton", max_total_tokens=16384,
            hf_overrides=long_context,
        )  # fmt: skip
        llm.generate(head, SamplingParams(max_new_tokens=1))  # the head into the prefix cache
        runs = llm.engine.runner.piecewise_graphs.num_runs
        firsts.append([dict(o.outputs[0].top_logprobs[0]) for o in (llm.generate(p, sp)[0] for p in ps)])
        llm.engine.check_integrity()
        assert (llm.engine.runner.piecewise_graphs.num_runs > runs) == on
    assert packed and set(packed) == {0}  # each hit's one request, every layer
    for off, on in zip(*firsts):
        shared = set(off) & set(on)
        assert len(shared) >= 3
        assert all(abs(off[t] - on[t]) < 0.05 for t in shared)
