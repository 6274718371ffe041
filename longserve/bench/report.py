"""Benchmark reporting: run metadata (device, versions, commit, command), the fixed-width table printed
after a run, and the JSON file of records."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from longserve.config import EngineConfig


def device_name(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def git_commit() -> tuple[str | None, bool | None]:
    """(short commit, tree dirty) of the checkout this package runs from; LONGSERVE_COMMIT wins when set."""
    if os.environ.get("LONGSERVE_COMMIT"):  # set explicitly (a copied tree may carry a stale .git)
        return os.environ["LONGSERVE_COMMIT"], None
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
        )
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return commit or None, bool(dirty)
    except (OSError, subprocess.SubprocessError):  # no git or no repository (e.g. a copied tree)
        return os.environ.get("LONGSERVE_COMMIT"), None


def run_metadata(
    model: str, config: EngineConfig, engine_meta: dict[str, Any], command: str
) -> dict[str, Any]:
    """What a record needs to be reproduced: the model (a directory or a built-in shape), the engine
    settings that shape the figures, versions, commit, date and the command line."""
    import torch
    import transformers

    from longserve import __version__

    commit, dirty = git_commit()
    return dict(
        engine_meta,
        model=model,
        load_format=config.load_format,
        page_size=config.page_size,
        chunked_prefill_size=config.chunked_prefill_size,
        # the engine's, as resolved for the model (engine_meta), else the configured one
        lone_prefill_chunk_size=engine_meta.get("lone_prefill_chunk_size", config.lone_prefill_chunk_size),
        cuda_graph_max_bs=config.cuda_graph_max_bs,
        piecewise_cuda_graph_max_tokens=config.piecewise_cuda_graph_max_tokens,
        seed=config.seed,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        transformers=transformers.__version__,
        longserve=__version__,
        python=platform.python_version(),
        commit=commit,
        dirty=dirty,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        command=command,
    )


def report(records: list[dict[str, Any]], meta: dict[str, Any], output_json: str | None) -> None:
    """Attach `meta` to every record, print the heading and the table (stdout), write the JSON file."""
    for rec in records:
        rec["metadata"] = meta
    lone = meta.get("lone_prefill_chunk_size")
    steps = f", prompt steps of {meta.get('chunked_prefill_size')}" + (f" ({lone} alone)" if lone else "")
    print(
        f"# {meta['model']} on {meta['device']}, {meta['dtype']}{steps}, commit {meta['commit']}, {meta['date']}"
    )
    print(format_table(records), flush=True)
    if output_json:
        with open(output_json, "w") as f:
            json.dump(records, f, indent=2)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(records: list[dict[str, Any]]) -> str:
    """A compact fixed-width table of the records (one line per case)."""
    head = (
        "case", "tokens", "TTFT s", "ITL ms", "tokens/s", "HF s", "HF/ls", "floor", "x floor", "peak GiB", "notes",
    )  # fmt: skip
    rows = [head]
    for r in records:
        floor = r.get("floor") or {}
        decode = r["case"] == "decode"  # its floor is one step's, in ms like its ITL; the others' in s
        floor_s = floor.get("seconds")
        floor_text = _fmt(None if floor_s is None else floor_s * (1e3 if decode else 1), ".4g")
        tokens = f"{r['num_requests']}x{r['prompt_len']}" if r["num_requests"] > 1 else str(r["prompt_len"])
        note = r["skipped"] and f"skipped: {r['skipped']}"
        if r["case"] == "prefix_hit" and not r["skipped"]:
            note = f"{r['cached_tokens']} cached; {r['speedup']:.1f}x vs cold {r['cold_ttft_s']:.4f}s"
        rows.append(
            (
                r["name"],
                tokens,
                _fmt(r.get("ttft_s"), ".4f"),
                _fmt(r.get("itl_ms_median"), ".2f"),
                _fmt(r.get("tokens_per_s"), ",.0f"),
                _fmt(r.get("hf_wall_s"), ".4f"),
                _fmt(r.get("hf_ratio"), ".2f"),
                floor_text + (" ms" if decode and floor_s is not None else ""),
                _fmt(floor.get("ratio"), ".2f"),
                _fmt(r.get("peak_mem_gib"), ".2f"),
                note or "",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        + "  "
        + row[-1]
        for row in rows
    ]
    return "\n".join(line.rstrip() for line in lines)


def markdown_table(header: list[str], rows: list[list[str]], numeric: bool = True) -> str:
    """A GitHub Markdown table; the first column left-aligned, the others right-aligned when numeric."""
    align = [":--"] + ["--:" if numeric else ":--"] * (len(header) - 1)
    lines = [header, align, *rows]
    return "\n".join("| " + " | ".join(str(c).replace("|", "\\|") for c in line) + " |" for line in lines)
