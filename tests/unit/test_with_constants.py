"""scripts/probes/with_constants.py: a module run with tuning constants changed (how a switch is measured
before it is flipped), and a clear exit for a constant that does not exist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "probes" / "with_constants.py"


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "show_switch.py").write_text(
        "import sys\nfrom longserve.kernels import quant_gemm\n"
        "print('switch', quant_gemm.WNA16_GEMV_MAX_TOKENS, 'argv', sys.argv[1:])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_the_target_runs_with_the_constant_set(tmp_path):
    # 7: not the default (16), so that only the script's setting can print it
    done = run(
        tmp_path, "longserve.kernels.quant_gemm.WNA16_GEMV_MAX_TOKENS=7", "--", "show_switch", "--x", "1"
    )
    assert done.returncode == 0, done.stderr
    assert "switch 7 argv ['--x', '1']" in done.stdout


def test_an_unknown_constant_is_refused(tmp_path):
    done = run(tmp_path, "longserve.kernels.quant_gemm.NO_SUCH_SWITCH=1", "--", "show_switch")
    assert done.returncode != 0 and "has no NO_SUCH_SWITCH" in done.stderr
