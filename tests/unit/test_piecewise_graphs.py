"""Piecewise CUDA graphs (runner/piecewise_graph.py), their static-buffer pieces run eagerly on the CPU with
the Triton kernels interpreted: `CausalLM.pieces` driven with the attention in between equals `forward`; a
mixed step (a cold chunk, a chunk over a cached prefix, decodes) padded to its bucket gives the plain step's
hidden states and K/V, its padding writes only into page 0 whatever an earlier step left in the buffers; an
engine serving through the pieces gives the plain engine's tokens and gets every page back."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from longserve import LLM, SamplingParams  # noqa: E402
from longserve.attention import ForwardContext, KVCache, build_metadata  # noqa: E402
from longserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from longserve.models import load_hf_config, load_model  # noqa: E402
from longserve.runner.piecewise_graph import PiecewiseGraphRunner, piecewise_buckets  # noqa: E402
from longserve.testing.checkpoints import make_tiny_checkpoint  # noqa: E402
from tests.fixtures.spies import record_in_place_padding  # noqa: E402
from tests.unit.test_graph_runners import graph_shape  # noqa: E402

PAGE = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pw"), "qwen3", num_layers=2)


@pytest.fixture(scope="module")
def model_and_hf(ckpt):
    hf = load_hf_config(ckpt)
    return load_model(ckpt, hf, torch.float32, torch.device("cpu")), hf


def test_buckets():
    assert piecewise_buckets(512) == [64, 128, 192, 256, 320, 384, 448, 512]
    assert piecewise_buckets(100) == [64, 100]
    assert piecewise_buckets(1300)[-6:] == [896, 960, 1024, 1152, 1280, 1300]
    assert piecewise_buckets(8192)[-3:] == [7168, 7680, 8192]
    assert piecewise_buckets(1) == []
    # padding of at most an eighth past 512 tokens
    buckets = piecewise_buckets(8192)
    for n in range(513, 8193, 7):
        assert next(b for b in buckets if b >= n) <= n * 1.125
    # --piecewise-cuda-graph-tokens: those sizes, up to the limit (a chunk, --piecewise-cuda-graph-max-tokens)
    assert piecewise_buckets(4096, (100, 300, 4096, 5000)) == [100, 300, 4096]
    assert piecewise_buckets(64, (100, 300)) == []


def step_inputs(hf, prefix_lens, query_lens, seed):
    """Page tables on scattered pages (never 0 or 1), the ids of every position, and the step's metadata."""
    g = torch.Generator().manual_seed(seed)
    free = (torch.randperm(60, generator=g) + 2).tolist()
    tables = []
    for p, q in zip(prefix_lens, query_lens):
        n = -(-(p + q) // PAGE)
        tables.append(free[:n])
        free = free[n:]
    ids = [torch.randint(5, hf.vocab_size, (p + q,), generator=g) for p, q in zip(prefix_lens, query_lens)]
    return tables, ids, free


def test_pieces_equal_forward(model_and_hf):
    model, hf = model_and_hf
    tables, ids, _ = step_inputs(hf, [0, 0], [9, 30], seed=1)
    meta = build_metadata([0, 0], [9, 30], tables, PAGE, "cpu")
    positions = torch.cat([torch.arange(9), torch.arange(30)])
    flat = torch.cat(ids)
    outs = []
    for use_pieces in (False, True):
        cache = KVCache(model.num_layers, 64, PAGE, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
        ctx = ForwardContext(meta, cache, TritonAttentionBackend(cold_path="triton"))
        with torch.inference_mode():
            if not use_pieces:
                outs.append(model(flat, positions, ctx))
                continue
            pieces, calls = model.pieces(flat, positions, ctx), 0
            call = next(pieces)
            while True:
                calls += 1
                try:
                    call = pieces.send(call.run(ctx))
                except StopIteration as stop:
                    outs.append(stop.value)
                    break
    assert calls == model.num_layers
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)


@pytest.mark.parametrize("sizes", [None, (24, 50, 66, 100)])
@pytest.mark.parametrize("fused_store", [True, False])
@pytest.mark.parametrize("query_lens", [[40, 23, 1, 1], [64, 1], [7, 1, 1]])
def test_padded_pieces_equal_a_plain_step(model_and_hf, query_lens, fused_store, sizes, monkeypatch):
    """A mixed step through its bucket's static pieces (eager) equals the plain step: hidden states, the K/V
    of its real tokens; padding rows write only into page 0, though the buffers hold an earlier step's
    slots (pages of another request) past this step's rows. fused_store: the rotary kernel (as on a GPU,
    interpreted here) stores the new K/V inside the pieces, padding rows included. sizes: buckets given
    (--piecewise-cuda-graph-tokens), none of them a multiple of the default's 64."""
    import longserve.models.rope as rope

    monkeypatch.setattr(rope, "use_triton", lambda x: fused_store)
    model, hf = model_and_hf
    prefix_lens = [0, 37, 70, 5][: len(query_lens)]
    tables, ids, free = step_inputs(hf, prefix_lens, query_lens, seed=sum(query_lens))
    backend = TritonAttentionBackend(cold_path="triton")
    cache = KVCache(model.num_layers, 64, PAGE, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    with torch.inference_mode():
        cached = [(p, t, x) for p, t, x in zip(prefix_lens, tables, ids) if p]
        if cached:  # the prefixes' K/V into their pages
            meta = build_metadata([0] * len(cached), [p for p, _, _ in cached], [t for _, t, _ in cached],
                                  PAGE, "cpu")  # fmt: skip
            positions = torch.cat([torch.arange(p) for p, _, _ in cached])
            model(torch.cat([x[:p] for p, _, x in cached]), positions, ForwardContext(meta, cache, backend))
        meta = build_metadata(prefix_lens, query_lens, tables, PAGE, "cpu")
        new_ids = torch.cat([x[p:] for p, x in zip(prefix_lens, ids)])
        positions = torch.cat([torch.arange(p, p + q) for p, q in zip(prefix_lens, query_lens)])
        before = cache.k[0].clone()
        plain = model(new_ids, positions, ForwardContext(meta, cache, backend))  # [n, H]
        k_plain, v_plain = cache.k[0].clone(), cache.v[0].clone()
        cache.k[0].copy_(before)  # as before the plain step
        runner = PiecewiseGraphRunner(
            model, cache, graph_shape(model, 12 * PAGE), max_tokens=128, sizes=sizes
        )
        assert runner.buckets == (list(sizes) if sizes else [64, 128])
        runner.eager = True
        other = free[0]  # a page nobody in this step owns: an earlier, longer step's slots pointed there
        runner.tokens.slot_mapping.fill_(other * PAGE + 3)
        cache.k[0][0].zero_()
        assert runner.can_run(meta)
        got = runner.run(new_ids, positions, ForwardContext(meta, cache, backend))
    torch.testing.assert_close(got, plain, atol=1e-4, rtol=1e-4)
    real = sorted({p for t in tables for p in t})
    torch.testing.assert_close(cache.k[0][real], k_plain[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.v[0][real], v_plain[real], atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.k[0][other], before[other])  # the stale slots were not written
    if fused_store and next(b for b in runner.buckets if b >= sum(query_lens)) > sum(query_lens):
        assert cache.k[0][0].abs().sum() > 0  # the padding rows' K/V went to page 0


def test_library_calls_pad_over_the_static_buffer(model_and_hf, monkeypatch):
    """With the library (cuDNN; torch's SDPA on the CPU) paths, a cold prompt's padded call reads the static qkv
    buffer's next rows in place (sdpa.allow_padding_rows: the decodes' rows and stale ones after it) and the step
    equals the plain one, whose call pads with zeros."""
    import longserve.attention.sdpa_shapes as shapes

    monkeypatch.setattr(shapes, "Q_GRANULE", 64)  # a 40-token prompt pads to 48 rows (quarter granules)
    model, hf = model_and_hf
    prefix_lens, query_lens = [0, 70, 5], [40, 1, 1]
    tables, ids, _ = step_inputs(hf, prefix_lens, query_lens, seed=7)
    backend = TritonAttentionBackend(cold_path="sdpa")
    cache = KVCache(model.num_layers, 64, PAGE, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    in_place = record_in_place_padding(monkeypatch)
    with torch.inference_mode():
        # the decodes' prefixes into their pages
        meta = build_metadata([0, 0], [70, 5], tables[1:], PAGE, "cpu")
        model(torch.cat([ids[1][:70], ids[2][:5]]), torch.cat([torch.arange(70), torch.arange(5)]),
              ForwardContext(meta, cache, backend))  # fmt: skip
        meta = build_metadata(prefix_lens, query_lens, tables, PAGE, "cpu")
        new_ids = torch.cat([x[p:] for p, x in zip(prefix_lens, ids)])
        positions = torch.cat([torch.arange(p, p + q) for p, q in zip(prefix_lens, query_lens)])
        plain = model(new_ids, positions, ForwardContext(meta, cache, backend))  # [n, H]
        assert True not in in_place  # the projection's own output: copied, zero-padded
        in_place.clear()
        runner = PiecewiseGraphRunner(model, cache, graph_shape(model, 12 * PAGE), max_tokens=128)
        runner.eager = True
        runner.qkv.normal_()  # stale rows of earlier steps: any finite values
        got = runner.run(new_ids, positions, ForwardContext(meta, cache, backend))
    assert in_place == [True] * model.num_layers  # every layer's call over the static buffer, in place
    torch.testing.assert_close(got, plain, atol=1e-4, rtol=1e-4)


def test_can_run(model_and_hf):
    model, _ = model_and_hf
    cache = KVCache(model.num_layers, 8, PAGE, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    runner = PiecewiseGraphRunner(model, cache, graph_shape(model, 4 * PAGE), max_tokens=100)
    assert not runner.can_run(build_metadata([0], [20], [[1, 2]], PAGE, "cpu"))  # nothing captured
    runner.eager = True
    assert runner.can_run(build_metadata([0, 16], [20, 1], [[1, 2], [3, 4]], PAGE, "cpu"))
    assert not runner.can_run(build_metadata([0], [101], [[1] * 7], PAGE, "cpu"))  # over the largest bucket
    assert not runner.can_run(build_metadata([16], [1], [[1, 2]], PAGE, "cpu"))  # one token


def test_engine_through_pieces_equals_plain(ckpt):
    """Mixed traffic (prompts chunked beside decodes, a shared prefix cached) through an engine whose
    non-decode steps run the static pieces: the plain engine's tokens, every page back."""
    g = torch.Generator().manual_seed(4)
    head = torch.randint(10, 500, (40,), generator=g).tolist()
    prompts = [head + torch.randint(10, 500, (5 + 23 * i,), generator=g).tolist() for i in range(5)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_total_tokens=2048, chunked_prefill_size=64)
    plain = [o.token_ids for o in LLM(ckpt, **kw).generate(prompts, params)]
    llm = LLM(ckpt, **kw)
    runner = llm.engine.runner
    pieces = PiecewiseGraphRunner(
        runner.model, runner.kv_cache, runner._graph_shape(), max_tokens=kw["chunked_prefill_size"]
    )
    pieces.eager = True
    runner.piecewise_graphs = pieces
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == plain and pieces.num_runs > 3
    llm.engine.check_integrity()


def test_the_step_in_flight_is_read_once_the_first_layers_are_queued(ckpt, monkeypatch):
    """With on_outputs (the server's), a step with prompt tokens that runs in the pieces reads and hands out the
    step in flight after its first EARLY_AFTER_LAYERS layers (the device runs them meanwhile), not before its
    launch; the tokens equal the plain schedule's, every page back."""
    from longserve.runner import piecewise_graph

    monkeypatch.setattr(piecewise_graph, "EARLY_AFTER_LAYERS", 1)
    g = torch.Generator().manual_seed(6)
    first, second = (torch.randint(10, 500, (n,), generator=g).tolist() for n in (30, 45))
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_total_tokens=2048, overlap_schedule=True)
    plain = [
        o.token_ids for o in LLM(ckpt, **{**kw, "overlap_schedule": False}).generate([first, second], params)
    ]
    llm = LLM(ckpt, **kw)
    engine, runner, events = llm.engine, llm.engine.runner, []
    pieces = PiecewiseGraphRunner(runner.model, runner.kv_cache, runner._graph_shape(), max_tokens=64)
    pieces.eager = True
    runner.piecewise_graphs = pieces
    forward = runner.backend.forward
    runner.backend.forward = lambda q, *a, **k: events.append(("layer", q.shape[0])) or forward(q, *a, **k)

    def on_outputs(outs):
        events.append(("out", [(o.request_id, len(o.outputs[0].token_ids)) for o in outs]))

    engine.add_request(first, params, request_id="a")
    engine.step(on_outputs=on_outputs)  # a's prompt (in the pieces: nothing in flight)
    engine.step(on_outputs=on_outputs)  # a's first decode, in flight; a's first token read
    engine.add_request(second, params, request_id="b")
    events.clear()
    assert engine.step(on_outputs=on_outputs) == []  # b's prompt beside a's decode, in the pieces
    assert events[:2] == [("layer", 1 + len(second)), ("out", [("a", 2)])]  # one layer queued, then the read
    assert [e for e in events[2:] if e[0] == "out"] == []
    assert len(events) == 1 + runner.model.num_layers and pieces.num_runs == 2
    final = {}
    while engine.has_unfinished():
        for out in engine.step(on_outputs=on_outputs):
            final[out.request_id] = out
    assert [final[r].outputs[0].token_ids for r in ("a", "b")] == plain
    engine.check_integrity()


def test_a_failed_capture_leaves_the_steps_eager(model_and_hf, monkeypatch, caplog):
    """On by default, the pieces must never keep a server from starting: a capture that raises (a model whose
    dense parts hold a host sync, say) gives no runner and a warning naming the error; one that works gives the
    runner."""
    from longserve.runner import cuda_graph

    model, _ = model_and_hf
    cache = KVCache(model.num_layers, 8, PAGE, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    shape = graph_shape(model, 4 * PAGE)

    def fail(self, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(PiecewiseGraphRunner, "capture", fail)
    with caplog.at_level("WARNING", logger="longserve.runner.cuda_graph"):
        assert cuda_graph.capture_pieces(model, cache, shape, 64, pool=None) is None
    assert "operation not permitted when stream is capturing" in caplog.text
    assert "--piecewise-cuda-graph-max-tokens 0" in caplog.text
    monkeypatch.setattr(PiecewiseGraphRunner, "capture", lambda self, pool=None: None)
    runner = cuda_graph.capture_pieces(model, cache, shape, 64, pool=None)
    assert isinstance(runner, PiecewiseGraphRunner) and runner.max_tokens == 64
    runner = cuda_graph.capture_pieces(model, cache, shape, 64, pool=None, sizes=(16, 40, 100))
    assert runner.buckets == [16, 40] and runner.max_tokens == 40
    caplog.clear()
    with caplog.at_level("INFO", logger="longserve.runner.cuda_graph"):
        assert cuda_graph.capture_pieces(model, cache, shape, 64, pool=None, sizes=(100, 200)) is None
    assert (
        "sizes above 64 tokens (the chunk, --piecewise-cuda-graph-max-tokens) are not captured: 100,200"
        in (caplog.text)
    )
    assert "no --piecewise-cuda-graph-tokens size within 64 tokens: mixed steps run eagerly" in caplog.text
