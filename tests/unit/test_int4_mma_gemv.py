"""The int4 tensor-core GEMV (kernels/int4_mma_gemv.py) on the CPU: its inline PTX and epilogue run warp by warp
(kernels/int4_mma_reference.emulate) against the exact product, the products it takes, and the interpreter's own
sensitivity (a wrong operand in the asm is caught). Its sm90 build (the layout assertion, 16-byte loads, the mma
count): tests/unit/test_quant_gemv.py::test_gemv_compiles_for_sm90. On an H200: tests/gpu/test_int4_mma_gemv_gpu.py."""

from __future__ import annotations

import pytest
import torch

from longserve.kernels.quant_reference import dequantize_wna16, wna16_gemm_ref

mma = pytest.importorskip("longserve.kernels.int4_mma_gemv")
from longserve.kernels.int4_mma_reference import emulate  # noqa: E402
from longserve.testing.kernel_compile import CapturedLaunches  # noqa: E402


def _weights(n: int, k: int, group: int, zp: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    groups = k // (group if group > 0 else k)
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, groups, generator=g) * 0.02 + 0.005).bfloat16()
    zeros = torch.randint(0, 16, (n, groups), dtype=torch.uint8, generator=g) if zp else None
    return qweight, scales, zeros


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "zp", "splits"),
    [
        (1, 64, 512, 128, False, 1),  # decode at batch 1, GPTQ symmetric
        (1, 48, 512, 128, True, 3),  # zero points (AWQ / asymmetric GPTQ), split-K with a short last split
        (3, 80, 384, -1, False, 2),  # one group (per channel), N not a multiple of a program's columns
        (8, 32, 512, 256, True, 1),  # B's 8 token columns all real, groups of two steps
        (5, 24, 256, 128, False, 2),  # an odd row count, a half-empty 16-column tile
        (16, 32, 256, 128, True, 1),  # two token tiles (TOKEN_TILES 2), all 16 rows real
        (11, 48, 384, -1, False, 2),  # the second token tile 3 rows deep
        (37, 32, 256, 128, True, 2),  # three blocks of 16 rows (the last 5 deep), as at decode batch 37
    ],
)
def test_the_kernels_warps_compute_the_product(
    m: int, n: int, k: int, group: int, zp: bool, splits: int
) -> None:
    """1-64 rows: fp32 before the output's rounding, within 1e-5 of the exact product of the dequantized weights (the 128 + q
    form and its cancellation cost ~5 of fp32's 24 bits); in bf16 (+ bias), the exact product rounded once, and the
    reference's product (which rounds each weight to bf16 first) to that rounding's error."""
    torch.manual_seed(m + n)
    x = torch.randn(m, k).bfloat16()
    qweight, scales, zeros = _weights(n, k, group, zp)
    bias = torch.randn(n).bfloat16()
    exact = x.double() @ dequantize_wna16(qweight, scales, zeros, None, 4, group).double().T
    out = emulate(x, qweight, scales, zeros, group, splits, fp32=True).double()
    assert ((out - exact).abs().max() / exact.abs().max()).item() < 1e-5
    exact = exact + bias.double()
    got = emulate(x, qweight, scales, zeros, group, splits, bias).double()
    half_ulp = 2.0 ** (torch.floor(torch.log2(exact.abs())) - 8)
    assert ((got - exact).abs() <= half_ulp + 1e-5 * exact.abs().max()).all()
    ref = wna16_gemm_ref(x, qweight, scales, zeros, None, 4, group, bias).double()
    assert ((got - ref).norm() / ref.norm()).item() < 5e-3


