"""The GPU scripts agree with themselves and with the package before a device call spends minutes on them: every
mode gpu_check.sh lists has a block in scripts/gpu/modes/ and every block is listed, a mode's blocks lie in one
file, queue.sh's time estimates name listed modes, every tuning constant a mode sets through
with_constants.py (`longserve.pkg.mod.NAME=...`) is assigned at the top level of that module (a renamed switch
would otherwise stop the call at its first run), every script parses, and every Python script they run exists."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "scripts" / "gpu"


def _scripts() -> dict[Path, str]:
    return {
        p: p.read_text()
        for p in [GPU / "gpu_check.sh", GPU / "queue.sh", *sorted((GPU / "modes").glob("*.sh"))]
    }


def test_every_listed_mode_has_a_block_and_every_block_is_listed() -> None:
    texts = _scripts()
    listed = set(re.search(r'MODES="([^"]*)"', texts[GPU / "gpu_check.sh"], re.S).group(1).split())
    blocks = {m for text in texts.values() for m in re.findall(r"\$MODE == ([A-Za-z0-9_-]+)", text)}
    assert listed - blocks == set(), "listed in gpu_check.sh's MODES, no `$MODE == ...` block"
    assert blocks - listed == set(), "a block for a mode gpu_check.sh refuses (not in MODES)"
    estimated = set(re.findall(r"\[([a-z0-9-]+)\]=\d+", texts[GPU / "queue.sh"]))
    assert estimated - listed == set(), "queue.sh estimates a mode gpu_check.sh does not list"


def test_each_modes_blocks_lie_in_one_file() -> None:
    """gpu_check.sh sources scripts/gpu/modes/*.sh in name order: a mode with blocks in two files (`all` runs the
    tests block, then bench's) would run them in an order a renamed file could change."""
    files: dict[str, set[str]] = {}
    for path in sorted((GPU / "modes").glob("*.sh")):
        for mode in re.findall(r"\$MODE == ([A-Za-z0-9_-]+)", path.read_text()):
            files.setdefault(mode, set()).add(path.name)
    assert {mode: names for mode, names in files.items() if len(names) > 1} == {}


def test_the_constants_the_modes_set_exist() -> None:
    targets = {
        m.group(1)
        for text in _scripts().values()
        # a constant's name (upper case, maybe one leading _): set in place or through a shell variable
        for m in re.finditer(r"\b(longserve(?:\.[a-z_0-9]+)+\._?[A-Z][A-Z_0-9]*)\b", text)
    }
    assert len(targets) >= 20  # the modes' switches (a regex gone wrong would find none)
    missing = []
    for target in sorted(targets):
        module, _, name = target.rpartition(".")
        path = REPO / Path(*module.split("."))
        source = path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py"
        if not source.exists() or not re.search(
            rf"^{re.escape(name)}\s*(:[^=\n]*)?=", source.read_text(), re.M
        ):
            missing.append(target)
    assert missing == [], "set by a gpu_check mode, not assigned at the top of its module"


def test_the_int4_ncu_summary_reads_ncus_csv(tmp_path: Path) -> None:
    """scripts/probes/int4_ncu.py --summary on a table in ncu's `--csv --page details` layout (its own lines first):
    per kernel the details it names in order, then the stall reasons largest first; other sections' rows left out."""
    import sys

    sys.path.insert(0, str(REPO / "scripts" / "probes"))
    import int4_ncu

    head = '"ID","Process ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
    rows = [
        ("0", "int4_mma_gemv_kernel", "GPU Speed Of Light Throughput", "Duration", "us", "24.10"),
        ("0", "int4_mma_gemv_kernel", "GPU Speed Of Light Throughput", "DRAM Throughput", "%", "58.2"),
        (
            "0",
            "int4_mma_gemv_kernel",
            "Command line profiler metrics",
            "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
            "",
            "0.40",
        ),  # fmt: skip
        (
            "0",
            "int4_mma_gemv_kernel",
            "Command line profiler metrics",
            "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
            "",
            "2,310.5",
        ),  # fmt: skip
        ("0", "int4_mma_gemv_kernel", "Launch Statistics", "Grid Size", "", "672"),
        ("1", "_splitk_reduce_kernel", "GPU Speed Of Light Throughput", "Duration", "us", "2.05"),
    ]
    csv_text = "==PROF== Connected to process 1\n" + head
    csv_text += "".join(",".join(f'"{v}"' for v in (r[0], "1", *r[1:])) + "\n" for r in rows)
    (tmp_path / "ncu.csv").write_text(csv_text)
    lines = int4_ncu.summary(str(tmp_path / "ncu.csv")).splitlines()
    assert lines[:4] == ["[0] int4_mma_gemv_kernel", "    Duration: 24.10 us", "    DRAM Throughput: 58.2 %",
                         "    stalls per issue: long_scoreboard 2,310.5, barrier 0.40"]  # fmt: skip
    assert lines[4:] == ["[1] _splitk_reduce_kernel", "    Duration: 2.05 us"] and "Grid" not in "".join(
        lines
    )


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_every_shell_script_parses() -> None:
    """`bash -n` on each: a quote left open (an apostrophe inside "${x:-...}" once) fails the whole device call."""
    scripts = sorted((REPO / "scripts").rglob("*.sh")) + [REPO / ".ci" / "run"]
    assert len(scripts) >= 10
    bad = {}
    for path in scripts:
        done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        if done.returncode:
            bad[str(path.relative_to(REPO))] = done.stderr.strip()
    assert bad == {}


def test_the_python_scripts_the_gpu_scripts_run_exist() -> None:
    texts = [p.read_text() for p in sorted((REPO / "scripts").rglob("*.sh"))]
    named = {
        m for text in texts for m in re.findall(r"python3? (?:-u )?((?:scripts|\.anchor)/[\w./-]+\.py)", text)
    }
    ours = {n for n in named if n.startswith("scripts/")}
    assert len(ours) >= 10  # a regex gone wrong would find none
    assert sorted(n for n in ours if not (REPO / n).exists()) == []
