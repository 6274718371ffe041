"""scripts/dev/http_table.py: issue 19's HTTP verdict from `compare_vllm_http.sh` records (TTFT P50 / P95 ratios
a workload, the random workload's throughput, ITL stalls), on made-up records and on a committed call."""

from __future__ import annotations

import importlib.util
import json
import lzma
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("http_table", ROOT / "scripts/dev/http_table.py")
http_table = importlib.util.module_from_spec(SPEC)
sys.modules["http_table"] = http_table  # its dataclasses look their module up
SPEC.loader.exec_module(http_table)


def run(name: str, p50: float, p95: float, itls: list[float], out_tok_s: float = 700.0) -> dict:
    """A `bench compare` run as results.json holds it (seconds)."""
    stats = {"mean": p50, "median": p50, "p95": p95}
    return {
        "name": name,
        "summary": {
            "ttft": stats,
            "itl": {"mean": 0.008, "median": 0.007, "p95": 0.03},
            "request_throughput": 7.5,
            "output_throughput": out_tok_s,
        },
        "requests": [{"success": True, "itl": itls}, {"success": False, "itl": [9.0]}],
    }


def write(folder: Path, workload: str, ours: dict, vllm: dict, xz: bool = False) -> None:
    (folder / workload).mkdir(parents=True, exist_ok=True)
    text = json.dumps({"metadata": {}, "runs": [ours, vllm]})
    if xz:
        (folder / workload / "results.json.xz").write_bytes(lzma.compress(text.encode()))
    else:
        (folder / workload / "results.json").write_text(text)


def test_ratios_and_verdict(tmp_path):
    call = tmp_path / "2026-12-07_abc1234_http"
    stalls = [0.007, 0.007, 0.035, 0.007]  # one of four >= 20 ms; the failed request's ITL is not counted
    write(call, "rag", run("longserve", 0.025, 0.5, stalls), run("vllm", 0.1, 0.55, stalls), xz=True)
    write(
        call, "random", run("longserve", 0.06, 0.12, stalls, 690.0), run("vllm", 0.06, 0.125, stalls, 700.0)
    )
    write(call, "longdoc", run("longserve", 1.3, 3.6, stalls), run("vllm", 1.29, 3.5, stalls))
    rows = {r.workload: r for r in http_table.read_folder(str(call))}
    assert set(rows) == {"rag", "random", "longdoc"}
    assert abs(rows["rag"].p50 - 0.25) < 1e-9 and abs(rows["rag"].p95 - 0.5 / 0.55) < 1e-9
    assert rows["rag"].ours.stalled == 0.25 and rows["rag"].met
    # TTFT equal at P50 meets it; 690 out tok/s against 700 is below (more than 0.5%)
    assert rows["random"].p50 == 1.0 and not rows["random"].met
    assert not rows["longdoc"].met  # P50 1.3 against 1.29
    verdict = http_table.verdict(list(rows.values()))
    assert verdict == "missed: random, long documents (no record: multi-turn)"


def test_cli_on_the_committed_call():
    """The forty-fourth session's H100 call: all four met, as RESULTS.md says; the ratios as its table gives them."""
    call = ROOT / "benchmarks/results/2026-12-07_e9cb362_tests_http_hit_tail/http"
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/dev/http_table.py"), str(call)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "issue 19 through HTTP: all met" in out.stdout
    rows = {r.workload: r for r in http_table.read_folder(str(call))}
    assert round(rows["random"].p95, 3) == round(120.7 / 124.2, 3)
    assert (
        round(rows["multiturn"].ours.ttft_p95, 1) == 2809.4
        and round(rows["multiturn"].vllm.ttft_p95, 1) == 2991.2
    )


def test_no_records_exits_1(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/dev/http_table.py"), str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and "no workload's results.json" in out.stdout
