"""kernels/tune_moe.py's search under TRITON_INTERPRET=1 at a tiny shape (a smoke test of the loop the GPU runs:
every candidate checked against the reference, the best per batch size returned), bf16, fp8 block and packed
int4 / int8 experts."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402

pytest.importorskip("triton")

from longserve.kernels import tune_moe  # noqa: E402


@pytest.mark.parametrize("weights", [None, "fp8_e4m3", "int4", "int8"])
def test_tune_returns_a_checked_config_per_batch_size(weights, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = {"BLOCK_N": [16, 32], "BLOCK_K": [16, 64], "GROUP_M": [1], "num_warps": [4], "num_stages": [1]}
    monkeypatch.setattr(tune_moe, "SPACES", {"quick": tiny})
    monkeypatch.setattr(tune_moe, "BLOCK_MS", [16])
    # two batch sizes for the 16-bit experts (a config per size), one for each quantized format (its K tiles),
    # which keeps the four interpreted tunings at 26 s of CI rather than 47 (the 2-core machine)
    sizes = "9" if weights else "3,9"
    args = tune_moe.parse_args(
        ["--num-experts", "4", "--top-k", "2", "--hidden", "64", "--intermediate", "32", "--batch-sizes", sizes,
         "--iters", "1", "--repeats", "1", "--fp8-block", "16", "--int-group", "16"]
        + (["--weights", weights] if weights else [])
    )  # fmt: skip
    best = tune_moe.tune(args, device="cpu")
    assert sorted(best) == sizes.split(",")
    for cfg in best.values():
        assert cfg["BLOCK_M"] == 16 and set(cfg["down"]) == {
            "BLOCK_N",
            "BLOCK_K",
            "GROUP_M",
            "num_warps",
            "num_stages",
        }
        if weights:  # K tiles within the 16-wide activation (fp8) or scale (int) groups
            assert cfg["BLOCK_K"] == cfg["down"]["BLOCK_K"] == 16
