"""scripts/dev/clocks_by_case.py: each `bench latency` case's SM clock and power from a mode's clocks.csv and its
latency logs (a case's window opens at its "running" line and closes at the next one or the floors' lines; idle
samples left out)."""

from __future__ import annotations

import lzma
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADER = "timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], temperature.gpu\n"


def sample(t: str, mhz: int, watts: float) -> str:
    return f"2026/12/06 {t}.100, {mhz} MHz, 2619 MHz, {watts:.2f} W, 60\n"


def test_each_case_gets_the_clock_of_its_window(tmp_path: Path) -> None:
    clocks = [sample("20:00:00", 1980, 90.0)]  # idle, before
    clocks += [sample(f"20:00:0{i}", 1400 + 10 * i, 690.0) for i in range(1, 5)]  # cold-8192: 1410..1440
    clocks += [sample("20:00:05", 1980, 120.0)]  # idle between: left out
    clocks += [sample(f"20:00:0{i}", 1700, 680.0) for i in range(6, 9)]  # cold-32768
    clocks += ["2026/12/06 20:00:09.000, [N/A]\n"]  # a line nvidia-smi cut short
    with lzma.open(tmp_path / "clocks.csv.xz", "wt") as f:
        f.write(HEADER + "".join(clocks))
    (tmp_path / "latency_8b_int4.log").write_text(
        "INFO loading\n"
        "[bench latency 20:00:01] cold-8192: running (1 warm-up + 2 timed)\n"
        "[bench latency 20:00:06] cold-32768: running (1 warm-up + 2 timed)\n"
        "[bench latency 20:00:09] cold-8192: floor 0.17 s (compute-bound)\n"
        "[bench latency 20:00:09] wrote 2 records to out.json\n"
    )
    done = subprocess.run(
        [sys.executable, "scripts/dev/clocks_by_case.py", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].split()[:3] == ["8b_int4", "cold-8192", "4"] and "SM   1425 MHz" in lines[0]
    assert (
        lines[1].split()[:3] == ["8b_int4", "cold-32768", "3"]
        and "SM   1700 MHz" in lines[1]
        and "680 W" in lines[1]
    )
