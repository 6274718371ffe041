"""The decode-size W4A16/W8A16 GEMV (kernels/quant_gemv.py) under TRITON_INTERPRET=1 against its torch reference
(quant_reference.wna16_gemm_ref) at small shapes: M = 1, 3, 16 (FMA and tl.dot paths), 4 and 8 bits, groups of
32 / 128 / all of K, zero points on and off, act order (g_idx), split-K with its fixed-order reduction, bias,
K not a multiple of the tile; its selection behind quant_gemm.WNA16_GEMV_MAX_TOKENS; and its compilation for
sm90 by Triton's real compiler (no GPU needed: the nvidia backend and ptxas ship with triton)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from longserve.kernels import quant_gemm, quant_gemv  # noqa: E402
from longserve.kernels import split_k as split_k_module  # noqa: E402
from longserve.kernels.quant_gemv import wna16_gemv, wna16_gemv_config  # noqa: E402
from longserve.kernels.quant_reference import pack_int_k, wna16_gemm_ref  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def int_weights(n: int, k: int, bits: int, group: int, zp: bool, act_order: bool, seed: int):
    g = gen(seed)
    groups = -(-k // group) if group > 0 else 1
    qweight = pack_int_k(torch.randint(0, 2**bits, (n, k), generator=g), bits)
    scales = (torch.rand(n, groups, generator=g) * 0.02 + 0.001).half()
    zeros = torch.randint(0, 2**bits, (n, groups), generator=g).to(torch.uint8) if zp else None
    g_idx = (torch.randperm(k, generator=g) // (group if group > 0 else k)).int() if act_order else None
    return qweight, scales, zeros, g_idx


CASES = [  # bits, group, zero points, act order, split-K
    (4, 32, False, False, 1),
    (4, 128, False, False, 2),
    (4, 128, True, False, 3),
    (4, -1, True, False, 2),
    (4, 32, True, True, 2),
    (8, 32, True, False, 1),
    (8, 128, False, True, 2),
    (8, -1, False, False, 4),
]


def assert_within_one_ulp(out: torch.Tensor, target: torch.Tensor, slack: float = 1e-3) -> None:
    """bf16 `out` within one bf16 ulp of `target` (float64), plus `slack` for float32 summation order."""
    t = target.double()
    ulp = torch.exp2(torch.floor(torch.log2(t.abs().clamp(min=1e-30))) - 7)
    err = (out.double() - t).abs()
    assert bool((err <= ulp + slack).all()), f"max error {float((err - ulp).max()):.3g} over one ulp"


def check(out, x, qweight, scales, zeros, g_idx, bits, group, bias, weights_rounded: bool) -> None:
    """float32: equal to the reference to float32 rounding. bf16: the GEMV multiplies the exact q - z and
    scales fp32 partial sums, so it is compared with the exact product of the fp32 dequantized weights (the
    reference rounds each weight to bf16 first: ~0.1 off where 8-bit sums cancel), within one ulp; where the
    GEMV rounds the weights itself (tl.dot with per-element scales) with the reference, within one ulp; and
    with the reference in norm as the GPU tests do."""
    from longserve.kernels.quant_reference import dequantize_wna16

    ref = wna16_gemm_ref(x, qweight, scales, zeros, g_idx, bits, group, bias)
    assert out.dtype == x.dtype and out.shape == ref.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        return
    w = dequantize_wna16(qweight, scales, zeros, g_idx, bits, group)
    if weights_rounded:
        w = w.to(x.dtype)
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    assert_within_one_ulp(out, exact)
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


@pytest.mark.parametrize(("bits", "group", "zp", "act_order", "split_k"), CASES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_equals_reference(bits, group, zp, act_order, split_k, m, dtype) -> None:
    n, k = 48, 256  # N not a multiple of BLOCK_N
    qweight, scales, zeros, g_idx = int_weights(n, k, bits, group, zp, act_order, seed=bits * 10 + split_k)
    x = torch.randn(m, k, generator=gen(m)).to(dtype)
    bias = torch.randn(n, generator=gen(2)).to(dtype) if split_k != 1 or m == 3 else None
    out = wna16_gemv(x, qweight, scales, zeros, g_idx, bits, group, bias, config={"SPLIT_K": split_k})
    cfg = wna16_gemv_config(m, n, k, group, bits, act_order, dtype, x.device)
    check(
        out,
        x,
        qweight,
        scales,
        zeros,
        g_idx,
        bits,
        group,
        bias,
        bool(cfg["USE_DOT"] and cfg["SCALE_PER_COL"]),
    )


@pytest.mark.parametrize("use_dot", [0, 1])
def test_both_product_paths_and_the_per_element_path(use_dot: int) -> None:
    """M = 16 in bf16 through the FMA path and the tl.dot path; a plain grouped weight through the
    per-element (act-order) path too; the same products whichever way."""
    m, n, k, bits, group = 16, 40, 256, 4, 64
    qweight, scales, zeros, _ = int_weights(n, k, bits, group, True, False, seed=5)
    x = torch.randn(m, k, generator=gen(6)).to(torch.bfloat16)
    for per_col in (0, 1):
        cfg = {"USE_DOT": use_dot, "BLOCK_M": 16, "SCALE_PER_COL": per_col, "BLOCK_K": 64, "BLOCK_N": 16,
               "SPLIT_K": 2}  # fmt: skip
        out = wna16_gemv(x, qweight, scales, zeros, None, bits, group, config=cfg)
        check(out, x, qweight, scales, zeros, None, bits, group, None, bool(use_dot and per_col))


@pytest.mark.parametrize("raw_hi", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("group", "zp", "split_k", "bias"), [(128, False, 1, True), (32, True, 3, False), (-1, True, 2, True)]
)
def test_the_int4_fast_path_equals_the_general_kernel_and_the_reference(
    group, zp, split_k, bias, dtype, raw_hi, monkeypatch
) -> None:
    """One row of 4-bit weights (kernels/int4_gemv.py: words unpacked in place, the zero point out of the inner
    loop) against the reference and against the general kernel (INT4_FAST_PATH off); it is the path taken.
    INT4_GEMV_RAW_HI (16-bit activations only: fp32 keeps the exact loop and its 1e-5) changes neither."""
    from longserve.kernels import int4_gemv

    monkeypatch.setattr(int4_gemv, "INT4_GEMV_RAW_HI", raw_hi)
    monkeypatch.setattr(quant_gemv, "INT4_FAST_PATH", True)
    n, k = 40, 256
    qweight, scales, zeros, _ = int_weights(n, k, 4, group, zp, False, seed=group + split_k)
    x = torch.randn(1, k, generator=gen(12)).to(dtype)
    b = torch.randn(n, generator=gen(13)).to(dtype) if bias else None
    cfg = {"SPLIT_K": split_k, "BLOCK_N": 16, "BLOCK_K": 32}
    calls = []
    real = int4_gemv.int4_fast_supported
    monkeypatch.setattr(quant_gemv, "int4_fast_supported", lambda *a: calls.append(real(*a)) or real(*a))
    fast = wna16_gemv(x, qweight, scales, zeros, None, 4, group, b, config=cfg)
    assert calls and all(calls)  # the config and the launch both take the fast path
    check(fast, x, qweight, scales, zeros, None, 4, group, b, False)
    monkeypatch.setattr(quant_gemv, "INT4_FAST_PATH", False)
    general = wna16_gemv(x, qweight, scales, zeros, None, 4, group, b, config=cfg)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(fast.float(), general.float(), atol=tol, rtol=tol)


def test_the_unmasked_high_value_is_corrected_and_below_bf16_rounding(monkeypatch) -> None:
    """INT4_GEMV_RAW_HI reads each pair's high value with the low one's bits below it: 17152 / 2^16 (exact) times
    the high positions' sum is taken off, and what is left (q_lo / 2^16 per product) stays far below a bf16
    output's rounding. Split-K's fp32 partial sums show it unrounded: without the correction they move by
    ~2e-2, with it by < 1e-4 of the largest."""
    from longserve.kernels import int4_gemv

    monkeypatch.setattr(split_k_module, "SPLIT_K_SERIAL_REDUCE", False)  # the partials splitk_reduce is given
    n, k = 48, 512
    qweight, scales, _, _ = int_weights(n, k, 4, 128, False, False, seed=21)
    x = torch.randn(1, k, generator=gen(22)).to(torch.bfloat16)
    cfg = {"SPLIT_K": 2, "BLOCK_N": 16, "BLOCK_K": 128}
    partials = []
    real = split_k_module.splitk_reduce
    monkeypatch.setattr(
        split_k_module, "splitk_reduce", lambda part, *a: partials.append(part.clone()) or real(part, *a)
    )

    def run(raw_hi: bool, low_bits=int4_gemv._LOW_BITS_AS_HIGH) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(int4_gemv, "INT4_GEMV_RAW_HI", raw_hi)
        monkeypatch.setattr(int4_gemv, "_LOW_BITS_AS_HIGH", low_bits)
        out = wna16_gemv(x, qweight, scales, None, None, 4, 128, config=cfg)
        return out, partials[-1]

    exact_out, exact = run(False)
    raw_out, raw = run(True)
    _, uncorrected = run(True, low_bits=0.0)
    scale = exact.abs().max()
    assert (raw - exact).abs().max() < 1e-4 * scale and not torch.equal(raw, exact)  # the raw loop ran
    assert (uncorrected - exact).abs().max() > 1e-3 * scale
    ulp = exact_out.float().abs() * 2**-7  # one bf16 ulp (or more) of each output
    assert ((raw_out.float() - exact_out.float()).abs() <= ulp).all()


def test_k_not_a_multiple_of_the_tile_and_fp32_exactness() -> None:
    """K = 96 with a per-channel group: tiles of 32 and 16 over ragged splits, and the per-element path's tile of
    64 past the end of K (masked); float32 activations equal the float64 product of the dequantized weights to
    float32 rounding."""
    from longserve.kernels.quant_reference import dequantize_wna16

    m, n, k, bits = 2, 24, 96, 4
    qweight, scales, zeros, _ = int_weights(n, k, bits, -1, True, False, seed=7)
    x = torch.randn(m, k, generator=gen(8))
    exact = (x.double() @ dequantize_wna16(qweight, scales, zeros, None, bits, -1).double().T).float()
    for cfg in (
        {"BLOCK_K": 32, "SPLIT_K": 2},
        {"BLOCK_K": 16, "SPLIT_K": 4},
        {"SCALE_PER_COL": 1, "BLOCK_K": 64, "SPLIT_K": 1},
        {"SCALE_PER_COL": 1, "BLOCK_K": 64, "SPLIT_K": 2},
    ):
        out = wna16_gemv(x, qweight, scales, zeros, None, bits, -1, config=cfg)
        torch.testing.assert_close(out, exact, atol=1e-5, rtol=1e-5)


def test_split_k_is_deterministic_and_has_no_empty_split() -> None:
    m, n, k = 1, 64, 512
    w = int_weights(n, k, 4, 128, False, False, seed=9)
    x = torch.randn(m, k, generator=gen(10)).to(torch.bfloat16)
    cfg = {"SPLIT_K": 3, "BLOCK_K": 128}  # 4 tiles over 3 splits: 2 tiles per split, so 2 splits
    a = wna16_gemv(x, *w, 4, 128, config=cfg)
    assert torch.equal(a, wna16_gemv(x, *w, 4, 128, config=cfg))


@pytest.mark.parametrize("kernel", ["general", "int4_fast", "fp8_block", "fp8_channel"])
@pytest.mark.parametrize("splits", [4, 10])
def test_serial_split_k_reduction_is_bit_equal_and_leaves_the_counters_zero(
    kernel, splits, monkeypatch
) -> None:
    """SPLIT_K_SERIAL_REDUCE: each column tile's last split sums the partials (+ bias) in split order inside the
    GEMV; the output equals the GEMV + splitk_reduce path bit for bit, no reduction kernel runs, and every counter
    is back at zero for the next launch (ragged N: the last tile half full). fp32 activations and outputs: a sum
    in another order shows. 10 splits: the sum's loads 4 planes at a time (quant_tiles.sum_loads), two whole turns
    and a turn of 2."""
    from longserve.kernels import fp8_gemv
    from longserve.kernels.quant_fp8 import per_token_group_quant

    m = 1 if kernel == "int4_fast" else 3
    n, k = 80, 128 * splits
    x = torch.randn(m, k, generator=gen(21))
    bias = torch.randn(n, generator=gen(22))
    cfg = {"SPLIT_K": splits, "BLOCK_N": 32}
    if kernel in ("general", "int4_fast"):
        w = int_weights(n, k, 4, 128, kernel == "general", False, seed=23)
        cfg["BLOCK_N"] = 64 if kernel == "int4_fast" else 32  # the one-row kernel's smallest tile
        run = lambda: wna16_gemv(x, *w, 4, 128, bias=bias, config=cfg)  # noqa: E731
    else:
        w = torch.randn(n, k, generator=gen(24)).to(torch.float8_e4m3fn)
        if kernel == "fp8_block":
            scale = torch.rand(-(-n // 128), k // 128, generator=gen(25)) + 0.01
            run = lambda: fp8_gemv.fp8_block_gemv(x, w, scale, (128, 128), bias=bias, config=cfg)  # noqa: E731
        else:
            xq, xs = per_token_group_quant(x, 0)
            scale = torch.rand(n, generator=gen(26)) + 0.01
            run = lambda: fp8_gemv.fp8_channel_gemv(xq, xs, w, scale, torch.float32, bias, cfg)  # noqa: E731
    monkeypatch.setattr(split_k_module, "SPLIT_K_SERIAL_REDUCE", False)
    two_launches = run()
    monkeypatch.setattr(split_k_module, "SPLIT_K_SERIAL_REDUCE", True)
    # a small table: its whole content is checked below
    monkeypatch.setattr(split_k_module, "SERIAL_LOCKS", 8)
    monkeypatch.setattr(split_k_module, "_SERIAL_LOCKS", {})
    reduced = []
    real = split_k_module.splitk_reduce
    monkeypatch.setattr(split_k_module, "splitk_reduce", lambda *a: reduced.append(1) or real(*a))
    for _ in range(2):  # the second launch finds the counters the first left
        assert torch.equal(run(), two_launches)
    assert not reduced
    (locks,) = split_k_module._SERIAL_LOCKS.values()
    assert locks.shape == (8,) and not locks.any()


def test_serial_reduction_only_up_to_its_row_limit(monkeypatch) -> None:
    """split_k.SERIAL_REDUCE_MAX_ROWS: a split GEMV of more rows sums its partials in the reduction launch (at
    64 rows the serial sums measured slower on an H200), fewer rows in the GEMV; the same result either way."""
    m_max = split_k_module.SERIAL_REDUCE_MAX_ROWS
    n, k = 48, 512
    w = int_weights(n, k, 4, 128, True, False, seed=31)
    cfg = {"SPLIT_K": 4, "BLOCK_N": 16}
    reduced = []
    real = split_k_module.splitk_reduce
    monkeypatch.setattr(split_k_module, "splitk_reduce", lambda *a: reduced.append(a[0].shape[1]) or real(*a))
    monkeypatch.setattr(split_k_module, "_SERIAL_LOCKS", {})
    for m in (m_max, m_max + 1):
        x = torch.randn(m, k, generator=gen(32))
        monkeypatch.setattr(split_k_module, "SPLIT_K_SERIAL_REDUCE", True)
        got = wna16_gemv(x, *w, 4, 128, config=cfg)
        monkeypatch.setattr(split_k_module, "SPLIT_K_SERIAL_REDUCE", False)
        assert torch.equal(got, wna16_gemv(x, *w, 4, 128, config=cfg))
    # the reference runs launch the reduction at both sizes; the serial setting only above the limit
    assert reduced == [m_max, m_max + 1, m_max + 1]


def test_config_fills_the_gpu_at_decode_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an H200 (132 SMs) the default grid has ~4 programs per SM or more at the Llama-3.1-8B shapes (at one
    row, kernels/int4_gemv.py's larger row blocks: 2 or more)."""
    monkeypatch.setattr(split_k_module, "num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        for m in (1, 4, 16):
            cfg = wna16_gemv_config(m, n, k, 128, 4, False, torch.bfloat16, cuda)
            programs = -(-n // cfg["BLOCK_N"]) * cfg["SPLIT_K"]
            assert programs >= (2 if m == 1 else 4) * 132, (n, k, m, cfg)
            assert 128 % cfg["BLOCK_K"] == 0 and cfg["BLOCK_M"] >= m
            assert cfg["USE_DOT"] == int(m > quant_gemv.WNA16_GEMV_FMA_MAX_TOKENS)


def test_the_switch_routes_decode_sizes_to_the_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = quant_gemm.wna16_gemv
    monkeypatch.setattr(
        quant_gemm, "wna16_gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw)
    )
    w = int_weights(32, 128, 4, 32, True, False, seed=11)
    monkeypatch.setattr(quant_gemm, "WNA16_GEMV_MAX_TOKENS", 4)
    for m in (1, 4, 5):
        x = torch.randn(m, 128, generator=gen(m))
        out = quant_gemm.wna16_gemm(x, *w, 4, 32)
        torch.testing.assert_close(out, wna16_gemm_ref(x, *w, 4, 32), atol=1e-5, rtol=1e-5)
    assert calls == [1, 4]


def _nvidia_compiler_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def _gluon_builds_int4_mma() -> bool:
    try:
        from longserve.kernels import int4_mma_gemv
    except ImportError:  # a Triton without Gluon
        return False
    return int4_mma_gemv.supported()


@pytest.mark.skipif(not _nvidia_compiler_available(), reason="triton's nvidia backend is not installed")
def test_gemv_compiles_for_sm90() -> None:
    """Every kind of variant (FMA and tl.dot paths, 4/8 bits, zero points, act order, bias, ragged K, the
    split-K reduction; the block-FP8 GEMV's) through Triton's real compiler for sm90 down to cubin (in a subprocess: the interpreter
    is on here), without spills; the decode case loads the packed weights with 16-byte vectors. Constructs the
    interpreter accepts and the compiler refuses (several returns of different types in a helper, Python
    control flow on tensors, non-constexpr aranges) fail here."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, str(root / "scripts" / "dev" / "compile_quant_gemv.py")], capture_output=True,
                          text=True, env=env, timeout=600)  # fmt: skip
    if proc.returncode != 0 and "ptxas" in proc.stderr:  # no usable ptxas here: the MLIR stages ran
        pytest.skip(f"ptxas unavailable: {proc.stderr[-500:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(reports) >= 14
    for r in reports:
        assert "cubin" in r["stages"], r
        assert r.get("local", 0) == 0 and r.get("stack", 0) == 0, r  # no spills
    assert reports[0]["variant"] == {} and reports[0]["ld_v4"]
    fp8 = [
        r for r in reports if r["variant"].get("fp8")
    ]  # kernels/fp8_gemv.py: e4m3 bytes as 16-byte vectors
    assert len(fp8) >= 5 and all(r["ld_v4"] for r in fp8), fp8
    int4 = [r for r in reports if r["variant"].get("int4")]  # kernels/int4_gemv.py: words as 16-byte vectors
    assert len(int4) >= 2 and all(r["ld_v4"] for r in int4), int4
    # kernels/int4_mma_gemv.py (Gluon, where this Triton builds it; its layout assertion ran): words and x as
    # 16-byte vectors, 8 mma.sync a 16-column tile and 8 for the sums of x (each token tile), nothing spilled; with
    # STAGES the words by TMA
    mma = [r for r in reports if r["variant"].get("mma")]
    if _gluon_builds_int4_mma():
        one_tile = [r for r in mma if r["variant"].get("token_tiles", 1) == 1]
        assert len(mma) == 16 and all(r["regs"] <= 168 for r in one_tile), mma
        assert all(r["ld_v4"] for r in mma if not r["variant"].get("gated")), (
            mma
        )  # GATED: x from shared memory
        assert [r["tma"] for r in mma] == [bool(r["variant"].get("stages")) for r in mma]  # the ring's words
        assert [r["mma_sync"] for r in mma] == [
            8
            * (r["variant"].get("reps", 4) + 1)
            * r["variant"].get("token_tiles", 1)
            * r["variant"].get("unroll", 1)
            * r["variant"].get("stage_steps", 1)  # the ring's steps a slot, unrolled
            for r in mma
        ]
    # kernels/fp8_wgmma_gemv.py (Gluon): the weights by TMA, 8 wgmma a block (two m64 halves x 4 k32), fp8 x fp8
    wgmma = [r for r in reports if r["variant"].get("fp8_wgmma")]
    if _gluon_builds_int4_mma():
        assert len(wgmma) == 10 and all(r["tma"] and r["wgmma"] == 8 for r in wgmma), wgmma
    # the int4 GEMVs' L2 prefetch, 2 tiles: the one-row kernel's before its PDL wait (int4_gemv.INT4_GEMV_PREFETCH:
    # a prefetch a tile row, 2 rows a thread), the mma kernel's also 2 steps ahead in its loop
    # (int4_mma_gemv.PREFETCH: a prefetch a 16-byte piece of A's rows g and g + 8, REPS 4); none where not asked
    asked = [r for r in reports if r["variant"].get("prefetch")]
    assert len(asked) >= 3 and all(r["prefetch"] > 0 for r in asked), asked
    assert all(r["prefetch"] == 0 for r in reports if not r["variant"].get("prefetch"))
    if _gluon_builds_int4_mma():
        # before the wait, 2 steps x 2 rows x REPS 4; in the loop 2 x 4 (not routed), in the loop alone (routed)
        assert [r["prefetch"] for r in asked if r["variant"].get("mma")] == [24, 8], asked
    # programmatic dependent launch (kernels/launch.py PDL): griddepcontrol in the PTX exactly where asked
    assert sum(bool(r["variant"].get("pdl")) for r in reports) >= 5
    assert all(r["pdl"] is bool(r["variant"].get("pdl")) for r in reports)
    # the split-K partials summed in the GEMV (split_k_module.SPLIT_K_SERIAL_REDUCE): the counter's atomic where asked
    # (and the norm in the epilogue's, gluon_gemv.norm_row, with one split)
    assert sum(bool(r["variant"].get("serial")) for r in reports) >= 3
    assert all(
        r["serial"] is bool(r["variant"].get("serial") or r["variant"].get("norm")) for r in reports
    ), [(r["variant"], r["serial"]) for r in reports]
