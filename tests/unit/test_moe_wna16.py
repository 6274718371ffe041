"""kernels/moe_wna16.py under TRITON_INTERPRET=1: integer experts at decode sizes through the routed int4 GEMV
and at prefill sizes through the dequantized experts, against `fused_moe_ref` (shapes unlike the real ones:
6 experts top-3, intermediate 48, an expert with no tokens, one token, k = 1, split-K); which path a step
takes; the weighted sum over k (moe_sum with routing weights) against the reference's rounding."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from longserve.kernels import fused_moe as fm  # noqa: E402
from longserve.kernels import moe_wna16  # noqa: E402
from longserve.kernels.moe_reference import MoEQuant, fused_moe_ref, route_topk  # noqa: E402
from longserve.kernels.moe_sum import moe_sum  # noqa: E402
from longserve.kernels.quant_reference import pack_int_k  # noqa: E402

E, H, I = 6, 64, 48  # noqa: E741
BF16 = torch.bfloat16


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def int4_experts(
    group: int, zp: bool, seed: int = 0, hidden: int = H, inter: int = I
) -> tuple[torch.Tensor, torch.Tensor, MoEQuant]:
    """Six distinct int4 experts (packed as quant_reference lays them out), scales giving weights of std ~
    1/sqrt(K)."""
    g = gen(seed)

    def proj(n: int, k: int):
        q = pack_int_k(torch.randint(0, 16, (E, n, k), generator=g).view(E * n, k), 4).view(E, n, k // 2)
        groups = k // group if group > 0 else 1  # 0: one group of all K
        s = (torch.rand(E, n, groups, generator=g) + 0.5) * (k**-0.5 / 4)
        z = torch.randint(0, 16, (E, n, groups), generator=g).to(torch.uint8) if zp else None
        return q, s.half(), z

    w13, s13, z13 = proj(2 * inter, hidden)
    w2, s2, z2 = proj(hidden, inter)
    return w13, w2, MoEQuant("int4", group, s13, s2, z13, z2)


def routing(num_tokens: int, top_k: int, seed: int, skip_expert: bool = True):
    logits = torch.randn(num_tokens, E, generator=gen(seed))
    if skip_expert:
        logits[:, 5] = -1e4  # expert 5 gets no token
    return route_topk(logits, top_k, True)


def assert_close_as(out: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor) -> None:
    """fp32: the reference to summation order (and the int4 GEMV's 128 + q offsets: ~5 bits of 24); bf16: no
    further from the fp32 result (`truth`) than twice the reference's own bf16 rounding is (each rounds the
    projections, silu and products to bf16, from weights rounded differently)."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:
        err = lambda a: ((a.float() - truth).norm() / truth.norm()).item()  # noqa: E731
        assert err(out) < 2 * err(ref) + 1e-3, (err(out), err(ref))


def check_both_weight_dtypes(x, w13, w2, weights, ids, quant) -> None:
    """fused_moe against the reference with the routing weights in x's dtype (Qwen-MoE's) and in fp32
    (Mixtral's), assert_close_as each."""
    for w in (weights.to(x.dtype), weights):
        ref = fused_moe_ref(x, w13, w2, w, ids, quant=quant)
        out = fm.fused_moe(x, w13, w2, w, ids, quant=quant)
        assert_close_as(out, ref, fused_moe_ref(x.float(), w13, w2, w.float(), ids, quant=quant))


