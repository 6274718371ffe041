"""kernels/gemv_tables.py: the decode GEMVs' tuned tiles per (kernel, N, K, M) and GPU are read from JSON, a bad
file is refused with its entry named, the config functions take an entry's tiles only for its exact product
(and only on a CUDA device outside the interpreter); kernels/tune_gemv.py's loop, interpreted at tiny shapes,
returns checked tiles and writes nothing that is not faster than the default."""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from longserve.kernels import fp8_gemv, gemv_tables, moe_config, quant_gemv, tune_gemv  # noqa: E402
from longserve.kernels import split_k as split_k_module  # noqa: E402

CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it


@pytest.fixture
def table_dir(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """Tables under tmp_path for the device name this machine reports ("cpu" without CUDA), read as on a GPU."""
    monkeypatch.setattr(gemv_tables, "TABLE_DIR", tmp_path)
    monkeypatch.setattr(split_k_module, "num_sms", lambda index: 132)  # an H200's, without asking CUDA
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the tables are read outside the interpreter only
    gemv_tables.load_gemv_table.cache_clear()
    yield tmp_path
    gemv_tables.load_gemv_table.cache_clear()


def write(table_dir, kernel: str, entries: dict) -> None:
    name = gemv_tables.gemv_table_name(kernel, moe_config.current_device_name(0))
    (table_dir / name).write_text(json.dumps(entries))
    gemv_tables.load_gemv_table.cache_clear()  # files are read once a process; this one changed


def test_an_entry_sets_the_tiles_of_its_product_only(table_dir) -> None:
    tiles = {"BLOCK_N": 64, "SPLIT_K": 2, "num_warps": 8}
    default = fp8_gemv.fp8_gemv_config(1, 28672, 4096, 128, CUDA, "fp8_block_gemv_bk128")
    assert (default["BLOCK_N"], default["SPLIT_K"], default["num_warps"]) == (64, 3, 4)
    write(table_dir, "fp8_block_gemv_bk128", {"28672,4096,1": tiles})
    got = fp8_gemv.fp8_gemv_config(1, 28672, 4096, 128, CUDA, "fp8_block_gemv_bk128")
    assert got == {**default, **tiles}
    # another M, another N, another kernel, a CPU device: the defaults
    assert fp8_gemv.fp8_gemv_config(2, 28672, 4096, 128, CUDA, "fp8_block_gemv_bk128")["SPLIT_K"] != 2
    assert fp8_gemv.fp8_gemv_config(1, 4096, 4096, 128, CUDA, "fp8_block_gemv_bk128")["num_warps"] == 4
    assert fp8_gemv.fp8_gemv_config(1, 28672, 4096, 128, CUDA, "fp8_channel_gemv")["num_warps"] == 4
    assert (
        fp8_gemv.fp8_gemv_config(1, 28672, 4096, 128, torch.device("cpu"), "fp8_block_gemv_bk128")[
            "num_warps"
        ]
        == 4
    )


def test_a_gpu_without_tables_reads_its_architectures_reference_part(table_dir, monkeypatch) -> None:
    """An H100 (no tables of its own) takes the H200's, an sm90 part's; its own table, once written, wins whole;
    another architecture takes neither."""
    monkeypatch.setattr(moe_config, "current_device_name", lambda index=None: "NVIDIA_H100_80GB_HBM3")
    monkeypatch.setattr(moe_config, "current_capability", lambda index=None: (9, 0))
    tiles = {"BLOCK_N": 128, "SPLIT_K": 2, "num_warps": 8}
    (table_dir / gemv_tables.gemv_table_name("fp8_channel_gemv", "NVIDIA H200")).write_text(
        json.dumps({"4096,4096,1": tiles})
    )
    assert gemv_tables.tuned_gemv_config("fp8_channel_gemv", 4096, 4096, 1, CUDA) == tiles
    assert gemv_tables.tuned_gemv_config("fp8_channel_gemv", 4096, 4096, 2, CUDA) is None  # no entry: default
    monkeypatch.setattr(moe_config, "current_capability", lambda index=None: (10, 0))
    assert gemv_tables.tuned_gemv_config("fp8_channel_gemv", 4096, 4096, 1, CUDA) is None
    monkeypatch.setattr(moe_config, "current_capability", lambda index=None: (9, 0))
    # the H100's own table, without the M=1 entry
    write(table_dir, "fp8_channel_gemv", {"4096,4096,2": tiles})
    assert gemv_tables.tuned_gemv_config("fp8_channel_gemv", 4096, 4096, 1, CUDA) is None
    assert gemv_tables.tuned_gemv_config("fp8_channel_gemv", 4096, 4096, 2, CUDA) == tiles


def test_the_one_row_int4_kernel_reads_its_table(table_dir) -> None:
    """The entry applies where the one-row kernel runs (M = 1, groups of 128), not to the general kernel."""
    write(table_dir, "int4_fast_gemv_bk128", {"4096,14336,1": {"BLOCK_N": 128, "SPLIT_K": 6, "num_warps": 4}})
    cfg = quant_gemv.wna16_gemv_config(1, 4096, 14336, 128, 4, False, torch.bfloat16, CUDA)
    assert (cfg["BLOCK_N"], cfg["SPLIT_K"]) == (128, 6)
    general = quant_gemv.wna16_gemv_config(1, 4096, 14336, 128, 4, True, torch.bfloat16, CUDA)  # act order
    assert general["SPLIT_K"] != 6 or general["BLOCK_N"] != 128


@pytest.mark.parametrize(
    "entries",
    [{"1,2": {"BLOCK_N": 64, "SPLIT_K": 1, "num_warps": 4}}, {"1,2,1": {"BLOCK_N": 64, "SPLIT_K": 1}},
     {"1,2,1": {"BLOCK_N": 64, "SPLIT_K": 0, "num_warps": 4}},
     {"1,2,1": {"BLOCK_N": 64, "SPLIT_K": 1, "num_warps": 4, "BLOCK_K": 64}},
     {"1,2,1": {"BLOCK_N": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 0}}],
)  # fmt: skip
def test_a_bad_table_is_refused_with_its_entry(table_dir, entries) -> None:
    write(table_dir, "fp8_channel_gemv", entries)
    with pytest.raises(ValueError, match="bad entry"):
        fp8_gemv.fp8_gemv_config(1, 1, 2, 128, CUDA, "fp8_channel_gemv")


def test_num_stages_is_an_optional_key(table_dir) -> None:
    tiles = {"BLOCK_N": 128, "SPLIT_K": 8, "num_warps": 4, "num_stages": 3}
    write(table_dir, "dense_gemm", {"2048,4096,1": tiles, "256,2048,1": {**tiles, "num_stages": 4}})
    assert gemv_tables.tuned_gemv_config("dense_gemm", 2048, 4096, 1, CUDA) == tiles


def test_the_dense_candidates_tune_stages_and_stay_within_n() -> None:
    """The dense GEMM's candidates carry num_stages; a one-output weight (the shared expert's gate) gets 64-row
    tiles only, a 256-output one 128 too; splits keep two K tiles of 128 each."""
    one = tune_gemv.candidates("dense", 1, 2048)
    assert one and {c["BLOCK_N"] for c in one} == {64} and {c["num_stages"] for c in one} == {3, 4}
    wide = tune_gemv.candidates("dense", 256, 512)
    assert {c["BLOCK_N"] for c in wide} == {64, 128} and max(c["SPLIT_K"] for c in wide) == 2
    assert all("num_stages" not in c for c in tune_gemv.candidates("fp8_block", 256, 512))


def test_the_dense_tuner_takes_powers_of_two_rows_only() -> None:
    tune_gemv.parse_args(["--kernels", "dense,dense_gated", "--tokens", "1,2,64,128"])
    for kernels, tokens in (("dense", "3"), ("dense", "256"), ("dense_gated", "0"), ("dense_gated", "12")):
        with pytest.raises(SystemExit):
            tune_gemv.parse_args(["--kernels", kernels, "--tokens", tokens])


@pytest.mark.parametrize("kernel", ["int4", "fp8_block", "fp8_channel", "dense"])
def test_the_tuner_checks_each_candidate_and_keeps_only_gains(
    kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Interpreted at N=48, K=512: every candidate's output against the default's (the dense GEMM's: cuBLAS's,
    F.linear), the best returned; with a gain threshold no candidate can meet, no tiles (None) for the shape."""
    tiny = {"BLOCK_N": [16, 64], "SPLIT_K": [1, 2], "num_warps": [4]}
    args = tune_gemv.parse_args(
        ["--shapes", "llama-3.1-8b", "--kernels", kernel, "--iters", "1", "--repeats", "1"]
    )
    args.projections, args.space = {"llama-3.1-8b": {"small": (48, 512)}}, tiny
    assert tune_gemv.candidates(kernel, 48, 512, tiny)
    args.min_gain = 0.99  # a 100x gain: none (None: an older entry of the shape is dropped)
    assert list(tune_gemv.tune(args, device="cpu").values()) == [{"48,512,1": None}]
    calls = []
    real = tune_gemv.tune_kernel
    monkeypatch.setattr(tune_gemv, "tune_kernel", lambda *a: calls.append(a[1]) or real(*a))
    # any candidate (the interpreter times noise, and cuBLAS beats it 1000x): the fastest one is written
    args.min_gain = -1e6
    tables = tune_gemv.tune(args, device="cpu")
    ((name, entries),) = tables.items()
    assert name.startswith({"int4": "int4_fast_gemv", "fp8_block": "fp8_block_gemv", "fp8_channel": "fp8_channel",
                            "dense": "dense_gemm"}[kernel])  # fmt: skip
    assert list(entries) == ["48,512,1"] and entries["48,512,1"] in calls[0]


def test_the_gated_dense_kernel_is_tuned_on_down_projections_against_silu_and_mul() -> None:
    """`dense_gated`: only the MLPs' down projections are tuned, into "dense_gemm_gated", each candidate checked
    against silu_and_mul then F.linear (a wrong input would fail the check)."""
    args = tune_gemv.parse_args(["--kernels", "dense_gated", "--iters", "1", "--repeats", "1"])
    args.shapes, args.min_gain = ["tiny"], -1e6
    args.projections = {"tiny": {"down": (48, 256), "o": (48, 256)}}
    args.space = {"BLOCK_N": [64], "SPLIT_K": [1], "num_warps": [4], "num_stages": [2]}
    assert tune_gemv.tune(args, device="cpu") == {
        "dense_gemm_gated": {"48,256,1": {"BLOCK_N": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}}
    }


def test_a_broken_candidate_stops_the_tuner() -> None:
    """A candidate whose output leaves the default's is a kernel bug, not a slow tile."""
    outs = {None: torch.ones(4), "bad": torch.zeros(4)}
    with pytest.raises(RuntimeError, match="relative error"):
        tune_gemv.tune_kernel(
            lambda cfg: outs[cfg and "bad"], [{"BLOCK_N": 1}], lambda fn, **kw: (fn(), 1.0)[1], 1, 1
        )


def test_the_tuner_times_each_call_on_other_copies_of_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the timed calls cycle over identical copies of the weights holding ROTATE_BYTES in all (read from
    HBM as in a decode step, not from L2); on the CPU one copy."""
    monkeypatch.setattr(tune_gemv, "ROTATE_BYTES", 100)
    w, s = torch.arange(8, dtype=torch.float32), torch.ones(2)  # 40 bytes: three copies hold >= 100
    seen = []
    run = tune_gemv.rotating_weights(
        lambda cfg, w, s: seen.append((w.data_ptr(), w.tolist(), s.tolist())), (w, s), CUDA
    )
    for _ in range(4):
        run(None)
    ptrs = [p for p, _, _ in seen]
    assert ptrs[0] == ptrs[3] == w.data_ptr() and len(set(ptrs[:3])) == 3
    assert all(values == [w.tolist(), s.tolist()] for _, *values in seen)
    cpu_run = tune_gemv.rotating_weights(lambda cfg, w, s: w.data_ptr(), (w, s), torch.device("cpu"))
    assert {cpu_run(None) for _ in range(3)} == {w.data_ptr()}
