"""The 16-bit skinny GEMM (kernels/dense_gemm.py) under TRITON_INTERPRET=1 against F.linear: exact in fp32 (one
split and several, ragged N and K, bias), bf16 rounded once like F.linear's fp32 accumulation, the split-K
partials summed in the GEMV's own programs bit-equal to a reduction launch; and the unquantized linears
routed to it only in the token range it is switched on for, or for the shapes and rows a tuned table holds
(CUDA only: the CPU keeps F.linear)."""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from longserve.kernels import dense_gemm  # noqa: E402
from longserve.kernels import split_k as split_k_module  # noqa: E402
from longserve.kernels.dense_gemm import dense_gemm_config  # noqa: E402


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(("m", "n", "k", "split"), [(3, 40, 96, 1), (16, 64, 256, 3), (20, 72, 200, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_equals_f_linear(m: int, n: int, k: int, split: int, bias: bool) -> None:
    x = torch.randn(m, k, generator=gen(m))
    w = torch.randn(n, k, generator=gen(n))
    b = torch.randn(n, generator=gen(k)) if bias else None
    cfg = {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": split}
    got = dense_gemm.dense_gemm(x, w, b, config=cfg)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_bf16_is_rounded_once_from_fp32_sums() -> None:
    """bf16 operands: the products summed in fp32 and rounded once, as F.linear on the GPU accumulates."""
    m, n, k = 16, 48, 256
    x = torch.randn(m, k, generator=gen(1)).bfloat16()
    w = (torch.randn(n, k, generator=gen(2)) * k**-0.5).bfloat16()
    got = dense_gemm.dense_gemm(x, w, config={"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2})
    want = F.linear(x.float(), w.float()).bfloat16()  # fp32 sums of exact bf16 products, rounded once
    assert got.dtype == torch.bfloat16
    # the sums' order differs (tiles, splits): at most one bf16 step apart
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-6).all()


def test_serial_reduction_equals_the_reduction_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(5, 320, generator=gen(3))
    w = torch.randn(56, 320, generator=gen(4))
    b = torch.randn(56, generator=gen(5))
    cfg = {"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 5}
    monkeypatch.setattr(split_k_module, "SPLIT_K_SERIAL_REDUCE", False)
    two_launches = dense_gemm.dense_gemm(x, w, b, config=cfg)
    monkeypatch.setattr(split_k_module, "SPLIT_K_SERIAL_REDUCE", True)
    monkeypatch.setattr(split_k_module, "_SERIAL_LOCKS", {})
    assert torch.equal(dense_gemm.dense_gemm(x, w, b, config=cfg), two_launches)
    (locks,) = split_k_module._SERIAL_LOCKS.values()
    assert not locks.any()


def test_config_fills_the_chip_with_splits_only_where_tiles_are_few(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a 132-SM GPU (faked): the 8B gate_up (448 column tiles) is not split; o (64 tiles) and down (64 tiles
    over 112 K tiles) are split to ~2 programs an SM; 64 rows take BLOCK_M 64, 5 rows 16 (tl.dot's least)."""
    monkeypatch.setattr(split_k_module, "num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert dense_gemm_config(64, 28672, 4096, cuda)["SPLIT_K"] == 1
    assert dense_gemm_config(64, 4096, 4096, cuda)["SPLIT_K"] == 5
    down = dense_gemm_config(64, 4096, 14336, cuda)
    assert down["SPLIT_K"] == 5 and down["BLOCK_M"] == 64
    assert dense_gemm_config(5, 4096, 4096, cuda)["BLOCK_M"] == 16
    assert dense_gemm_config(64, 4096, 4096, torch.device("cpu"))["SPLIT_K"] == 1


def test_unquantized_linears_take_it_only_in_the_switched_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """UnquantizedLinearMethod.apply: off by default (F.linear); switched on for 16-64 tokens (CUDA faked), a
    batch of 16 goes through dense_gemm with the layer's bias, 8 and 65 do not; fp32 never."""
    from longserve.models import linear_method

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(24, 64, generator=gen(6)).bfloat16(), requires_grad=False)
    bias = torch.randn(24, generator=gen(7)).bfloat16()
    method = linear_method.UnquantizedLinearMethod()
    calls: list[int] = []
    real = dense_gemm.dense_gemm
    monkeypatch.setattr(
        dense_gemm,
        "dense_gemm",
        lambda x, w, b=None, config=None: calls.append(x.shape[0]) or real(x, w, b, config=config),
    )
    monkeypatch.setattr(linear_method, "use_triton", lambda x: True)  # as for CUDA tensors with triton

    def run(m: int, dtype: torch.dtype = torch.bfloat16) -> None:
        x = torch.randn(m, 64, generator=gen(m)).to(dtype)
        got = method.apply(layer.to(dtype), x, bias.to(dtype))
        want = F.linear(x.float(), layer.weight.float(), bias.float())
        assert ((got.float() - want).abs() <= want.abs() * 2**-7 + 1e-2).all()

    for m in (8, 16, 65):
        run(m)
    assert calls == []  # off by default
    monkeypatch.setattr(dense_gemm, "DENSE_GEMM_TRITON_MAX_TOKENS", 64)
    for m in (8, 16, 65):
        run(m)
    run(16, torch.float32)
    assert calls == [16]
    # the method's cheap pre-check stops at the kernel's own limit
    assert linear_method.DENSE_GEMM_MAX_ROWS == dense_gemm.DENSE_GEMM_MAX_BLOCK_M


@pytest.fixture
def tuned_table(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """write(entries, kernel): a table of `kernel` ("dense_gemm", or "dense_gemm_gated" for the down projections
    made from gate|up) as tune_gemv writes it, read by load_gemv_table and looked up as on a GPU
    (gemv_tables.tuned_gemv_config's device and interpreter checks are test_gemv_tables.py's); CUDA faked for the
    linear method's pre-check. Returns the split counts the kernel ran with; `lookups` (an attribute of `write`)
    counts the table's lookups."""
    from longserve.kernels import gemv_tables
    from longserve.models import linear_method

    path = lambda kernel: tmp_path / f"{kernel}.json"  # noqa: E731
    lookups: list[tuple[str, int, int, int]] = []

    def lookup(kernel, n, k, m, device):
        lookups.append((kernel, n, k, m))
        return gemv_tables.load_gemv_table(str(path(kernel))).get((n, k, m))

    monkeypatch.setattr(dense_gemm, "tuned_gemv_config", lookup)
    monkeypatch.setattr(linear_method, "use_triton", lambda x: True)  # as for CUDA tensors with triton
    splits: list[int] = []
    real = dense_gemm.split_k_outputs
    monkeypatch.setattr(dense_gemm, "split_k_outputs", lambda *a: splits.append(a[1]) or real(*a))

    def write(entries: dict, kernel: str = "dense_gemm") -> list[int]:
        path(kernel).write_text(json.dumps(entries))
        gemv_tables.load_gemv_table.cache_clear()
        return splits

    write.lookups = lookups
    yield write
    gemv_tables.load_gemv_table.cache_clear()


def test_a_tuned_table_sends_its_shapes_there_at_decode_batches(tuned_table, monkeypatch) -> None:
    """With DENSE_GEMM_TABLES on (off by default: nothing takes it), a table entry (N=24, K=64 at M=8, 3 splits, as
    tune_gemv writes where the kernel beat cuBLAS) sends that product through dense_gemm with its tiles at 5-8
    rows (M's next power of two), not at 4, 9 or 129 rows nor for another shape, the table read once a product
    (the plan's tiles handed to the kernel); the MoE block's router (plain_linear, not a linear layer's method)
    takes it too; every output equals F.linear's to bf16 rounding."""
    from longserve.models import linear_method, moe_block

    w = torch.randn(24, 64, generator=gen(8)).bfloat16()
    wide = torch.randn(40, 64, generator=gen(9)).bfloat16()
    splits = tuned_table({"24,64,8": {"BLOCK_N": 64, "SPLIT_K": 3, "num_warps": 4, "num_stages": 2}})
    taken: list[tuple[int, int]] = []
    real = dense_gemm.dense_gemm
    monkeypatch.setattr(
        dense_gemm,
        "dense_gemm",
        lambda x, w, b=None, config=None: (
            taken.append((x.shape[0], w.shape[0])) or real(x, w, b, config=config)
        ),
    )

    def run(m: int, w: torch.Tensor) -> None:
        x = torch.randn(m, 64, generator=gen(m)).bfloat16()
        got = linear_method.plain_linear(x, w)
        want = F.linear(x.float(), w.float())
        assert ((got.float() - want).abs() <= want.abs() * 2**-7 + 1e-2).all()

    run(8, w)
    assert taken == []  # off by default
    monkeypatch.setattr(dense_gemm, "DENSE_GEMM_TABLES", True)
    for m in (4, 5, 8, 9, 129):
        run(m, w)
    run(8, wide)
    assert taken == [(5, 24), (8, 24)] and splits == [3, 3]
    # one lookup a product of at most 128 rows (4, 5, 8, 9 rows, then the wide one), none for the kernel's launch
    assert [(n, m) for _, n, _, m in tuned_table.lookups[-5:]] == [
        (24, 4),
        (24, 8),
        (24, 8),
        (24, 16),
        (40, 8),
    ]
    assert len(tuned_table.lookups) == 5
    router = moe_block.ReplicatedLinear(64, 24).bfloat16()
    router.weight.data.copy_(w)
    x = torch.randn(7, 64, generator=gen(10)).bfloat16()
    got = router(x)
    assert taken[-1] == (7, 24)
    assert ((got.float() - F.linear(x.float(), w.float())).abs() <= 2e-2 + got.float().abs() * 2**-7).all()
    # an explicit config wins over the table's
    real(x, w, config={"SPLIT_K": 1})
    assert splits[-1] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "n", "k", "split"), [(1, 40, 96, 1), (3, 64, 256, 3), (16, 72, 200, 2)])
def test_gated_equals_silu_and_mul_then_the_product(m: int, n: int, k: int, split: int, dtype) -> None:
    """GATED: the down projection of gate|up [M, 2K] equals silu_and_mul's product through the same kernel bit for
    bit (one split and several, ragged K, a bias), its silu(gate) * up rounded as activation.silu_and_mul's."""
    from longserve.kernels.activation import silu_and_mul

    gate_up = (torch.randn(m, 2 * k, generator=gen(m + k)) * 2).to(dtype)
    w = (torch.randn(n, k, generator=gen(n)) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=gen(k)).to(dtype)
    cfg = {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": split}
    got = dense_gemm.dense_gemm(gate_up, w, b, config=cfg, gated=True)
    assert torch.equal(got, dense_gemm.dense_gemm(silu_and_mul(gate_up), w, b, config=cfg))
    want = F.linear(silu_and_mul(gate_up).float(), w.float(), b.float())
    assert ((got.float() - want).abs() <= want.abs() * 2**-7 + 1e-3).all()


def test_the_down_projection_takes_the_gated_path_only_in_its_range(tuned_table, monkeypatch) -> None:
    """UnquantizedLinearMethod.apply_gated: off by default (None: the layer runs silu_and_mul, then apply);
    switched on for 1-16 rows (CUDA faked), a batch of 1 and 16 goes through the gated kernel, 17 does not; a
    down projection whose shape the gated table holds (not the plain one's) takes it at the rows it was tuned for
    with its tiles, not at others."""
    from longserve.models import linear_method

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(24, 64, generator=gen(8)).bfloat16(), requires_grad=False)
    method = linear_method.UnquantizedLinearMethod()
    splits = tuned_table({})
    gate_up = {m: torch.randn(m, 128, generator=gen(m)).bfloat16() for m in (1, 16, 17)}
    assert all(method.apply_gated(layer, x, None) is None for x in gate_up.values())  # off by default
    monkeypatch.setattr(dense_gemm, "DENSE_GEMM_GATED_MAX_TOKENS", 16)
    for m in (1, 16):
        got = method.apply_gated(layer, gate_up[m], None)
        assert got is not None and torch.equal(
            got, dense_gemm.dense_gemm(gate_up[m], layer.weight, gated=True)
        )
    assert method.apply_gated(layer, gate_up[17], None) is None
    # the gated table's entry for the down weight [24, 64] at 32 rows: with the tables on, 17 takes it, with its 2
    # splits; the plain product's table does not send the gated one there
    entry = {"24,64,32": {"BLOCK_N": 64, "SPLIT_K": 2, "num_warps": 4}}
    tuned_table(entry, "dense_gemm_gated")
    assert method.apply_gated(layer, gate_up[17], None) is None  # tables off by default
    monkeypatch.setattr(dense_gemm, "DENSE_GEMM_TABLES", True)
    tuned_table({}, "dense_gemm_gated")
    tuned_table(entry, "dense_gemm")
    assert method.apply_gated(layer, gate_up[17], None) is None
    tuned_table(entry, "dense_gemm_gated")
    got = method.apply_gated(layer, gate_up[17], None)
    assert got is not None and splits[-1] == 2
    assert torch.equal(got, dense_gemm.dense_gemm(gate_up[17], layer.weight, gated=True))
    assert method.apply_gated(layer, torch.randn(33, 128, generator=gen(9)).bfloat16(), None) is None