def taken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths fused_moe takes for integer experts, recorded."""
    paths: list[str] = []
    real = fm.moe_wna16_path

    def recorded(*args, **kwargs):
        paths.append(real(*args, **kwargs))
        return paths[-1]

    monkeypatch.setattr(fm, "moe_wna16_path", recorded)
    return paths


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "group", "zp", "dtype", "split"),
    [(1, 3, 16, False, torch.bfloat16, 1), (5, 3, 16, True, torch.bfloat16, 2), (4, 1, 16, False, torch.float32, 1),
     (3, 2, 0, True, torch.float32, 3)],
)  # fmt: skip
@pytest.mark.parametrize("raw_hi", [False, True])
def test_decode_sizes_take_the_routed_gemv(
    num_tokens, top_k, group, zp, dtype, split, raw_hi, monkeypatch
) -> None:
    """At decode sizes 4-bit experts go through the routed GEMV (split-K forced on: the CPU has no SMs to fill)
    and give the reference's result: bf16 to its rounding of each dequantized weight, fp32 to summation order;
    routing weights in the dtype (Qwen-MoE) and in fp32 (Mixtral); int4_gemv.INT4_GEMV_RAW_HI off and on."""
    from longserve.kernels import int4_gemv

    monkeypatch.setattr(int4_gemv, "INT4_GEMV_RAW_HI", raw_hi)
    paths = taken(monkeypatch)
    monkeypatch.setattr(moe_wna16, "splits_for", lambda device, n_blocks, num_tiles: min(split, num_tiles))
    w13, w2, quant = int4_experts(group, zp)
    x = torch.randn(num_tokens, H, generator=gen(3)).to(dtype)
    weights, ids = routing(num_tokens, top_k, seed=4)
    check_both_weight_dtypes(x, w13, w2, weights, ids, quant)
    assert paths == ["gemv", "gemv"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_routed_gemv_adds_a_shared_experts_addend_in_its_sum(dtype: torch.dtype, monkeypatch) -> None:
    """4-bit experts at a decode size (the routed GEMV, split-K on) with fused_moe's `addend` (a shared expert and
    its gate logit): added in the weighted k-sum's launch, equal to the routed result without it plus torch's
    sigmoid(gate) * shared, to rounding."""
    from longserve.kernels.activation_reference import sigmoid_gated_add_ref

    paths = taken(monkeypatch)
    monkeypatch.setattr(moe_wna16, "splits_for", lambda device, n_blocks, num_tiles: min(2, num_tiles))
    w13, w2, quant = int4_experts(16, True)
    x = torch.randn(2, H, generator=gen(5)).to(dtype)
    weights, ids = routing(2, 3, seed=6)
    gate, shared = (
        (torch.randn(2, 1, generator=gen(7)) * 3).to(dtype),
        torch.randn(2, H, generator=gen(8)).to(dtype),
    )
    got = fm.fused_moe(x, w13, w2, weights.to(dtype), ids, quant=quant, addend=(gate, shared))
    want = sigmoid_gated_add_ref(fm.fused_moe(x, w13, w2, weights.to(dtype), ids, quant=quant), gate, shared)
    bound = (want.float().abs() + 2 * shared.float().abs()) * (1e-6 if dtype == torch.float32 else 2**-7)
    assert ((got.float() - want.float()).abs() <= bound + 1e-6).all()
    assert paths == ["gemv", "gemv"]


@pytest.mark.parametrize(("num_tokens", "top_k", "group", "zp"), [(5, 3, 128, True), (9, 2, 0, False)])
def test_the_grouped_kernel_with_its_switch_on(num_tokens, top_k, group, zp, monkeypatch) -> None:
    """MOE_WNA16_GROUPED_MIN_TOKENS on: 4-bit experts in 128-value groups go through the grouped kernel (each
    block of pairs of one expert reads its weights once; int4_dot_tile) and give the reference's result; an
    expert with no tokens, zero points on and off; fp32 activations and groups of 64 keep the GEMV."""
    paths = taken(monkeypatch)
    monkeypatch.setattr(moe_wna16, "MOE_WNA16_GROUPED_MIN_TOKENS", 2)
    hidden, inter = 256, 128
    w13, w2, quant = int4_experts(group, zp, seed=16, hidden=hidden, inter=inter)
    x = torch.randn(num_tokens, hidden, generator=gen(17)).bfloat16()
    weights, ids = routing(num_tokens, top_k, seed=18)
    check_both_weight_dtypes(x, w13, w2, weights, ids, quant)
    assert paths == ["grouped", "grouped"]
    assert (
        moe_wna16.moe_wna16_path(quant, num_tokens, hidden, inter, False, torch.float32, E, top_k) == "gemv"
    )
    _, _, q64 = int4_experts(64, zp, seed=16, hidden=hidden, inter=inter)
    assert moe_wna16.moe_wna16_path(q64, num_tokens, hidden, inter, False, torch.bfloat16, E, top_k) == "gemv"


def test_the_gemv_reads_each_pairs_own_expert() -> None:
    """Swapping two experts' weights changes exactly the tokens routed to them (the expert index per pair)."""
    w13, w2, quant = int4_experts(16, True, seed=5)
    x = torch.randn(4, H, generator=gen(6))
    ids = torch.tensor([[0], [1], [2], [0]], dtype=torch.int32)
    weights = torch.ones(4, 1)
    out = moe_wna16.moe_wna16_gemv(x, w13, w2, weights, ids, quant, torch.empty(4, H))
    perm = torch.tensor([1, 0, 2, 3, 4, 5])
    swapped = MoEQuant("int4", 16, quant.w13_scale[perm], quant.w2_scale[perm], quant.w13_zero[perm],
                       quant.w2_zero[perm])  # fmt: skip
    out2 = moe_wna16.moe_wna16_gemv(x, w13[perm], w2[perm], weights, ids, swapped, torch.empty(4, H))
    assert torch.equal(out[2], out2[2])  # expert 2 stays
    for t, other in ((0, 1), (1, 0), (3, 1)):
        torch.testing.assert_close(out2[t], fused_moe_ref(x[t : t + 1], w13, w2, weights[:1], ids[other : other + 1],
                                                          quant=quant)[0], atol=1e-4, rtol=1e-4)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_sizes_take_the_dequantized_experts(dtype, monkeypatch) -> None:
    """From MOE_WNA16_DEQUANT_MIN_TOKENS tokens (past MOE_WNA16_ROWS_MAX_PER_EXPERT for 4 bits) the experts are
    dequantized whole and the 16-bit kernel runs: the reference's result (it dequantizes the same way), zero points
    and an expert with no tokens included."""
    paths = taken(monkeypatch)
    monkeypatch.setattr(moe_wna16, "MOE_WNA16_DEQUANT_MIN_TOKENS", 4)
    # 4-bit steps of 4-8 tokens (top 3 of 6 experts: up to 4 rows an expert) take the int path, 9 tokens not
    monkeypatch.setattr(moe_wna16, "MOE_WNA16_ROWS_MAX_PER_EXPERT", 4)
    w13, w2, quant = int4_experts(16, True, seed=7)
    x = torch.randn(9, H, generator=gen(8)).to(dtype)
    weights, ids = routing(9, 3, seed=9)
    ref = fused_moe_ref(x, w13, w2, weights.to(dtype), ids, quant=quant)
    out = fm.fused_moe(x, w13, w2, weights.to(dtype), ids, quant=quant)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)  # the same dequantized weights
    assert paths == ["dequant"]


