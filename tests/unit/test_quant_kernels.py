"""The quantized kernels (Triton, under TRITON_INTERPRET=1 on the CPU) against their torch references at tiny
shapes: the W4A16/W8A16 GEMM (fused with split-K, and dequantize-then-matmul), the per-token-group FP8 and
per-token INT8 activation quantization, the block FP8 GEMM, the fused MoE kernel's int4/int8 (group-wise,
zero points, act order) and fp8 (block, per channel) experts; and the references against plain float math."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from longserve.kernels.fused_moe import fused_moe  # noqa: E402
from longserve.kernels.moe_reference import MoEQuant, fused_moe_ref, route_topk  # noqa: E402
from longserve.kernels.quant_fp8 import fp8_block_linear, per_token_group_quant  # noqa: E402
from longserve.kernels.quant_gemm import wna16_dequantize, wna16_gemm  # noqa: E402
from longserve.kernels.quant_reference import (  # noqa: E402
    FP8_DTYPE,
    dequantize_fp8_block,
    dequantize_wna16,
    fp8_block_gemm_ref,
    pack_int_k,
    per_token_group_quant_fp8_ref,
    per_token_quant_int8_ref,
    unpack_int_k,
    wna16_gemm_ref,
)
from longserve.kernels.quant_tiles import minus_zero  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def int_weights(n: int, k: int, bits: int, group: int, zp: bool, act_order: bool, seed: int):
    g = gen(seed)
    groups = k // group if group > 0 else 1
    qweight = pack_int_k(torch.randint(0, 2**bits, (n, k), generator=g), bits)
    scales = (torch.rand(n, groups, generator=g) * 0.02 + 0.001).half()
    zeros = torch.randint(0, 2**bits, (n, groups), generator=g).to(torch.uint8) if zp else None
    g_idx = (torch.randperm(k, generator=g) // (group if group > 0 else k)).int() if act_order else None
    return qweight, scales, zeros, g_idx


def test_int_packing_round_trips() -> None:
    values = torch.randint(0, 16, (5, 12), generator=gen(0))
    assert torch.equal(unpack_int_k(pack_int_k(values, 4), 4), values.to(torch.int16))
    assert pack_int_k(values, 4)[0, 0] == values[0, 0] | (values[0, 1] << 4)  # low nibble first


@pytest.mark.parametrize(
    ("bits", "group", "zp", "act_order", "split_k"),
    [(4, 32, False, False, 1), (4, 64, True, False, 2), (4, -1, True, False, 3), (8, 32, True, True, 2),
     (4, 32, True, True, 1), (8, 128, False, False, 1)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wna16_gemm_equals_reference(bits, group, zp, act_order, split_k, dtype) -> None:
    m, n, k = 5, 48, 256
    qweight, scales, zeros, g_idx = int_weights(n, k, bits, group, zp, act_order, seed=bits + split_k)
    x = torch.randn(m, k, generator=gen(1)).to(dtype)
    bias = torch.randn(n, generator=gen(2)).to(dtype)
    ref = wna16_gemm_ref(x, qweight, scales, zeros, g_idx, bits, group, bias)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": split_k, "num_warps": 4, "num_stages": 1}
    out = wna16_gemm(x, qweight, scales, zeros, g_idx, bits, group, bias, config=cfg)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    # the large-M path: the weight dequantized by the kernel equals the reference's, bit for bit
    weight = wna16_dequantize(qweight, scales, zeros, g_idx, bits, group, dtype)
    assert torch.equal(weight, dequantize_wna16(qweight, scales, zeros, g_idx, bits, group).to(dtype))
    torch.testing.assert_close(
        wna16_gemm(x, qweight, scales, zeros, g_idx, bits, group, bias, path="dequant"), ref, atol=TOL[dtype],
        rtol=TOL[dtype],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("bits", "group", "zp", "n", "k", "split_k"),
    [(4, 32, True, 40, 256, 1), (4, -1, True, 40, 200, 3), (8, 64, False, 70, 192, 2), (4, 128, False, 64, 512, 1)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wna16_gemm_by_rows_equals_by_columns(bits, group, zp, n, k, split_k, dtype, monkeypatch) -> None:
    """quant_gemm.WNA16_INT_ROWS: the fused kernel's weight tiles loaded as rows give its output by columns bit for
    bit (bf16; fp32 to its last bits under the interpreter): N off the tile (40 and 70 rows over 32), K split over
    programs and off the key tile (200 in splits of 96), one group over all of K, zero points, 8 bits."""
    from longserve.kernels import quant_gemm

    qweight, scales, zeros, _ = int_weights(n, k, bits, group, zp, False, seed=n + k + bits)
    x = torch.randn(7, k, generator=gen(3)).to(dtype)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": split_k, "num_warps": 4, "num_stages": 1}
    outs = {}
    for rows in (False, True):
        monkeypatch.setattr(quant_gemm, "WNA16_INT_ROWS", rows)
        outs[rows] = wna16_gemm(x, qweight, scales, zeros, None, bits, group, config=cfg)
    if dtype == torch.float32:  # the interpreter's fp32 dot (numpy) sums a transposed tile in another order
        torch.testing.assert_close(outs[True], outs[False], atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(outs[True], outs[False])
    ref = wna16_gemm_ref(x, qweight, scales, zeros, None, bits, group)
    torch.testing.assert_close(outs[True], ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_wna16_gemm_takes_the_fused_kernel_up_to_its_limit(monkeypatch) -> None:
    """Past the GEMV, up to quant_gemm.WNA16_FUSED_MAX_TOKENS rows the fused kernel by rows serves (off: 0 by
    default); act order, or more rows, the dequantized weight and a 16-bit GEMM."""
    from longserve.kernels import quant_gemm

    paths: list[str] = []
    real_gemm = quant_gemm._wna16_gemm_kernel
    real_dequant = quant_gemm.wna16_dequantize

    class Counted:
        def __getitem__(self, grid):
            paths.append("fused")
            return real_gemm[grid]

    monkeypatch.setattr(quant_gemm, "_wna16_gemm_kernel", Counted())
    monkeypatch.setattr(
        quant_gemm, "wna16_dequantize", lambda *a, **k: paths.append("dequant") or real_dequant(*a, **k)
    )
    monkeypatch.setattr(quant_gemm, "WNA16_GEMV_MAX_TOKENS", 2)
    qweight, scales, zeros, _ = int_weights(32, 64, 4, 32, True, False, seed=5)
    _, _, _, g_idx = int_weights(32, 64, 4, 32, True, True, seed=5)
    for m, limit, act_order, want in ((3, 0, False, "dequant"), (3, 4, False, "fused"), (4, 4, False, "fused"),
                                      (5, 4, False, "dequant"), (3, 4, True, "dequant")):  # fmt: skip
        monkeypatch.setattr(quant_gemm, "WNA16_FUSED_MAX_TOKENS", limit)
        x = torch.randn(m, 64, generator=gen(m))
        gi = g_idx if act_order else None
        out = wna16_gemm(x, qweight, scales, zeros, gi, 4, 32)
        assert paths.pop() == want and not paths, (m, limit, act_order)
        torch.testing.assert_close(
            out, wna16_gemm_ref(x, qweight, scales, zeros, gi, 4, 32), atol=1e-4, rtol=1e-4
        )


@pytest.mark.parametrize(
    ("bits", "group", "zp", "n", "k"),
    [(4, 128, False, 100, 512), (4, 32, True, 64, 96), (4, -1, True, 40, 200), (8, 64, False, 70, 192),
     (8, 128, True, 64, 256)],
)  # fmt: skip
@pytest.mark.parametrize("rows", [False, True])
def test_wna16_dequantize_both_kernels_equal_the_reference(bits, group, zp, n, k, rows, monkeypatch) -> None:
    """The dequantized weight, bit for bit, by either kernel (quant_gemm.DEQUANT_ROWS): rows and columns off the
    tiles (n 100 over 64-row tiles, k 200 over 64 columns), one group over all of K, zero points."""
    from longserve.kernels import quant_gemm

    monkeypatch.setattr(quant_gemm, "DEQUANT_ROWS", rows)
    qweight, scales, zeros, _ = int_weights(n, k, bits, group, zp, False, seed=n + k)
    for dtype in (torch.float32, torch.bfloat16):
        ref = dequantize_wna16(qweight, scales, zeros, None, bits, group).to(dtype)
        assert torch.equal(wna16_dequantize(qweight, scales, zeros, None, bits, group, dtype), ref)


@triton.jit
def _minus_zero_kernel(q_ptr, z_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, minus_zero(tl.load(q_ptr + i), tl.load(z_ptr + i)))


def test_minus_zero_is_q_minus_z_for_every_value() -> None:
    """quant_tiles.minus_zero, the int weights' q - z from q's bits (no int-to-float conversion): every 8-bit q
    against every 8-bit zero point and the symmetric 8 and 128, bit for bit as the float subtraction."""
    q = torch.arange(256, dtype=torch.int32).repeat_interleave(258)
    z = torch.cat([torch.arange(256, dtype=torch.float32), torch.tensor([8.0, 128.0])]).repeat(256)
    out = torch.empty(q.numel(), dtype=torch.float32)
    n = 1 << (q.numel() - 1).bit_length()
    q, z, out = (torch.nn.functional.pad(t, (0, n - t.numel())) for t in (q, z, out))
    _minus_zero_kernel[(1,)](q, z, out, N=n)
    assert torch.equal(out, q.float() - z)


def test_wna16_reference_is_the_formula() -> None:
    """w[n, k] = (q - z) * s of k's group; symmetric weights use z = 2^(bits-1)."""
    qweight, scales, zeros, _ = int_weights(4, 64, 4, 32, True, False, seed=3)
    q = unpack_int_k(qweight, 4).float()
    w = dequantize_wna16(qweight, scales, zeros, None, 4, 32)
    assert torch.equal(w[2, 40], (q[2, 40] - zeros[2, 1].float()) * scales[2, 1].float())
    sym = dequantize_wna16(qweight, scales, None, None, 4, 32)
    assert torch.equal(sym[1, 3], (q[1, 3] - 8) * scales[1, 0].float())


