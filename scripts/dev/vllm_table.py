"""Issue 19's side by side from `gpu_check.sh vllm` records: longserve's `bench latency` JSON against vLLM 0.24's
own scripts' logs (the anchor's bench_vllm.py and vllm_decode.py, and scripts/gpu/vllm_extra_cases.py), as the
ratio longserve / vLLM a case, beside the issue's target.

Both sides' figures are medians of their runs: ours as `bench latency` records them; vLLM's cold prompts over
bench_vllm.py's runs of a length (131,071 tokens for 128K), its prefix hit over the runs that found the prefix
cached, its 32K + 1024 over the extra cases' runs; its decodes are vllm_decode.py's (the extra cases' own b1 and
b64 in brackets, b16@8K only there). The prefix hit's target is ours against our own cold prompt of the same
length (>= 100x), beside the ratio to vLLM.

One folder prints the Markdown table; several print one row of ratios a folder (the calls over time), and
`--png` draws them, a line a case, the targets dashed (matplotlib, the bench extra):

    python scripts/dev/vllm_table.py benchmarks/results/2026-12-06_d36ecc7_lone_granule_hit_tail_vllm/vllm_fused_tail32
    python scripts/dev/vllm_table.py benchmarks/results/*_vllm benchmarks/results/*/vllm* --png /tmp/vllm_ratios.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass

from longserve.bench.records import call_name, find_record, open_record

# (key, label, ours' record name, target ratio or None)
CASES = [
    ("cold8k", "cold 8K", "cold-8192", 0.95),
    ("cold32k", "cold 32K", "cold-32768", 0.95),
    ("cold64k", "cold 64K", "cold-65536", None),
    ("cold128k", "cold 128K", "cold-131072", 1.00),
    ("hit64", "32K cached + 64 new", "prefix-32768:64", None),
    ("hit1024", "32K cached + 1024 new", "prefix-32768:1024", None),
    ("b1", "decode b1@32K", "decode-b1-c32768", 0.95),
    ("b64", "decode b64@4K", "decode-b64-c4096", 0.95),
    ("b16", "decode b16@8K", "decode-b16-c8192", None),
]
VLLM_COLD = {"cold8k": 8192, "cold32k": 32768, "cold64k": 65536, "cold128k": 131071}
DECODES = {"b1": (1, 32768), "b64": (64, 4096), "b16": (16, 8192)}
HIT_TARGET = 100.0  # the prefix hit against our own cold prompt


@dataclass
class Cell:
    ours: float | None  # seconds (prompts) or ms (decodes)
    vllm: float | None
    bracket: float | None = None  # the extra cases' own figure for a decode vLLM's anchor also ran
    speedup: float | None = None  # the hit against our cold prompt

    @property
    def ratio(self) -> float | None:
        return self.ours / self.vllm if self.ours and self.vllm else None


def _json_lines(folder: str, name: str) -> list[dict]:
    try:
        path = find_record(folder, name)
    except FileNotFoundError:
        return []
    out = []
    with open_record(path, errors="replace") as f:
        for line in f:
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by a tool's width (the mode's console copies)
    return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def read_folder(folder: str) -> dict[str, Cell]:
    with open_record(find_record(folder, "latency_8b_vs_vllm.json")) as f:
        ours = {r["name"]: r for r in json.load(f)}
    prefill = [r for r in _json_lines(folder, "vllm_prefill.log") if r.get("kind") == "result"]
    extra = [r for r in _json_lines(folder, "vllm_extra.log") if r.get("engine")]
    anchor_decode = [r for r in _json_lines(folder, "vllm_decode.log") if r.get("case") == "decode_itl"]

    def extra_case(case: str, **match: int) -> dict | None:
        return next(
            (r for r in extra if r["case"] == case and all(r.get(k) == v for k, v in match.items())), None
        )

    cells: dict[str, Cell] = {}
    for key, _, name, _ in CASES:
        rec = ours.get(name, {})
        mine = rec.get("itl_ms_median") if key in DECODES else rec.get("ttft_s")
        cell = Cell(mine, None, speedup=rec.get("speedup"))
        if key in VLLM_COLD:
            n = VLLM_COLD[key]
            cell.vllm = _median([r["wall_s"] for r in prefill if r["name"] == f"cold_prefill_{n}"])
        elif key == "hit64":
            hits = [
                r for r in prefill if r["name"] == "prefix_hit_32768+64" and r.get("num_cached_tokens", 0) > 0
            ]
            cell.vllm = _median([r["wall_s"] for r in hits])
        elif key == "hit1024":
            r = extra_case("prefix_hit", cached=32768, new=1024)
            cell.vllm = _median(r.get("runs_s") or [r["wall_s"]]) if r else None
        else:
            batch, context = DECODES[key]
            own = extra_case("decode_itl", batch=batch, context=context)
            anchor = next((r for r in anchor_decode if (r["batch"], r["context"]) == (batch, context)), None)
            cell.vllm = (anchor or own or {}).get("itl_ms")
            cell.bracket = own["itl_ms"] if anchor and own else None
        cells[key] = cell
    return cells


def label(folder: str) -> str:
    """'date commit device' from a record folder's name (or its parent's) and gpu.txt."""
    try:
        with open(os.path.join(folder, "gpu.txt")) as f:
            gpu = f.readline().split(",")[0].replace("NVIDIA ", "").split(" 80GB")[0]
    except OSError:
        gpu = "?"
    return f"{call_name(folder)} {gpu}"


def _fmt(x: float | None, key: str) -> str:
    if x is None:
        return "-"
    if key in DECODES:
        return f"{x:.3f} ms"
    return f"{x * 1e3:.2f} ms" if key.startswith("hit") else f"{x:.4f} s"


def table(cells: dict[str, Cell]) -> str:
    rows = ["| case | longserve | vLLM 0.24 | longserve / vLLM | target |", "|---|---|---|---|---|"]
    for key, text, _, target in CASES:
        c = cells[key]
        vllm = _fmt(c.vllm, key) + (f" ({c.bracket:.3f})" if c.bracket else "")
        ratio = f"{c.ratio:.3f}" if c.ratio else "-"
        if key == "hit64":
            ours = _fmt(c.ours, key) + (f", {c.speedup:.1f}x its cold" if c.speedup else "")
            goal = f">= {HIT_TARGET:.0f}x cold: " + ("met" if (c.speedup or 0) >= HIT_TARGET else "missed")
        else:
            ours = _fmt(c.ours, key)
            goal = "(shown)" if target is None or c.ratio is None else (
                f"<= {target:.2f} " + ("met" if c.ratio <= target else "missed")
            )  # fmt: skip
        rows.append(f"| {text} | {ours} | {vllm} | {ratio} | {goal} |")
    return "\n".join(rows)


def _when(folder: str) -> str:
    """When our half ran (its records' ISO date), for the calls' order within a day."""
    with open_record(find_record(folder, "latency_8b_vs_vllm.json")) as f:
        return json.load(f)[0].get("metadata", {}).get("date", "")


def history(folders: list[str]) -> list[tuple[str, dict[str, Cell]]]:
    """The folders that hold a vllm mode's records, in the order they ran (others named on stderr, skipped)."""
    kept = []
    for folder in folders:
        try:
            kept.append((_when(folder), label(folder), read_folder(folder)))
        except FileNotFoundError as e:
            print(f"skipped: {e}", file=sys.stderr)
    return [(name, cells) for _, name, cells in sorted(kept, key=lambda x: x[0])]


def history_table(runs: list[tuple[str, dict[str, Cell]]]) -> str:
    keys = [k for k, *_ in CASES]
    head = "| call | " + " | ".join(text for _, text, _, _ in CASES) + " | hit / cold |"
    rows = [head, "|---" * (len(keys) + 2) + "|"]
    for name, cells in runs:
        ratios = [f"{cells[k].ratio:.3f}" if cells[k].ratio else "-" for k in keys]
        hit = cells["hit64"].speedup
        rows.append(f"| {name} | " + " | ".join(ratios) + (f" | {hit:.1f}x |" if hit else " | - |"))
    return "\n".join(rows)


def draw(runs: list[tuple[str, dict[str, Cell]]], path: str) -> str:
    """Top: each case's ratio to vLLM a call (the prefix hits, 0.1-0.6, left to the table); bottom: the 32K hit
    against our own cold 32K. Targets dashed in their case's colour."""
    from longserve.bench.plots import _pyplot, _save

    plt = _pyplot()
    fig, (ax, hit_ax) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True, height_ratios=[3, 1.2])
    xs = list(range(len(runs)))
    for key, text, _, target in CASES:
        if key.startswith("hit"):
            continue
        ys = [cells[key].ratio for _, cells in runs]
        line = ax.plot(xs, [y if y else float("nan") for y in ys], marker="o", label=text)[0]
        if target is not None:
            ax.axhline(target, color=line.get_color(), linestyle="--", linewidth=0.8, alpha=0.6)
    ax.set_ylabel("longserve / vLLM 0.24 (lower is faster)")
    ax.set_title("Issue 19, the 8B shape, each call on one machine with both engines (targets dashed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=4)
    speedups = [cells["hit64"].speedup for _, cells in runs]
    hit_ax.plot(
        xs, [y if y else float("nan") for y in speedups], marker="o", color="black", label="32K + 64 hit"
    )
    hit_ax.axhline(HIT_TARGET, color="black", linestyle="--", linewidth=0.8, alpha=0.6)
    hit_ax.set_ylabel("x our cold 32K")
    hit_ax.grid(alpha=0.3)
    hit_ax.legend(fontsize=8)
    hit_ax.set_xticks(xs)
    hit_ax.set_xticklabels([name for name, _ in runs], rotation=35, ha="right", fontsize=8)
    return _save(plt, fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="gpu_check.sh vllm output folders (records as committed)")
    ap.add_argument("--png", help="with several folders: draw their ratios to this PNG")
    args = ap.parse_args(argv)
    if len(args.folders) == 1 and not args.png:
        print(f"{label(args.folders[0])}\n\n{table(read_folder(args.folders[0]))}")
        return 0
    runs = history(args.folders)
    print(history_table(runs))
    if args.png:
        print(f"wrote {draw(runs, args.png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
