"""The tracked tree stays small enough for the GPU machine: the device tool copies the working tree together with
what a call carries under a 64 MiB cap, and `gpu_check.sh vllm` carries the vLLM anchor (43.6 MB, `.anchor/`, and
cuDNN's frontend wheel, 1.8 MB).
In the ninth session raw benchmark records had grown the tree to 23 MB and the vLLM comparison could not be
sent; bench compare's results.json files over 100 KB are kept compressed since (xz from the nineteenth session;
benchmarks/RESULTS.md)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CAP = 64 << 20  # the device's copy of tree + carried paths
# ../shared/anchors/vllm-0.24.0-h200-site.tar.xz (43,567,464 bytes) and its three scripts (~17 KB), carried as
# .anchor/ with cuDNN's frontend wheel beside them (1,828,281 bytes since the thirty-fifth session: longserve's
# packed graphs in the vLLM modes), plus 1 MiB for the untracked files that travel with the tree. (Until the
# nineteenth session this was 44 MiB: the anchor's 43.6 MB taken as MiB, 2.5 MB more than it is.)
ANCHOR = 43_600_000 + 1_828_281 + (1 << 20)


def tracked_bytes() -> int:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return sum(
        (ROOT / name).stat().st_size for name in out.decode().split("\0") if name and (ROOT / name).is_file()
    )


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_the_tracked_tree_leaves_room_for_the_vllm_anchor() -> None:
    size = tracked_bytes()
    assert size + ANCHOR < CAP, (
        f"tracked files hold {size / 2**20:.1f} MiB: with the vLLM anchor ({ANCHOR / 2**20:.1f} MiB) over the device's "
        f"{CAP >> 20} MiB copy cap; compress raw benchmark records with xz (results.json.xz, logs)"
    )
