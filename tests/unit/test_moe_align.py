"""The one-launch Triton MoE alignment (kernels/moe_align.py, TRITON_INTERPRET=1 on the CPU) against its torch
reference `moe_align_ref`: the same three tensors element for element for T in 1..64, k in 1..8, E from 4 to
128, BLOCK_M 16 and 64, idle experts, every pair on one expert, expert-parallel maps with other ranks'
experts (-1), int64 ids; the fused MoE's output unchanged with the switch on (also with a map, and through
the MoE layer of tiny Qwen3-MoE / Qwen2-MoE / Mixtral checkpoints against transformers); the one-launch
router top-k (kernels/moe_routing.py) against `route_topk`; both kernels compiled for sm90 by Triton's real
compiler (scripts/dev/compile_moe_align.py)."""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from longserve.kernels import moe_align as align_mod  # noqa: E402
from longserve.kernels.fused_moe import fused_moe  # noqa: E402
from longserve.kernels.moe_align import MAX_PAIRS, align_routed_pairs, moe_align  # noqa: E402
from longserve.kernels.moe_reference import fused_moe_ref, moe_align_ref, route_topk  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def random_ids(num_tokens: int, top_k: int, num_experts: int, seed: int, skew: bool = False) -> torch.Tensor:
    """[T, k] int32: k distinct experts per token, as top-k gives; `skew`: most tokens on a few experts and
    about half the experts idle."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)  # [T, E]
    if skew:
        logits[:, : num_experts // 2] -= 1e4  # the first half never picked (when k <= E / 2)
        logits[:, -1] += 5.0
    return torch.topk(logits, top_k, dim=-1).indices.to(torch.int32)


def assert_same(got, ref) -> None:
    names = ("sorted_token_ids", "expert_ids", "num_tokens_post_padded")
    for name, a, b in zip(names, got, ref, strict=True):
        assert a.dtype == b.dtype == torch.int32 and a.shape == b.shape, (name, a.shape, b.shape)
        assert torch.equal(a, b), f"{name}:\n{a}\n{b}"


def ep_map(num_experts: int, ranks: int, rank: int) -> torch.Tensor:
    per = num_experts // ranks
    emap = torch.full((num_experts,), -1, dtype=torch.int32)
    emap[rank * per : (rank + 1) * per] = torch.arange(per, dtype=torch.int32)
    return emap


# T in 1..64, k in 1..8, E in 4..128, BLOCK_M 16/64 (and 4: many blocks per expert at small T)
SWEEP = [
    (t, k, e, bm)
    for t, k, e, bm in [
        (1, 1, 4, 16), (1, 2, 8, 16), (1, 8, 128, 16), (1, 8, 128, 64), (2, 4, 4, 16), (3, 1, 4, 64),
        (5, 3, 8, 4), (7, 2, 8, 16), (8, 8, 64, 16), (13, 3, 8, 4), (16, 4, 16, 64), (17, 6, 60, 16),
        (24, 2, 4, 16), (31, 8, 128, 16), (32, 5, 32, 64), (40, 2, 8, 16), (47, 7, 100, 64), (63, 1, 4, 16),
        (64, 8, 128, 16), (64, 8, 128, 64), (64, 2, 8, 64), (64, 4, 4, 4),
    ]
]  # fmt: skip


@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "block_m"), SWEEP)
def test_equals_the_reference(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> None:
    for skew in (False, True):
        ids = random_ids(num_tokens, top_k, num_experts, seed=num_tokens * 131 + top_k, skew=skew)
        assert_same(moe_align(ids, num_experts, block_m), moe_align_ref(ids, num_experts, block_m))


@pytest.mark.parametrize(("ranks", "rank"), [(2, 0), (2, 1), (4, 3), (8, 5)])
@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "block_m"), SWEEP[::3])
def test_expert_parallel_maps(num_tokens, top_k, num_experts, block_m, ranks: int, rank: int) -> None:
    """Pairs on other ranks' experts (-1 in the map) laid out as expert E after the local ones, the real
    padded length stopping before them; blocks past the end hold E + 1. (E not divisible by the ranks: the
    experts left over are on no rank, -1 everywhere: the kernel does not mind.)"""
    emap = ep_map(num_experts, ranks, rank)
    local = num_experts // ranks
    ids = random_ids(num_tokens, top_k, num_experts, seed=rank + 7 * num_tokens)
    assert_same(moe_align(ids, local, block_m, emap), moe_align_ref(ids, local, block_m, emap))


def test_edge_layouts() -> None:
    """Every pair on one expert (several full blocks and a partial one), every pair on another rank's
    experts (real length 0), k = E (every expert busy), int64 ids, a non-contiguous ids view, one pair."""
    cases = [
        (torch.full((37, 1), 3, dtype=torch.int32), 4, 16, None),
        (torch.full((64, 1), 0, dtype=torch.int32), 128, 16, None),  # 4 blocks exactly, 127 idle experts
        (torch.full((16, 1), 5, dtype=torch.int32), 8, 16, ep_map(8, 2, 0)),  # all remote
        (torch.arange(8, dtype=torch.int32).repeat(9, 1), 8, 16, None),
        (random_ids(20, 3, 16, seed=3).long(), 16, 16, None),
        (random_ids(20, 6, 16, seed=4)[:, ::2], 16, 4, None),  # strided view
        (torch.tensor([[2]], dtype=torch.int32), 4, 64, None),
        (random_ids(9, 2, 8, seed=5).long(), 4, 16, ep_map(8, 2, 1).long()),  # int64 ids and map
    ]
    for ids, num_experts, block_m, emap in cases:
        got = moe_align(ids, num_experts, block_m, emap)
        assert_same(got, moe_align_ref(ids, num_experts, block_m, emap))
    _, _, num_post = moe_align(*cases[2][:3], cases[2][3])
    assert int(num_post) == 0
    with pytest.raises(ValueError, match="pairs"):
        moe_align(torch.zeros(MAX_PAIRS + 1, 1, dtype=torch.int32), 4, 16)


def test_the_switch_picks_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """MOE_TRITON_ALIGN_MAX_PAIRS (0: off) decides, read at call time; past it (or past MAX_PAIRS) torch."""
    assert align_mod.MOE_TRITON_ALIGN_MAX_PAIRS == MAX_PAIRS  # on up to the kernel's limit (H200-measured)
    calls = []
    real = align_mod.moe_align
    monkeypatch.setattr(align_mod, "moe_align", lambda *a: calls.append(a[0].numel()) or real(*a))
    ids = random_ids(6, 2, 8, seed=9)
    monkeypatch.setattr(align_mod, "MOE_TRITON_ALIGN_MAX_PAIRS", 0)
    assert_same(align_routed_pairs(ids, 8, 16), moe_align_ref(ids, 8, 16))
    assert calls == []
    monkeypatch.setattr(align_mod, "MOE_TRITON_ALIGN_MAX_PAIRS", 12)
    assert_same(align_routed_pairs(ids, 8, 16), moe_align_ref(ids, 8, 16))
    assert calls == [12]
    align_routed_pairs(random_ids(7, 2, 8, seed=9), 8, 16)  # 14 pairs: past the switch
    align_routed_pairs(ids, 8, 16, triton_max_pairs=0)
    assert calls == [12]


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_fused_moe_output_is_unchanged(monkeypatch: pytest.MonkeyPatch, expert_parallel: bool) -> None:
    """The MoE layer's output with the Triton alignment equals the torch alignment's bit for bit, and the
    reference's to rounding; with and without an expert map."""
    g = torch.Generator().manual_seed(11)
    e, h, inter, t, k = 8, 32, 24, 19, 3
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h**0.5  # [E, 2I, H]
    w2 = torch.randn(e, h, inter, generator=g) / inter**0.5  # [E, H, I]
    x = torch.randn(t, h, generator=g)  # [T, H]
    weights, ids = route_topk(torch.randn(t, e, generator=g), k, True)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)
    emap = ep_map(e, 2, 1) if expert_parallel else None
    w13, w2 = (w13[4:].contiguous(), w2[4:].contiguous()) if expert_parallel else (w13, w2)
    off = fused_moe(x, w13, w2, weights, ids, config=cfg, expert_map=emap)
    monkeypatch.setattr(align_mod, "MOE_TRITON_ALIGN_MAX_PAIRS", 4096)
    on = fused_moe(x, w13, w2, weights, ids, config=cfg, expert_map=emap)
    assert torch.equal(on, off)
    ref = fused_moe_ref(x, w13, w2, weights, ids, expert_map=emap)
    torch.testing.assert_close(on, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_models_match_transformers_with_the_triton_alignment(tmp_path, monkeypatch, arch: str) -> None:
    """Tiny MoE checkpoints through the MoE layer's Triton path (fused_moe, as on CUDA) with the Triton
    alignment switched on: a full and a chunked prefill give transformers' logits (Qwen3-MoE's and Mixtral's
    renormalized routing, Qwen2-MoE's unnormalized one and its shared expert)."""
    pytest.importorskip("transformers")
    from longserve.kernels import moe_routing
    from longserve.models import moe as moe_mod
    from longserve.testing.checkpoints import make_tiny_checkpoint
    from tests.model.test_models_vs_hf import (
        PAGE_IDS,
        hf_logits,
        load_both,
        new_cache,
        prompt,
        run_step,
        two_chunks,
    )

    calls, routed = [], []
    real = align_mod.moe_align
    monkeypatch.setattr(align_mod, "moe_align", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(align_mod, "MOE_TRITON_ALIGN_MAX_PAIRS", 4096)
    real_route = moe_routing.route_topk_fused
    monkeypatch.setattr(moe_routing, "route_topk_fused", lambda *a: routed.append(1) or real_route(*a))
    monkeypatch.setattr(moe_mod, "MOE_TRITON_ROUTING_MAX_TOKENS", 64)  # the one-launch router top-k too
    monkeypatch.setattr(moe_mod, "use_triton", lambda t: True)  # as for CUDA tensors with triton
    ours, hf = load_both(make_tiny_checkpoint(tmp_path / arch, arch, seed=7))
    ids = prompt(ours.vocab_size)
    ref = hf_logits(hf, ids)  # [40, V]
    full = run_step(ours, new_cache(ours), [ids], [0], [PAGE_IDS])
    torch.testing.assert_close(full, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(two_chunks(ours, ids), ref, atol=1e-4, rtol=1e-4)
    assert calls and routed, "the Triton alignment or routing did not run"


# (T, E, k, renormalize, scoring, logits dtype): Qwen3-30B-A3B (128, top-8, renormalized), Mixtral (8, top-2),
# Qwen2-MoE's unnormalized top-4 of 60, sigmoid scores, k = E, E not a power of two
ROUTING = [
    (1, 128, 8, True, "softmax", torch.bfloat16), (9, 8, 2, True, "softmax", torch.float32),
    (13, 60, 4, False, "softmax", torch.bfloat16), (5, 6, 3, False, "sigmoid", torch.float32),
    (7, 5, 5, True, "softmax", torch.float32), (64, 16, 1, False, "softmax", torch.float16),
    (3, 100, 6, True, "sigmoid", torch.bfloat16),
]  # fmt: skip


def assert_same_experts(got: torch.Tensor, ref: torch.Tensor, logits: torch.Tensor, top_k: int) -> None:
    """The same ids in the same order, but where scores tie (equal logits: torch.topk leaves their order
    open; the kernel takes the lower index first): then the same set, in the same order of scores."""
    scores = logits.float()
    assert torch.equal(scores.gather(1, got.long()), scores.gather(1, ref.long()))
    top = scores.topk(min(top_k + 1, scores.shape[1])).values  # [T, k (+1)]
    tied_at_k = (top[:, top_k - 1] == top[:, top_k]) if top.shape[1] > top_k else torch.zeros(len(top)).bool()
    for row in range(len(got)):
        if not tied_at_k[row]:
            assert torch.equal(got[row].sort().values, ref[row].sort().values), row


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "renorm", "scoring", "dtype"), ROUTING)
def test_fused_routing_equals_route_topk(num_tokens, num_experts, top_k, renorm, scoring, dtype) -> None:
    """The same experts in the same order (up to ties); weights equal to fp32 rounding, and after rounding to
    the logits' dtype (Qwen-MoE) at most one ulp apart."""
    from longserve.kernels.moe_routing import route_topk_fused

    logits = (torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(top_k)) * 2).to(
        dtype
    )
    weights, ids = route_topk(logits, top_k, renorm, scoring)  # [T, k] fp32, int32
    got_w, got_ids = route_topk_fused(logits, top_k, renorm, scoring)
    assert (
        got_ids.dtype == torch.int32 and got_w.dtype == torch.float32 and got_w.shape == (num_tokens, top_k)
    )
    assert_same_experts(got_ids, ids, logits, top_k)
    torch.testing.assert_close(got_w, weights, atol=1e-6, rtol=1e-6)  # tied experts: equal weights
    rounded, _ = route_topk_fused(logits, top_k, renorm, scoring, weights_dtype=dtype)
    assert rounded.dtype == dtype
    torch.testing.assert_close(rounded.float(), weights.to(dtype).float(), atol=0, rtol=2**-7)
    ulps = (rounded.float() - weights.to(dtype).float()).abs() / weights.to(dtype).float().abs().clamp_min(
        1e-30
    )
    assert ulps.max() <= 2**-7


