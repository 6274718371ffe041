"""The tree that travels to the GPU machine stays under the device's 64 MiB copy cap with the vLLM anchor carried.

The device tool copies the working tree together with what a call carries, under 64 MiB, and `gpu_check.sh vllm` and
`compare_vllm_http.sh` carry the vLLM anchor (43.6 MB, `.anchor/`) and cuDNN's frontend wheel (1.8 MB). In the
ninth session raw benchmark records had grown the tree to 23 MB and the vLLM comparison could not be sent; records
over 4 KB are kept compressed since (xz from the nineteenth session; benchmarks/RESULTS.md).

The device counts more than the files' bytes: in the thirty-ninth session the call was refused with 19.5 MiB of
tracked bytes and 44.3 MiB carried (63.8 MiB), and it passed with benchmarks/results/ (1,794 small files, 9.4 MB)
moved out of the checkout. So each file is charged here as a whole number of 4 KB blocks (~68 MiB at that tree with
the anchor, over the cap), and the anchor calls move benchmarks/results/ aside (RESULTS.md's next calls say so): the test
checks the tree that then travels, and that every other call's tree fits with room to spare."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CAP = 64 << 20  # the device's copy of tree + carried paths
BLOCK = (
    4096  # a file's charge, rounded up: the refused call above is over the cap only when files cost this much
)
# ../shared/anchors/vllm-0.24.0-h200-site.tar.xz (43,567,464 bytes) and its three scripts (~17 KB), carried as
# .anchor/ with cuDNN's frontend wheel beside them (1,828,281 bytes since the thirty-fifth session: longserve's
# packed graphs in the vLLM modes) and, since the forty-seventh session, compressed-tensors' and loguru's wheels
# (260,637 + 61,595 bytes: vLLM's Qwen3-Next imports them, `hybrid-vllm`), plus 1 MiB for the untracked files that
# travel with the tree.
ANCHOR = 43_600_000 + 1_828_281 + 260_637 + 61_595 + (1 << 20)
RECORDS = "benchmarks/results/"  # moved aside for the anchor calls
WHEELS = (
    20 << 20
)  # .whl/ (the quantization libraries, fastapi, ... for `tests` and `quant-bench`): 16.5 MB today


def charged(sizes: list[int]) -> int:
    return sum(-(-size // BLOCK) * BLOCK for size in sizes)


def tracked_sizes(exclude: str | None = None) -> list[int]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    names = [n for n in out.decode().split("\0") if n and not (exclude and n.startswith(exclude))]
    return [(ROOT / n).stat().st_size for n in names if (ROOT / n).is_file()]


needs_git = pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout"
)


@needs_git
def test_the_tree_without_the_records_leaves_room_for_the_vllm_anchor() -> None:
    size = charged(tracked_sizes(exclude=RECORDS))
    assert size + ANCHOR < CAP, (
        f"tracked files outside {RECORDS} take {size / 2**20:.1f} MiB: with the vLLM anchor ({ANCHOR / 2**20:.1f} "
        f"MiB) over the device's {CAP >> 20} MiB copy cap"
    )


@needs_git
def test_the_whole_tree_leaves_room_for_the_test_wheels() -> None:
    size = charged(tracked_sizes())
    assert size + WHEELS < CAP, (
        f"tracked files take {size / 2**20:.1f} MiB: with the test wheels ({WHEELS / 2**20:.0f} MiB) over the "
        f"device's {CAP >> 20} MiB copy cap; compress raw benchmark records with xz (results.json.xz, logs)"
    )


def test_the_block_charge_rounds_each_file_up() -> None:
    assert charged([1, BLOCK, BLOCK + 1, 0]) == 4 * BLOCK