@pytest.mark.parametrize(
    ("group", "zp", "bits", "dtype"),
    [(16, True, 4, BF16), (32, False, 4, torch.float32), (0, True, 4, BF16), (16, True, 8, BF16)],
)
def test_prefill_sizes_through_the_int_path_by_rows(group, zp, bits, dtype, monkeypatch) -> None:
    """MOE_WNA16_PREFILL "fused": prefill sizes through fused_moe's int path, which dequantizes each tile as it loads
    it; with moe_gemm.INT_ROWS its tiles load each row's packed bytes once (quant_tiles.int_weight_rows) and give
    the same output bit for bit, both the reference's (each weight rounded to the dtype, as it rounds them): zero
    points, one group over all of K, 8 bits, an expert with no tokens."""
    from longserve.kernels import moe_gemm

    paths = taken(monkeypatch)
    monkeypatch.setattr(moe_wna16, "MOE_WNA16_DEQUANT_MIN_TOKENS", 9)
    monkeypatch.setattr(moe_wna16, "MOE_WNA16_PREFILL", "fused")
    w13, w2, quant = int4_experts(group, zp, seed=21, inter=64)
    if bits == 8:  # the same shapes as 8-bit values, one a byte
        g = gen(22)
        w13, w2 = (
            torch.randint(0, 256, (E, w.shape[1], w.shape[2] * 2), generator=g).to(torch.uint8)
            for w in (w13, w2)
        )
        quant = MoEQuant(
            "int8", group, quant.w13_scale / 16, quant.w2_scale / 16, quant.w13_zero, quant.w2_zero
        )
    x = torch.randn(9, H, generator=gen(23)).to(dtype)
    weights, ids = routing(9, 3, seed=24)
    ref = fused_moe_ref(x, w13, w2, weights.to(dtype), ids, quant=quant)
    outs = {}
    for rows in (False, True):
        monkeypatch.setattr(moe_gemm, "INT_ROWS", rows)
        outs[rows] = fm.fused_moe(x, w13, w2, weights.to(dtype), ids, quant=quant)
    assert torch.equal(outs[True], outs[False])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[True], ref, atol=tol, rtol=tol)
    assert paths == ["fused", "fused"]