def test_the_interpreter_catches_a_wrong_operand(monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulation reads the kernel's own asm: B's two registers swapped, or one pair shifted from the wrong
    nibble, make it wrong by far more than rounding (so the test above checks the asm, not a copy of it)."""
    import triton.language as tl

    x = torch.randn(2, 256).bfloat16()
    qweight, scales, _ = _weights(32, 256, 128, False)
    exact = x.double() @ dequantize_wna16(qweight, scales, None, None, 4, 128).double().T
    from longserve.kernels import int4_mma_ptx

    asm = int4_mma_ptx.STEP_ASM.value
    for broken in (
        asm.replace("$16, $20", "$20, $16"),
        asm.replace("shr.u32 w, $8, 8;", "shr.u32 w, $8, 12;", 1),
    ):
        monkeypatch.setattr(int4_mma_ptx, "STEP_ASM", tl.constexpr(broken))
        out = emulate(x, qweight, scales, None, 128, 1, fp32=True).double()
        assert ((out - exact).abs().max() / exact.abs().max()).item() > 0.05


def test_the_products_it_takes() -> None:
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    w = torch.zeros(4096, 2048, dtype=torch.uint8)
    assert mma.fits(x, w, None, 4, 128)
    assert mma.fits(torch.zeros(8, 4096, dtype=torch.bfloat16), w, None, 4, -1)  # one group
    assert mma.fits(x, w, None, 4, 512)  # four steps a group
    assert mma.fits(torch.zeros(16, 4096, dtype=torch.bfloat16), w, None, 4, 128)  # two token tiles
    assert mma.fits(torch.zeros(64, 4096, dtype=torch.bfloat16), w, None, 4, 128)  # four blocks of 16 rows
    # quant_gemv's GEMV takes up to 64 rows
    assert not mma.fits(torch.zeros(65, 4096, dtype=torch.bfloat16), w, None, 4, 128)
    assert not mma.fits(x.half(), w, None, 4, 128)  # bf16 mma only
    assert not mma.fits(x, w, None, 8, 128)
    assert not mma.fits(x, w, torch.zeros(4096, dtype=torch.int32), 4, 128)  # act order
    assert not mma.fits(x, w, None, 4, 64)  # a group inside a step
    assert not mma.fits(x, w, None, 4, 384)  # three steps a group: the step's group is a shift
    assert not mma.fits(x[:, :4000], w[:, :2000], None, 4, -1)  # K not whole steps


@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (512, 256)])
@pytest.mark.parametrize(("reps", "stages"), [(4, 0), (2, 0), (2, 4), (4, 8), (2, -2)])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_splits_keep_one_wave(
    n: int, k: int, reps: int, stages: int, m: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the 8B projections on 132 SMs: every program resident at once (or one split), no split empty; past 16
    rows a column tile's blocks of rows count as programs too."""
    monkeypatch.setattr(mma, "REPS", reps)
    monkeypatch.setattr(mma, "STAGES", abs(stages))
    monkeypatch.setattr(mma, "STAGE_STEPS", 2 if stages < 0 else 1)  # -2: 2 stages of 2 steps each
    monkeypatch.setattr(mma, "ONE_ROW", None)  # these at one row too
    columns, steps = -(-n // mma.block_n(m)), k // mma.K_STEP
    tiles = columns * mma.row_blocks(m)  # programs a split
    split, resident = mma.splits(columns, steps, 132, m), mma.resident_programs(132, m)
    per = -(-steps // split)
    assert 1 <= split <= steps and (split - 1) * per < steps  # each split has steps
    assert tiles * split <= resident or split == 1
    if per > 1:  # one step fewer a split would need more programs than fit
        assert tiles * -(-steps // (per - 1)) > resident
    # by registers (two token tiles take more; 2 steps a slot more still; the ring at one token tile with AHEAD, on:
    # 96 at REPS 2, 5 programs an SM), or by the TMA ring: at (4, 8) 8 x 16 KB, one program an SM
    expect = {(4, 0): 396, (2, 0): 792, (2, 4): 660 if mma.AHEAD else 792, (4, 8): 132, (2, -2): 528}
    if m > 8:
        expect = {(4, 0): 264, (2, 0): 396, (2, 4): 396, (4, 8): 132, (2, -2): 264}
    assert resident == expect[reps, stages]


@pytest.mark.parametrize("min_steps", [4, 8])
def test_splits_of_at_least_min_steps(min_steps: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """MIN_SPLIT_STEPS: every split but the last of at least that many steps, as many splits as that and one wave
    allow; fewer steps than that in all: one split."""
    monkeypatch.setattr(mma, "ONE_ROW", (2, 0))
    monkeypatch.setattr(mma, "MIN_SPLIT_STEPS", min_steps)
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        columns, steps = -(-n // mma.block_n(1)), k // mma.K_STEP
        split = mma.splits(columns, steps, 132, 1)
        per = -(-steps // split)
        assert per >= min_steps and (split - 1) * per < steps
        assert columns * split <= mma.resident_programs(132, 1) or split == 1
        monkeypatch.setattr(mma, "MIN_SPLIT_STEPS", 1)
        one_wave = mma.splits(columns, steps, 132, 1)
        assert split == min(one_wave, steps // min_steps)  # the one-wave split, capped
        monkeypatch.setattr(mma, "MIN_SPLIT_STEPS", min_steps)
    assert mma.splits(48, 2, 132, 1) == 1  # two steps in all (K = 256)


def test_one_row_takes_its_own_tiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """ONE_ROW (the kernel captured, not run): a dense product of one row at its tiles a warp and ring, its
    programs' columns and the descriptor's boxes by it; two rows and routed pairs at REPS and STAGES."""
    launches = CapturedLaunches()
    monkeypatch.setattr(mma, "int4_mma_gemv_kernel", launches)
    monkeypatch.setattr(mma, "AHEAD", False)  # on by default: test_ahead_takes_one_token_tile_by_the_ring
    monkeypatch.setattr(mma, "ONE_ROW", (2, 3))
    n, k = 1536, 1024
    w, s = torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 128, dtype=torch.float16)
    out = torch.zeros(2, n)
    for m in (1, 2):
        mma.launch(torch.zeros(m, k, dtype=torch.bfloat16), w, s, None, None, 128, 8, 1, out[:m], out, out, 0,
                   False, False)  # fmt: skip
    ids = torch.zeros(2, dtype=torch.int32)
    mma.launch(torch.zeros(1, k, dtype=torch.bfloat16), w[None], s[None], None, None, 128, 8, 1, out, out, out, 0,
               False, False, ids=ids)  # fmt: skip
    (grid1, args1, kw1), (grid2, args2, kw2), (_, args3, kw3) = launches.calls
    assert (kw1["REPS"], kw1["STAGES"]) == (2, 3) and grid1[0] == n // 128 and mma.block_n(1) == 128
    assert list(args1[0].block_shape) == [128, 16] and not kw1["PREFETCH"]
    assert (kw2["REPS"], kw2["STAGES"]) == (mma.REPS, mma.STAGES) and grid2[0] == -(-n // (64 * mma.REPS))
    assert (kw3["REPS"], kw3["STAGES"]) == (mma.REPS, mma.STAGES)
    assert mma.block_n(1, routed=True) == 64 * mma.REPS
    assert (args2[0] is None) == (mma.STAGES == 0) and (args3[0] is None) == (mma.STAGES == 0)
    assert mma.resident_programs(132, 1) == 132 * 6  # REPS 2 by registers; the ring (3 x 8 KB) holds more
    # gated: and the activations' 2 x 8 KB; at 8 stages (64 KB) shared memory holds 2 programs an SM, not 3
    monkeypatch.setattr(mma, "ONE_ROW", (2, 8))
    assert mma.resident_programs(132, 1) == 132 * 3 and mma.resident_programs(132, 1, gated=True) == 132 * 2
    assert not kw1["AHEAD"] and not kw2["AHEAD"]


def test_ahead_takes_one_token_tile_by_the_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    """AHEAD (the kernel captured, not run): a launch by the ring at one token tile asks for each step's x (gated:
    gate and up) and scales a step ahead, and plans its split for the fewer programs its registers leave an SM (96 at
    REPS 2: 5, not 6); without the ring, at two token tiles or at 2 steps a slot it does not."""
    launches = CapturedLaunches()
    monkeypatch.setattr(mma, "int4_mma_gemv_kernel", launches)
    monkeypatch.setattr(mma, "AHEAD", True)
    monkeypatch.setattr(mma, "ONE_ROW", (2, 2))
    monkeypatch.setattr(mma, "STAGES", 0)
    n, k = 1536, 1024
    w, s = torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 128, dtype=torch.float16)
    out = torch.zeros(12, n)
    for m in (1, 2):
        mma.launch(torch.zeros(m, k, dtype=torch.bfloat16), w, s, None, None, 128, 8, 1, out[:m], out, out, 0,
                   False, False)  # fmt: skip
    mma.launch(torch.zeros(1, 2 * k, dtype=torch.bfloat16), w, s, None, None, 128, 8, 1, out[:1], out, out, 0,
               False, False, gated=True)  # fmt: skip
    (_, _, one), (_, _, two), (_, _, gated) = launches.calls
    assert one["AHEAD"] and not two["AHEAD"] and gated["AHEAD"] and gated["GATED"]
    assert mma.resident_programs(132, 1) == 132 * 5 and mma.resident_programs(132, 2) == 132 * 3
    monkeypatch.setattr(mma, "STAGES", 2)  # the ring past one row: one token tile to 8 rows, two past
    assert mma.ahead(8) and not mma.ahead(9) and mma.resident_programs(132, 8) == 132 * 3
    monkeypatch.setattr(mma, "STAGE_STEPS", 2)
    assert not mma.ahead(1) and mma.resident_programs(132, 1) == 132 * 4
    monkeypatch.setattr(mma, "AHEAD", False)
    monkeypatch.setattr(mma, "STAGE_STEPS", 1)
    assert mma.resident_programs(132, 1) == 132 * 6


def test_the_routed_launch_reads_each_pairs_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    """moe_wna16's routed GEMV through `launch` (the kernel captured, not run): a program column a pair, one row a
    pair, the experts' strides in words and groups, x's row per pair."""
    launches = CapturedLaunches()
    monkeypatch.setattr(mma, "int4_mma_gemv_kernel", launches)
    calls = launches.calls
    e, n, k, pairs = 16, 1536, 2048, 8
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    w = torch.zeros(e, n, k // 2, dtype=torch.uint8)
    s = torch.zeros(e, n, k // 128, dtype=torch.float16)
    z = torch.zeros(e, n, k // 128, dtype=torch.uint8)
    ids, out = torch.zeros(pairs, dtype=torch.int32), torch.zeros(3, pairs, n)
    odd_rows = torch.zeros(e, n, k // 2 + 8, dtype=torch.uint8)[
        :, :, : k // 2
    ]  # rows not whole 16-byte pieces
    assert mma.fits(x, w, None, 4, 128, routed=True) and not mma.fits(x, odd_rows, None, 4, 128, routed=True)
    mma.launch(x, w, s, z, None, 128, 6, 3, out, out, out, out.stride(0), False, False, ids=ids, x_row_div=8)
    grid, args, kw = calls[0]
    names = ["M", "N", "steps_per_split", "num_steps", "stride_xm", "stride_wn", "stride_sn", "stride_zn",
             "stride_os", "stride_om", "stride_we", "stride_se", "stride_ze"]  # fmt: skip
    got = dict(zip(names, args[10:]))
    assert grid == (-(-n // mma.block_n(1, routed=True)), 3, pairs)
    assert got == {"M": 1, "N": n, "steps_per_split": 6, "num_steps": k // 128, "stride_xm": k // 2,
                   "stride_wn": k // 8, "stride_sn": k // 128, "stride_zn": k // 128, "stride_os": pairs * n,
                   "stride_om": n, "stride_we": n * k // 8, "stride_se": n * k // 128, "stride_ze": n * k // 128}  # fmt: skip
    assert kw["ROUTED"] and kw["X_ROW_DIV"] == 8 and kw["PARTIAL"] and not kw["SERIAL"] and args[9] is ids
    assert args[0] is None and kw["STAGES"] == 0  # no ring: no descriptor
    mma.launch(x, w[0], s[0], None, None, 128, 16, 1, out[0, :1], out, out, 0, False, False)  # dense: one row
    grid, args, kw = calls[1]
    # M 1; stride_we, se, ze 0; row_blocks 1; up_off (GATED's up, in words) K / 2; then norm_row's 5 (placeholders)
    assert grid[2] == 1 and not kw["ROUTED"] and args[10] == 1 and args[-10:-5] == (0, 0, 0, 1, k // 2)
    assert not kw["NORM"] and args[-1] == 0.0


@pytest.mark.parametrize("stage_steps", [1, 2])
@pytest.mark.parametrize("routed", [False, True])
def test_the_ring_reads_the_words_by_one_descriptor(
    routed: bool, stage_steps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STAGES past 0 (the kernel captured, not run): the words' TMA descriptor over int32 [rows, K / 8] (routed:
    the experts' rows one after another, the kernel's rows e N + ...), boxes of a program's columns by
    STAGE_STEPS steps (one load a slot), made once per weight tensor and freed with it; experts not one after another are not
    taken."""
    launches = CapturedLaunches()
    monkeypatch.setattr(mma, "int4_mma_gemv_kernel", launches)
    monkeypatch.setattr(mma, "STAGES", 3)
    monkeypatch.setattr(mma, "ONE_ROW", None)
    monkeypatch.setattr(mma, "STAGE_STEPS", stage_steps)
    e, n, k = 4, 768, 1024
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    w = torch.zeros(e, n, k // 2, dtype=torch.uint8) if routed else torch.zeros(n, k // 2, dtype=torch.uint8)
    s = torch.zeros(*w.shape[:-1], k // 128, dtype=torch.float16)
    ids = torch.zeros(2, dtype=torch.int32) if routed else None
    out = torch.zeros(2, n)
    assert mma.fits(x, w, None, 4, 128, routed=routed)
    for _ in range(2):
        mma.launch(
            x, w, s, None, None, 128, 8, 1, out[:1] if not routed else out, out, out, 0, False, False, ids=ids
        )
    (_, args, kw), (_, again, _) = launches.calls
    desc = args[0]
    assert list(desc.shape) == [e * n if routed else n, k // 8] and list(desc.strides) == [k // 8, 1]
    # boxes of the program's columns by stage_steps steps of 16 words
    assert list(desc.block_shape) == [mma.block_n(1, routed), 16 * stage_steps]
    assert desc.base.dtype == torch.int32
    assert (
        desc.base.data_ptr() == w.data_ptr() and again[0] is desc and kw["STAGES"] == 3 and not kw["PREFETCH"]
    )
    # held by the weight tensor alone: freed with it (a table by address had kept every weight it saw alive)
    import gc
    import weakref

    from longserve.kernels import gluon_gemv

    gone = weakref.ref(desc)
    del desc, args, again, launches.calls[:]
    assert w in gluon_gemv._DESCRIPTORS and torch.zeros_like(w) not in gluon_gemv._DESCRIPTORS
    del w
    gc.collect()
    assert gone() is None
    if routed:  # experts apart (a slice of a larger tensor): the descriptor's rows would not be e N + ...
        apart = torch.zeros(e, n + 16, k // 2, dtype=torch.uint8)[:, :n]
        assert not mma.fits(x, apart, None, 4, 128, routed=True)
        monkeypatch.setattr(mma, "STAGES", 0)
        assert mma.fits(x, apart, None, 4, 128, routed=True)  # loads by address take them


def test_the_gated_launch_reads_gate_and_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """GATED (the kernel captured, not run): x is gate|up [1, 2K], the product's K its half, up K / 2 words after gate;
    one row by the ring only (two rows, routed pairs or no ring: refused)."""
    launches = CapturedLaunches()
    monkeypatch.setattr(mma, "int4_mma_gemv_kernel", launches)
    monkeypatch.setattr(mma, "ONE_ROW", (2, 2))
    n, k = 768, 1024
    w, s = torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 128, dtype=torch.float16)
    gate_up, out = torch.zeros(1, 2 * k, dtype=torch.bfloat16), torch.zeros(1, n)
    mma.launch(gate_up, w, s, None, None, 128, 8, 1, out, out, out, 0, False, False, gated=True)
    grid, args, kw = launches.calls[0]
    names = ["M", "N", "steps_per_split", "num_steps", "stride_xm"]
    assert dict(zip(names, args[10:15])) == {"M": 1, "N": n, "steps_per_split": 8, "num_steps": k // 128,
                                             "stride_xm": k}  # fmt: skip
    # up_off (before norm_row's 5 arguments)
    assert kw["GATED"] and kw["STAGES"] == 2 and args[-6] == k // 2 and grid == (n // mma.block_n(1), 1, 1)
    for bad in (
        {"x": torch.zeros(2, 2 * k, dtype=torch.bfloat16)},
        {"ids": torch.zeros(2, dtype=torch.int32)},
    ):
        with pytest.raises(AssertionError, match="gated: one row"):
            xb = bad.get("x", gate_up)
            wb, sb = (w[None], s[None]) if "ids" in bad else (w, s)
            mma.launch(xb, wb, sb, None, None, 128, 8, 1, out, out, out, 0, False, False, ids=bad.get("ids"),
                       gated=True)  # fmt: skip
    monkeypatch.setattr(mma, "ONE_ROW", (2, 0))  # words in registers: no ring to stage in
    with pytest.raises(AssertionError, match="gated: one row"):
        mma.launch(gate_up, w, s, None, None, 128, 8, 1, out, out, out, 0, False, False, gated=True)


def test_rows_past_16_run_in_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """37 rows (the kernel captured, not run): three programs of 16 rows for each column tile, adjacent along axis 0
    (row_blocks, the kernel's last integer), two token tiles each; the rows' strides in words."""
    launches = CapturedLaunches()
    monkeypatch.setattr(mma, "int4_mma_gemv_kernel", launches)
    calls = launches.calls
    n, k = 1536, 2048
    x = torch.zeros(37, k + 64, dtype=torch.bfloat16)[:, :k]  # rows apart from K: strides, not shapes
    w, s = torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 128, dtype=torch.float16)
    out = torch.zeros(4, 37, n)
    assert mma.fits(x, w, None, 4, 128)
    mma.launch(x, w, s, None, None, 128, 4, 4, out, out, out, out.stride(0), False, False)
    grid, args, kw = calls[0]
    assert grid == (-(-n // mma.block_n(37)) * 3, 4, 1)
    assert (
        args[10] == 37 and args[14] == (k + 64) // 2 and args[19] == n and args[-7] == 3
    )  # M, stride_xm, om, row_blocks (before norm_row's 5)
    assert kw["TOKEN_TILES"] == 2 and kw["PARTIAL"] and not kw["SERIAL"]