def test_fused_routing_strided_logits_and_no_tokens() -> None:
    from longserve.kernels.moe_routing import route_topk_fused

    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(3))[:, ::2]  # [6, 8] strided
    weights, ids = route_topk(logits, 2, True)
    got_w, got_ids = route_topk_fused(logits, 2, True)
    assert_same_experts(got_ids, ids, logits, 2)
    torch.testing.assert_close(got_w, weights, atol=1e-6, rtol=1e-6)
    w0, i0 = route_topk_fused(logits[:0], 2, True)
    assert w0.shape == i0.shape == (0, 2)
    with pytest.raises(ValueError, match="scoring"):
        route_topk_fused(logits, 2, False, scoring="relu")


def test_compiles_for_sm90() -> None:
    """Triton's real compiler (not the interpreter) takes the kernels: the alignment at decode size, with a
    map, with int64 ids (the CTA barrier is there); the router's top-k; both with programmatic dependent launch
    (griddepcontrol in the PTX exactly where asked)."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    variants = ['{"pairs": 8, "block_m": 16}', '{"pairs": 2, "block_m": 16, "emap": true}',
                '{"pairs": 64, "block_m": 64, "ids": "i64", "emap": true}', '{"routing": true}',
                '{"pairs": 8, "block_m": 16, "pdl": true}', '{"routing": true, "pdl": true}']  # fmt: skip
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "dev" / "compile_moe_align.py"), *variants],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("triton's ptxas is not available here")
    assert res.returncode == 0, res.stderr[-3000:]
    reports = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(reports) == 6
    for r in reports:
        assert "cubin" in r["stages"] and (r["bar_sync"] or r["variant"].get("routing")), r
        assert r.get("local", 0) == 0 and r.get("stack", 0) == 0, r  # no spills
        assert r["pdl"] is bool(r["variant"].get("pdl")), r


def test_bench_times_both_alignments(monkeypatch: pytest.MonkeyPatch) -> None:
    """`python3 -m longserve.bench.kernels.moe --align both` (the measurement that sets the switch): one row
    per alignment, checked against the reference, the switch restored afterwards (CPU smoke: timer faked)."""
    from longserve.bench.kernels import moe as bench

    timed = []
    monkeypatch.setattr(align_mod, "MOE_TRITON_ALIGN_MAX_PAIRS", 5)
    monkeypatch.setattr(bench, "cuda_time_ms", lambda fn, **kw: timed.append(fn()) or 1.0)
    monkeypatch.setitem(bench.SHAPES, "tiny", bench.MoEShape(8, 2, 32, 24, True))
    rows = bench.bench_moe(
        ["tiny"], (1, 5), torch.float32, warmup=0, iters=1, repeats=1, compare_torch=False, device="cpu",
        align_modes=bench.ALIGN_MODES,
    )  # fmt: skip
    assert [(r["tokens"], r["align"]) for r in rows] == [
        (1, "torch"),
        (1, "triton"),
        (5, "torch"),
        (5, "triton"),
    ]
    assert all(r["rel_err"] < 1e-5 and r["align_ms"] == r["route_ms"] == 1.0 for r in rows)
    assert align_mod.MOE_TRITON_ALIGN_MAX_PAIRS == 5
    assert "align_ms" in bench.format_rows(rows)