def test_fp8_activation_quantization_rounds_like_torch() -> None:
    """Every e4m3 value's neighbourhood (normal and subnormal) rounds as torch's cast does."""
    g = gen(4)
    x = torch.cat([torch.randn(6, 128, generator=g) * 10 ** torch.randint(-3, 2, (6, 1), generator=g)])
    x[0, :8] = torch.tensor([0.0, 1e-30, -0.0, 448.0, -448.0, 447.9, 1e-3, -2e-3])
    for dtype in (torch.float32, torch.bfloat16):
        for group in (32, 128, 0):
            q, s = per_token_group_quant(x.to(dtype), group)
            q_ref, s_ref = per_token_group_quant_fp8_ref(x.to(dtype), group if group > 0 else 128)
            assert torch.equal(s, s_ref)
            assert torch.equal(q.float(), q_ref.float())


def test_int8_activation_quantization() -> None:
    x = torch.randn(7, 96, generator=gen(5))
    x[1, 5] = 127.5 / 127.5 * x[1].abs().max()  # a value exactly at the top of the range
    q, s = per_token_group_quant(x, 0, torch.int8)
    q_ref, s_ref = per_token_quant_int8_ref(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    assert int(q.max()) <= 127 and int(q.min()) >= -128
    static = torch.tensor([0.02])
    q, s = per_token_group_quant(x, 0, torch.int8, static_scale=static)
    assert torch.equal(q, per_token_quant_int8_ref(x, static)[0]) and torch.all(s == 0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [(32, 32), (16, 64)])
def test_fp8_block_gemm_equals_reference(dtype, block) -> None:
    m, n, k = 9, 80, 128  # N not a multiple of the block: a partial last block row
    g = gen(6)
    w = torch.randn(n, k, generator=g).to(FP8_DTYPE)
    w_scale = torch.rand(-(-n // block[0]), k // block[1], generator=g) * 0.02 + 0.005
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    ref = fp8_block_gemm_ref(x, w, w_scale, block, bias)
    out = fp8_block_linear(x, w, w_scale, block, bias)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    # the reference is the float product of the dequantized activations and weights
    xq, xs = per_token_group_quant_fp8_ref(x, block[1])
    plain = (xq.float() * xs.repeat_interleave(block[1], 1)) @ dequantize_fp8_block(w, w_scale, block).T
    torch.testing.assert_close(ref.float(), (plain + bias.float()).to(dtype).float(), atol=0, rtol=0)


def moe_case(kind: str, seed: int, e: int = 4, h: int = 64, i: int = 32):
    g = gen(seed)
    if kind.startswith("int"):
        bits, group = (4, 32) if kind.startswith("int4") else (8, 32)
        zp, act_order = "zp" in kind, "act" in kind
        w13, s13, z13, g13 = zip(*(int_weights(2 * i, h, bits, group, zp, False, seed + x) for x in range(e)))
        w2, s2, z2, g2 = zip(*(int_weights(h, i, bits, group, zp, False, seed + 10 + x) for x in range(e)))
        stack = lambda t: None if t[0] is None else torch.stack(t)  # noqa: E731
        gi13 = (
            torch.stack([(torch.randperm(h, generator=g) // group).int() for _ in range(e)])
            if act_order
            else None
        )
        gi2 = (
            torch.stack([(torch.randperm(i, generator=g) // group).int() for _ in range(e)])
            if act_order
            else None
        )
        quant = MoEQuant(f"int{bits}", group, stack(s13), stack(s2), stack(z13), stack(z2), gi13, gi2)
        return stack(w13), stack(w2), quant
    w13 = torch.randn(e, 2 * i, h, generator=g).to(FP8_DTYPE)
    w2 = torch.randn(e, h, i, generator=g).to(FP8_DTYPE)
    if kind == "fp8-block":
        bn = bk = 16
        s13 = torch.rand(e, 2 * i // bn, h // bk, generator=g) * 0.05 + 0.01
        s2 = torch.rand(e, h // bn, i // bk, generator=g) * 0.05 + 0.01
        return w13, w2, MoEQuant("fp8_e4m3", bk, s13, s2, block_n=bn)
    s13, s2 = (
        torch.rand(e, 2 * i, 1, generator=g) * 0.05 + 0.01,
        torch.rand(e, h, 1, generator=g) * 0.05 + 0.01,
    )
    return w13, w2, MoEQuant("fp8_e4m3", 0, s13, s2, block_n=1)


@pytest.mark.parametrize("kind", ["int4", "int4-zp-act", "int8-zp", "fp8-block", "fp8-channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_quantized_experts_equal_reference(kind: str, dtype) -> None:
    w13, w2, quant = moe_case(kind, seed=7)
    x = torch.randn(11, 64, generator=gen(8)).to(dtype)
    weights, ids = route_topk(torch.randn(11, 4, generator=gen(9)), 2, True)
    ref = fused_moe_ref(x, w13, w2, weights.to(dtype), ids, quant=quant)
    out = fused_moe(x, w13, w2, weights.to(dtype), ids, quant=quant)
    # the int8 experts' outputs run to ~2,000, and some near zero are what is left of sums of such terms: both
    # paths sum in fp32, in orders that follow the CPU's matmul kernels, so an output can differ by the fp32
    # rounding of the largest terms over its 64 products (2.4e-4 at 0.27 on one Xeon, within 1e-4 on another)
    summation = 64 * torch.finfo(torch.float32).eps * float(ref.abs().max())
    torch.testing.assert_close(out, ref, atol=TOL[dtype] * 10 + summation, rtol=TOL[dtype])


def test_fp8_dots_with_full_precision_accumulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """quant_fp8.FP8_DOT_MAX_IMPRECISE_ACC (the probe of the fp8 accumulation on sm90) reaches both fp8
    kernels, read at call time, and leaves their results equal to the references (and the variants it makes
    are compiled for sm90 by the CI's compile check)."""
    from longserve.kernels import quant_fp8

    monkeypatch.setattr(quant_fp8, "FP8_DOT_MAX_IMPRECISE_ACC", 0)
    seen = []
    real = quant_fp8._fp8_block_gemm_kernel.run
    # in the kernel's own __dict__, removed after: an attribute set back would pin today's bound `run`, and a later
    # class-level wrapper (kernel_compile.record_launches) would miss this kernel's launches
    monkeypatch.setitem(
        vars(quant_fp8._fp8_block_gemm_kernel),
        "run",
        lambda *a, **k: seen.append(k["MAX_IMPRECISE_ACC"]) or real(*a, **k),
    )
    g = gen(21)
    w = torch.randn(48, 64, generator=g).to(FP8_DTYPE)
    w_scale = torch.rand(3, 2, generator=g) * 0.02 + 0.005
    x = torch.randn(5, 64, generator=g)
    ref = fp8_block_gemm_ref(x, w, w_scale, (16, 32))
    torch.testing.assert_close(
        fp8_block_linear(x, w, w_scale, (16, 32)), ref, atol=TOL[torch.float32], rtol=0
    )
    assert seen == [0]
    w13, w2, quant = moe_case("fp8-block", seed=22)
    x = torch.randn(7, 64, generator=gen(23))
    weights, ids = route_topk(torch.randn(7, 4, generator=gen(24)), 2, True)
    ref = fused_moe_ref(x, w13, w2, weights, ids, quant=quant)
    out = fused_moe(x, w13, w2, weights, ids, quant=quant)
    torch.testing.assert_close(out, ref, atol=TOL[torch.float32] * 10, rtol=TOL[torch.float32])


@pytest.mark.parametrize("tile_n, tile_k", [(16, 16), (32, 16), (16, 32)])
def test_fused_moe_block_fp8_tiles_across_the_scale_blocks(
    monkeypatch: pytest.MonkeyPatch, tile_n, tile_k
) -> None:
    """Block-FP8 experts with scale blocks of 16 rows x 32 K: tiles within one block's rows (one scale a tile and
    K block, SCALAR_B_SCALE) and wider than a block (a scale per column), K blocks of half a group (the group's
    index found from two blocks, GROUP_BLOCKS 2) and of a whole one, each equal to the reference."""
    from longserve.kernels import moe_gemm

    g = gen(31)
    e, h, i = 4, 64, 64
    w13 = torch.randn(e, 2 * i, h, generator=g).to(FP8_DTYPE)
    w2 = torch.randn(e, h, i, generator=g).to(FP8_DTYPE)
    s13 = torch.rand(e, 2 * i // 16, h // 32, generator=g) * 0.05 + 0.01
    s2 = torch.rand(e, h // 16, i // 32, generator=g) * 0.05 + 0.01
    quant = MoEQuant("fp8_e4m3", 32, s13, s2, block_n=16)
    x = torch.randn(9, h, generator=gen(32))
    weights, ids = route_topk(torch.randn(9, e, generator=gen(33)), 2, True)
    seen = []
    kernel = moe_gemm._moe_gemm_kernel
    real = kernel.run
    monkeypatch.setitem(  # removed after, as above
        vars(kernel),
        "run",
        lambda *a, **k: seen.append((k["SCALAR_B_SCALE"], k["GROUP_BLOCKS"])) or real(*a, **k),
    )
    cfg = {"BLOCK_M": 16, "BLOCK_N": tile_n, "BLOCK_K": tile_k, "GROUP_M": 1, "num_warps": 4, "num_stages": 1}
    out = fused_moe(x, w13, w2, weights, ids, quant=quant, config=cfg)
    assert seen == [(tile_n == 16, 32 // tile_k)] * 2  # gate+up, down
    ref = fused_moe_ref(x, w13, w2, weights, ids, quant=quant)
    torch.testing.assert_close(out, ref, atol=TOL[torch.float32] * 10, rtol=TOL[torch.float32])


def test_fused_moe_quantized_expert_parallel_parts_sum_to_the_whole() -> None:
    """Expert parallelism with int4 experts: each rank's experts (expert_map) give its share of the sum."""
    w13, w2, quant = moe_case("int4-zp-act", seed=10)
    x = torch.randn(9, 64, generator=gen(11))
    weights, ids = route_topk(torch.randn(9, 4, generator=gen(12)), 2, True)
    whole = fused_moe_ref(x, w13, w2, weights, ids, quant=quant)
    parts = []
    for rank in range(2):
        local = slice(2 * rank, 2 * rank + 2)
        emap = torch.full((4,), -1, dtype=torch.int32)
        emap[local] = torch.arange(2, dtype=torch.int32)
        sub = lambda t, local=local: None if t is None else t[local]  # noqa: E731
        q = MoEQuant(quant.weight_dtype, quant.group_size, sub(quant.w13_scale), sub(quant.w2_scale),
                     sub(quant.w13_zero), sub(quant.w2_zero), sub(quant.w13_g_idx), sub(quant.w2_g_idx))  # fmt: skip
        parts.append(fused_moe(x, w13[local], w2[local], weights, ids, quant=q, expert_map=emap))
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-5, rtol=1e-5)


def test_quantized_moe_reference_is_the_dequantized_float_moe() -> None:
    """Integer experts compute exactly the float experts of their dequantized weights."""
    w13, w2, quant = moe_case("int4-zp-act", seed=13)
    x = torch.randn(6, 64, generator=gen(14))
    weights, ids = route_topk(torch.randn(6, 4, generator=gen(15)), 2, True)
    d13 = torch.stack([dequantize_wna16(w13[e], quant.w13_scale[e], quant.w13_zero[e], quant.w13_g_idx[e], 4, 32)
                       for e in range(4)])  # fmt: skip
    d2 = torch.stack([dequantize_wna16(w2[e], quant.w2_scale[e], quant.w2_zero[e], quant.w2_g_idx[e], 4, 32)
                      for e in range(4)])  # fmt: skip
    assert torch.equal(
        fused_moe_ref(x, w13, w2, weights, ids, quant=quant), fused_moe_ref(x, d13, d2, weights, ids)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_channel_fp8_through_the_block_gemm(dtype) -> None:
    """Per-channel FP8 (one block per weight row and all of K, activations per token): the Triton block GEMM
    that serves non-bf16 activations equals the reference's scaled product."""
    from longserve.kernels.quant_fp8 import fp8_block_gemm
    from longserve.kernels.quant_reference import scaled_gemm_ref

    g = gen(16)
    x = torch.randn(6, 96, generator=g).to(dtype)
    w = torch.randn(40, 96, generator=g).to(FP8_DTYPE)
    w_scale = torch.rand(40, generator=g) * 0.02 + 0.005
    xq, xs = per_token_group_quant(x, 0)
    out = fp8_block_gemm(xq, xs, w, w_scale.view(-1, 1), (1, 96), dtype)
    torch.testing.assert_close(
        out, scaled_gemm_ref(xq, xs, w, w_scale, dtype), atol=TOL[dtype], rtol=TOL[dtype]
    )


def test_the_fused_kernel_serves_only_products_whose_tiles_fill_the_sms(monkeypatch) -> None:
    """quant_gemm.WNA16_FUSED_WIDE_MAX_TOKENS: on an H100's 132 SMs (the sweep's card) the 8B's gate_up (N 28672)
    fills them from 65 rows, qkv (6144), o and down (4096) do not even at 256; never off CUDA."""
    from longserve.kernels import quant_gemm, split_k

    monkeypatch.setattr(split_k, "num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert quant_gemm._fills_the_sms(65, 28672, cuda) and quant_gemm._fills_the_sms(256, 28672, cuda)
    assert not any(quant_gemm._fills_the_sms(256, n, cuda) for n in (6144, 4096))
    assert not quant_gemm._fills_the_sms(65, 28672, torch.device("cpu"))
