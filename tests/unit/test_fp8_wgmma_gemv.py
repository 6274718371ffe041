"""The FP8 GEMV on the tensor cores (kernels/fp8_wgmma_gemv.py, Gluon; block and per-channel scales) on the CPU: the products it takes, its
split counts, and its launch (the kernel captured, not run: grid, the TMA descriptor's box, the arguments). Its sm90
builds (TMA, 8 wgmma a block, no spills): tests/unit/test_quant_gemv.py::test_gemv_compiles_for_sm90. On an H200:
tests/gpu/test_fp8_wgmma_gemv_gpu.py."""

from __future__ import annotations

import pytest
import torch

wg = pytest.importorskip("longserve.kernels.fp8_wgmma_gemv")
from longserve.kernels import split_k as split_k_module  # noqa: E402
from longserve.testing.kernel_compile import CapturedLaunches  # noqa: E402


def _weights(n: int, k: int):
    return torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.ones(-(-n // 128), k // 128)


def test_the_products_it_takes() -> None:
    w, s = _weights(6144, 4096)
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    assert wg.fits(x, w, s, (128, 128))
    assert wg.fits(torch.zeros(32, 4096, dtype=torch.bfloat16), w, s, (128, 128))
    assert not wg.fits(torch.zeros(33, 4096, dtype=torch.bfloat16), w, s, (128, 128))  # wgmma's N: 8 to 32
    assert not wg.fits(x.half(), w, s, (128, 128))  # bf16 activations
    assert not wg.fits(x, w, s, (64, 128))  # a program's rows are one scale block
    assert not wg.fits(x, w, s[:, :16], (128, 128))  # scales of other blocks
    assert not wg.fits(x, w.view(torch.uint8), s, (128, 128))
    wide = torch.zeros(6144, 4096 + 8, dtype=torch.float8_e4m3fn)[:, :4096]  # rows not whole 16-byte pieces
    assert not wg.fits(x, wide, s, (128, 128))
    assert not wg.fits(x[:, :4000], w[:, :4000], s, (128, 128))  # K not whole blocks
    assert [wg.block_t(m) for m in (1, 8, 9, 16, 17, 32)] == [8, 8, 16, 16, 32, 32]


@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 16, 32])
@pytest.mark.parametrize("stages", [2, 4])
def test_splits_keep_one_wave(n: int, k: int, m: int, stages: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the 8B projections on 132 SMs: every program resident at once (or one split), no split empty; the programs
    an SM holds by shared memory (the tiles and the activation slots in 227 KB) and registers (MIN_SPLIT_BLOCKS 1:
    the wave alone; test_splits_of_at_least_min_blocks caps it)."""
    monkeypatch.setattr(wg, "STAGES", stages)
    monkeypatch.setattr(wg, "MIN_SPLIT_BLOCKS", 1)
    tiles, blocks = -(-n // 128), k // 128
    split, resident = wg.splits(tiles, blocks, 132, m), wg.resident_programs(132, m)
    # 2 stages: 6 an SM to 16 rows, 3 at 32 (their registers); 4 stages: 3
    assert resident == {2: 792 if m <= 16 else 396, 4: 396}[stages]
    per = -(-blocks // split)
    assert 1 <= split <= blocks and (split - 1) * per < blocks
    assert tiles * split <= resident or split == 1
    if per > 1:
        assert tiles * -(-blocks // (per - 1)) > resident


@pytest.mark.parametrize("min_blocks", [2, 4])
def test_splits_of_at_least_min_blocks(min_blocks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """MIN_SPLIT_BLOCKS: every split of at least that many blocks (the last one's remainder aside), the one-wave
    split capped at blocks // min_blocks."""
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        tiles, blocks = -(-n // 128), k // 128
        monkeypatch.setattr(wg, "MIN_SPLIT_BLOCKS", 1)
        wave = wg.splits(tiles, blocks, 132, 1)
        monkeypatch.setattr(wg, "MIN_SPLIT_BLOCKS", min_blocks)
        split = wg.splits(tiles, blocks, 132, 1)
        assert -(-blocks // split) >= min_blocks and split <= min(wave, blocks // min_blocks)
        assert split == wave or split > blocks // (2 * min_blocks)  # capped, not lower than the cap needs


def test_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """One launch captured: a program per 128 weight rows and split, the descriptor over the whole weight in boxes of
    128 x 128 (made once per weight), BLOCK_T from the rows, the strides."""
    launches = CapturedLaunches()
    monkeypatch.setattr(wg, "fp8_wgmma_gemv_kernel", launches)
    monkeypatch.setattr(wg, "AHEAD", False)  # on by default: set below
    calls = launches.calls
    n, k, m = 6144 + 64, 4096, 12
    w, s = _weights(n, k)
    x = torch.zeros(m, k + 64, dtype=torch.bfloat16)[:, :k]
    out = torch.zeros(4, m, n)
    wg.launch(x, None, w, s, None, 8, 4, out, out, out, out.stride(0), False, False, 32)
    wg.launch(x, None, w, s, None, 8, 4, out, out, out, out.stride(0), False, False, 32)
    (grid, args, kw), (_, args2, _) = calls
    assert grid == (49, 4, 1)
    desc = args[0]
    assert desc is args2[0] and list(desc.block_shape) == [128, 128] and list(desc.shape) == [n, k]
    names = ["M", "N", "blocks_per_split", "num_blocks", "stride_xm", "stride_sn", "stride_os", "stride_om"]
    assert dict(zip(names, args[9:])) == {"M": m, "N": n, "blocks_per_split": 8, "num_blocks": 32,
                                          "stride_xm": k + 64, "stride_sn": 32, "stride_os": m * n, "stride_om": n}  # fmt: skip
    assert kw["BLOCK_T"] == 16 and kw["PARTIAL"] and not kw["SERIAL"] and kw["IMPRECISE_ACC"] == 32
    assert not kw["PER_CHANNEL"] and args[1] is x and args[2] is s  # block scales: no activation scales read
    # per channel: the e4m3 activations as bytes, their scales, a scale per row
    xq, xs, ws = torch.zeros(3, k, dtype=torch.float8_e4m3fn), torch.ones(3), torch.ones(n)
    assert (
        wg.fits_channel(xq, w, ws)
        and not wg.fits_channel(xq, w, ws[:-1])
        and not wg.fits(xq, w, s, (128, 128))
    )
    wg.launch(xq, xs, w, ws, None, 32, 1, out[0, :3], out, out, 0, False, False, 32)
    grid, args, kw = calls[2]
    assert grid == (49, 1, 1) and kw["PER_CHANNEL"] and kw["BLOCK_T"] == 8 and not kw["PARTIAL"]
    assert args[1].dtype == torch.uint8 and args[2] is xs and args[3] is ws and args[14] == 0  # stride_sn
    assert not any(kw["AHEAD"] for _, _, kw in calls)
    # AHEAD: block FP8 at BLOCK_T 8 (up to 8 rows) only
    monkeypatch.setattr(wg, "AHEAD", True)
    for rows in (1, 8, 9):
        wg.launch(x[:rows], None, w, s, None, 8, 4, out, out, out, out.stride(0), False, False, 32)
    wg.launch(xq, xs, w, ws, None, 32, 1, out[0, :3], out, out, 0, False, False, 32)
    assert [kw["AHEAD"] for _, _, kw in calls[3:]] == [True, True, False, False]


def test_the_gated_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The down projection of gate|up (GATED, kernel captured): x the whole gate|up rows, K the weights' (num_blocks
    from w, not from x), the split for the gated build's residency (86 registers at 16 rows: 5 programs an SM, not
    6); a routed or per-channel product is not gated."""
    launches = CapturedLaunches()
    monkeypatch.setattr(wg, "fp8_wgmma_gemv_kernel", launches)
    monkeypatch.setattr(split_k_module, "num_sms", lambda index: 132)
    n, k, m = 4096, 14336, 16
    w, s = _weights(n, k)
    gate_up = torch.zeros(m, 2 * k, dtype=torch.bfloat16)
    assert wg.fits(gate_up[:, :k], w, s, (128, 128))  # as quant_fp8 asks it
    wg.gemv(gate_up, None, w, s, None, torch.bfloat16, 32, gated=True)
    grid, args, kw = launches.calls[0]
    assert (
        kw["GATED"] and args[1] is gate_up and args[12] == k // 128 and args[13] == 2 * k
    )  # num_blocks, stride_xm
    assert wg.resident_programs(132, m, gated=True) == 5 * 132 and wg.resident_programs(132, m) == 6 * 132
    assert (
        grid[1] == wg.splits(n // 128, k // 128, 132, m, gated=True) != wg.splits(n // 128, k // 128, 132, m)
    )
    with pytest.raises(AssertionError):  # gate|up of another width
        wg.gemv(gate_up[:, :k], None, w, s, None, torch.bfloat16, 32, gated=True)
    wg.gemv(gate_up[:, :k], None, w, s, None, torch.bfloat16, 32)
    assert not launches.calls[1][2]["GATED"]


def test_block_fp8_down_projection_takes_the_gated_kernel_when_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """quant_fp8.fp8_block_linear(gated=True) on CUDA: gate|up straight to the wgmma GEMV under FP8_WGMMA_GATED,
    else silu_and_mul's output (the GEMV stand-in records what it was given; is_cuda faked on the CPU tensor)."""
    from longserve.kernels import quant_fp8

    seen = []
    monkeypatch.setattr(wg, "gemv", lambda x, *a, gated=False: seen.append((x, gated)) or torch.zeros(1))
    monkeypatch.setattr(wg, "supported", lambda: True)
    monkeypatch.setattr(quant_fp8, "silu_and_mul", lambda x: x[:, : x.shape[1] // 2] * 2)

    class Cuda(torch.Tensor):
        is_cuda = True

    w, s = _weights(4096, 14336)
    gate_up = torch.zeros(1, 2 * 14336, dtype=torch.bfloat16).as_subclass(Cuda)
    for on in (False, True):
        monkeypatch.setattr(quant_fp8, "FP8_WGMMA_GATED", on)
        quant_fp8.fp8_block_linear(gate_up, w, s, (128, 128), None, gated=True)
    (x_off, gated_off), (x_on, gated_on) = seen
    assert not gated_off and x_off.shape == (1, 14336)  # silu_and_mul's
    assert gated_on and x_on is gate_up


def test_the_routed_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """MoE decode (kernel captured): a program column a (token, k) pair, one row each, the descriptor over the experts
    as [E x N, K] rows, the scales' expert stride, x's row per pair (X_ROW_DIV)."""
    launches = CapturedLaunches()
    monkeypatch.setattr(wg, "fp8_wgmma_gemv_kernel", launches)
    calls = launches.calls
    e, n, k, pairs = 16, 1536, 2048, 8
    w = torch.zeros(e, n, k, dtype=torch.float8_e4m3fn)
    s = torch.ones(e, n // 128, k // 128)
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    ids = torch.zeros(pairs, dtype=torch.int32)
    assert wg.fits_routed(x, w, s, (128, 128)) and not wg.fits_routed(x, w, s[:, :-1], (128, 128))
    strided = w.transpose(1, 2).contiguous().transpose(1, 2)  # not one descriptor over [E x N, K] rows
    assert not wg.fits_routed(x, strided, s, (128, 128))
    monkeypatch.setattr(split_k_module, "num_sms", lambda index: 132)
    out = wg.routed_gemv(x, w, s, ids, 8, 32)
    grid, args, kw = calls[0]
    split = grid[1]
    assert grid == (n // 128, split, pairs) and 1 <= split <= k // 128
    assert (n // 128) * split * pairs <= wg.resident_programs(132, 1)
    assert list(args[0].shape) == [e * n, k] and args[8] is ids and args[9] == 1 and args[10] == n
    assert args[14] == k // 128 and args[17] == s.stride(0)  # stride_sn, stride_se
    assert kw["ROUTED"] and kw["X_ROW_DIV"] == 8 and kw["BLOCK_T"] == 8 and not kw["SERIAL"]
    assert out.shape == ((split, pairs, n) if split > 1 else (pairs, n))
