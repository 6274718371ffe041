"""scripts/dev/vllm_table.py: issue 19's ratios from a `gpu_check.sh vllm` folder (our `bench latency` JSON, vLLM's
scripts' logs), medians on both sides, and the calls over time as a table and a PNG."""

from __future__ import annotations

import importlib.util
import json
import lzma
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("vllm_table", ROOT / "scripts/dev/vllm_table.py")
vllm_table = importlib.util.module_from_spec(SPEC)
sys.modules["vllm_table"] = vllm_table  # its dataclass looks its module up
SPEC.loader.exec_module(vllm_table)


def ours(name: str, **fields: object) -> dict:
    return {"name": name, "metadata": {"date": "2026-12-06T22:29:46+00:00"}, **fields}


def prefill(name: str, wall: float, cached: int = 0) -> str:
    return json.dumps({"kind": "result", "name": name, "wall_s": wall, "num_cached_tokens": cached})


def write_call(folder: Path, scale: float = 1.0, date: str = "2026-12-06T22:29:46+00:00") -> Path:
    """A call's records: ours at `scale` x the figures below, vLLM's as its scripts print them."""
    folder.mkdir(parents=True)
    records = [
        ours("cold-8192", ttft_s=0.19 * scale),
        ours("cold-32768", ttft_s=1.2 * scale),
        ours("cold-131072", ttft_s=10.0 * scale),
        ours("prefix-32768:64", ttft_s=0.012 * scale, speedup=101.0),
        ours("prefix-32768:1024", ttft_s=0.06 * scale),
        ours("decode-b1-c32768", itl_ms_median=7.6 * scale),
        ours("decode-b16-c8192", itl_ms_median=12.0 * scale),
    ]
    records[0]["metadata"]["date"] = date
    with lzma.open(folder / "latency_8b_vs_vllm.json.xz", "wt") as f:  # as committed: xz
        json.dump(records, f)
    (folder / "gpu.txt").write_text("NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04\n")
    (folder / "vllm_prefill.log").write_text(
        "INFO 12-06 [core.py] init engine\n"
        + "\n".join(
            [
                prefill("cold_prefill_8192", 0.21),
                prefill("cold_prefill_8192", 0.20),
                prefill("cold_prefill_8192", 0.25),  # median 0.21
                prefill("cold_prefill_32768", 1.25),
                prefill("cold_prefill_131071", 10.0),
                prefill("cold_prefill_131071", 10.4),  # median 10.2
                prefill("prefix_hit_32768+64", 1.24),  # the fill: no prefix cached, not a hit
                prefill("prefix_hit_32768+64", 0.10, cached=32768),
                prefill("prefix_hit_32768+64", 0.12, cached=32768),
            ]
        )
        + '\n{"kind": "result", "name": "cut by the console\n'
    )
    (folder / "vllm_decode.log").write_text(
        '{"engine": "vllm-0.24.0", "case": "decode_itl", "batch": 1, "context": 32768, "itl_ms": 8.0}\n'
    )
    (folder / "vllm_extra.log").write_text(
        '{"engine": "vllm-0.24.0", "case": "prefix_hit", "cached": 32768, "new": 1024, "wall_s": 0.11, '
        '"runs_s": [0.13, 0.11, 0.12]}\n'
        '{"engine": "vllm-0.24.0", "case": "decode_itl", "batch": 16, "context": 8192, "itl_ms": 12.5}\n'
        '{"engine": "vllm-0.24.0", "case": "decode_itl", "batch": 1, "context": 32768, "itl_ms": 8.1}\n'
    )
    return folder


def test_each_case_is_a_ratio_of_medians(tmp_path: Path) -> None:
    cells = vllm_table.read_folder(str(write_call(tmp_path / "2026-12-06_abc1234_vllm")))
    assert cells["cold8k"].vllm == pytest.approx(0.21) and cells["cold8k"].ratio == pytest.approx(0.19 / 0.21)
    assert cells["cold128k"].vllm == pytest.approx(10.2)  # 131,071 tokens on vLLM's side
    assert cells["hit64"].vllm == pytest.approx(0.11)  # the two runs that found the prefix, not the fill
    assert cells["hit64"].speedup == 101.0
    assert cells["hit1024"].vllm == pytest.approx(0.12)  # the median of the runs, not the best
    assert cells["b1"].vllm == 8.0 and cells["b1"].bracket == 8.1  # the anchor's, the extra cases' beside
    assert cells["b16"].vllm == 12.5 and cells["b16"].bracket is None  # the extra cases' alone
    assert cells["cold64k"].ratio is None and cells["b64"].ratio is None  # not run: shown as such
    table = vllm_table.table(cells)
    assert "| cold 8K | 0.1900 s | 0.2100 s | 0.905 | <= 0.95 met |" in table
    assert "| cold 32K | 1.2000 s | 1.2500 s | 0.960 | <= 0.95 missed |" in table
    assert "| decode b1@32K | 7.600 ms | 8.000 ms (8.100) | 0.950 | <= 0.95 met |" in table
    assert "12.00 ms, 101.0x its cold" in table and ">= 100x cold: met" in table
    assert "| cold 64K | - | - | - | (shown) |" in table


def test_a_committed_call_gives_what_results_md_says() -> None:
    """The forty-second session's H100 call, whose table RESULTS.md worked out by hand."""
    folder = ROOT / "benchmarks/results/2026-12-06_a01eadb_lone_long_tests_vllm/vllm"
    cells = vllm_table.read_folder(str(folder))
    assert round(cells["cold8k"].ratio, 3) == 0.934
    assert round(cells["cold32k"].ratio, 4) == 0.9503
    assert round(cells["cold128k"].ratio, 3) == 0.974
    assert round(cells["b1"].ratio, 3) == 0.952 and round(cells["b64"].ratio, 3) == 0.978
    assert round(cells["hit64"].speedup, 1) == 96.4
    assert vllm_table.label(str(folder)) == "12-06 a01eadb H100"


def test_several_calls_in_the_order_they_ran_and_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    late = write_call(tmp_path / "2026-12-06_aaaaaaa_vllm", scale=0.9, date="2026-12-06T23:00:00+00:00")
    early = write_call(tmp_path / "2026-12-06_bbbbbbb_vllm", scale=1.0, date="2026-12-06T01:00:00+00:00")
    (tmp_path / "2026-12-06_ccccccc_other").mkdir()  # no vllm records: skipped, said on stderr
    png = tmp_path / "ratios.png"
    done = subprocess.run(
        [sys.executable, "scripts/dev/vllm_table.py", str(late), str(early), str(tmp_path / "2026-12-06_ccccccc_other"),
         "--png", str(png)],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 12-06")]
    assert [r.split(" | ")[0] for r in rows] == ["| 12-06 bbbbbbb H100", "| 12-06 aaaaaaa H100"]
    assert rows[0].split(" | ")[1] == "0.905" and rows[1].split(" | ")[1] == f"{0.9 * 0.19 / 0.21:.3f}"
    assert "skipped: no latency_8b_vs_vllm.json" in done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