@pytest.mark.parametrize("block_m", [16, 256])
def test_the_int_path_by_rows_off_the_key_tile(block_m, monkeypatch) -> None:
    """moe_gemm.INT_ROWS where the key tile does not divide K (one group over all of it; 32-column tiles over the
    down projection's 48): the packed bytes past K masked, the same output bit for bit; also in blocks of 256 rows
    on 8 warps (tune_moe.BLOCK_MS's largest)."""
    from longserve.kernels import moe_gemm

    w13, w2, quant = int4_experts(0, True, seed=25)
    x = torch.randn(7, H, generator=gen(26)).bfloat16()
    weights, ids = routing(7, 2, seed=27)
    cfg = {"BLOCK_M": block_m, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2, "num_stages": 1}
    cfg["num_warps"] = 8 if block_m == 256 else 4
    outs = {}
    for rows in (False, True):
        monkeypatch.setattr(moe_gemm, "INT_ROWS", rows)
        outs[rows] = fm.fused_moe(x, w13, w2, weights.bfloat16(), ids, quant=quant, config=cfg)
    assert torch.equal(outs[True], outs[False])
    ref = fused_moe_ref(x, w13, w2, weights.bfloat16(), ids, quant=quant)
    torch.testing.assert_close(outs[True], ref, atol=2e-2, rtol=2e-2)


def test_dequantized_experts_equal_the_reference_dequantization() -> None:
    from longserve.kernels.quant_reference import dequantize_wna16

    w13, w2, quant = int4_experts(16, True, seed=11)
    got = moe_wna16.dequantize_experts(quant, w2, "w2", torch.bfloat16)
    want = torch.stack(
        [dequantize_wna16(w2[e], quant.w2_scale[e], quant.w2_zero[e], None, 4, 16) for e in range(E)]
    )
    assert got.shape == (E, H, I) and torch.equal(got, want.bfloat16())


def test_which_path() -> None:
    """The routed GEMV takes 4-bit experts in groups of whole tiles up to its limit, the grouped kernel (groups
    of 128, 16-bit activations) from its own; act order, 8 bits, experts split over ranks and K without a tile
    fall back to fused_moe's int path; past the GEMV without the grouped kernel, and at prefill sizes, the
    experts are dequantized unless act order or expert parallelism, or 4 bits in a step of up to
    MOE_WNA16_ROWS_MAX_PER_EXPERT rows an expert (the int path by rows: top 2 of E experts, so E / 2 times as many
    tokens)."""
    _, _, quant = int4_experts(16, False)

    def path(
        q: MoEQuant, num_tokens: int, hidden: int, inter: int, distributed: bool, dtype, top_k: int = 2
    ) -> str:
        return moe_wna16.moe_wna16_path(q, num_tokens, hidden, inter, distributed, dtype, E, top_k)

    lo, hi = moe_wna16.MOE_WNA16_GEMV_MAX_TOKENS, moe_wna16.MOE_WNA16_DEQUANT_MIN_TOKENS
    assert path(quant, 1, H, I, False, BF16) == path(quant, lo, H, I, False, BF16) == "gemv"  # groups of 16
    rows = moe_wna16.MOE_WNA16_ROWS_MAX_PER_EXPERT * E // 2
    assert lo < hi <= rows
    # the bound is in rows an expert: top 3 reaches it at two thirds of the tokens
    assert path(quant, rows * 2 // 3, H, I, False, BF16, 3) == "fused"
    assert path(quant, rows * 2 // 3 + 1, H, I, False, BF16, 3) == "dequant"
    # past the GEMV (groups of 16: no grouped kernel), 4-bit steps of up to a few thousand tokens: the int path by
    # rows; larger, the dequantized experts
    assert path(quant, lo + 1, H, I, False, BF16) == path(quant, hi - 1, H, I, False, BF16) == "fused"
    assert path(quant, hi, H, I, False, BF16) == path(quant, rows, H, I, False, BF16) == "fused"
    assert path(quant, rows + 1, H, I, False, BF16) == "dequant"
    hidden, inter = 256, 128
    _, _, g128 = int4_experts(128, False, hidden=hidden, inter=inter)
    mid = moe_wna16.MOE_WNA16_GROUPED_MIN_TOKENS
    assert mid is not None and 1 < mid <= lo < hi
    assert path(g128, mid - 1, hidden, inter, False, BF16) == "gemv"
    grouped = path(g128, mid, hidden, inter, False, BF16), path(g128, hi - 1, hidden, inter, False, BF16)
    assert grouped == ("grouped", "grouped")
    assert path(g128, hi, hidden, inter, False, BF16) == "fused"
    assert path(g128, rows + 1, hidden, inter, False, BF16) == "dequant"
    # the grouped kernel's dots are 16-bit
    assert path(g128, mid, hidden, inter, False, torch.float32) == "gemv"
    assert path(quant, 1, H, I, True, BF16) == path(quant, hi, H, I, True, BF16) == "fused"
    int8 = MoEQuant("int8", 16, quant.w13_scale, quant.w2_scale)
    # 8 bits at prefill sizes: dequantized (their int path by rows is unmeasured there)
    assert path(int8, 1, H, I, False, BF16) == "fused" and path(int8, hi, H, I, False, BF16) == "dequant"
    act = MoEQuant(
        "int4", 16, quant.w13_scale, quant.w2_scale, w13_g_idx=torch.zeros(E, H, dtype=torch.int32)
    )
    assert path(act, 1, H, I, False, BF16) == path(act, hi, H, I, False, BF16) == "fused"
    assert (
        path(MoEQuant("int4", 24, quant.w13_scale, quant.w2_scale), 1, 72, I, False, BF16) == "fused"
    )  # no tile of 24
    assert path(MoEQuant("fp8_e4m3", 16, quant.w13_scale, quant.w2_scale), 1, H, I, False, BF16) == "fused"


@pytest.mark.parametrize(
    ("dtype", "wdtype"), [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
)
def test_weighted_sum_over_k_rounds_as_the_reference(dtype, wdtype) -> None:
    """moe_sum with routing weights: each row times its weight in their promoted dtype (rounded to bf16 when
    both are bf16), then the fp32 sum rounded once: fused_moe_ref's `weighted.sum(dim=1, dtype=fp32)`."""
    x = torch.randn(3, 4, 40, generator=gen(12)).to(dtype)
    w = torch.rand(3, 4, generator=gen(13)).to(wdtype)
    prod = x.to(torch.promote_types(dtype, wdtype)) * w[..., None]
    want = prod.sum(dim=1, dtype=torch.float32).to(dtype)
    got = moe_sum(x, torch.empty(3, 40, dtype=dtype), w)
    assert torch.equal(got, want)


def test_weighted_sum_over_k_adds_split_k_partials_first() -> None:
    """moe_sum of [S, T, k, H] fp32 partials: each row their sum in split order rounded to the dtype (what
    split_k.splitk_reduce writes), then weighted and summed as for ready rows: the same result, one launch."""
    from longserve.kernels.split_k import splitk_reduce

    parts = torch.randn(3, 2 * 4, 40, generator=gen(14))  # [S, T*k, H]
    w = torch.rand(2, 4, generator=gen(15)).bfloat16()
    rows = splitk_reduce(parts, None, torch.bfloat16).view(2, 4, 40)
    want = moe_sum(rows, torch.empty(2, 40, dtype=torch.bfloat16), w)
    got = moe_sum(parts.view(3, 2, 4, 40), torch.empty(2, 40, dtype=torch.bfloat16), w)
    assert torch.equal(got, want)
