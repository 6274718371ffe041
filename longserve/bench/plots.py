"""PNG plots of `bench compare` runs (matplotlib, Agg): TTFT vs prompt length, the TTFT CDF, and output
throughput and median TTFT vs concurrency for a concurrency sweep. Each function returns the file it wrote."""

from __future__ import annotations

import os
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def run_label(run: dict[str, Any], sweep: bool) -> str:
    return f"{run['name']} c={run['max_concurrency']}" if sweep else run["name"]


def _ok(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in run["requests"] if r["success"] and r["ttft"] is not None]


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def _style(ax: Any) -> None:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _save(plt: Any, fig: Any, path: str) -> str:
    """Write the figure to `path` (PNG) and free it; returns the path."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _clusters(points: list[tuple[float, float]]) -> list[list[tuple[float, float]]]:
    """Sorted (x, y) points split where x grows by more than 10% (re-tokenized text varies a little)."""
    out: list[list[tuple[float, float]]] = []
    for p in points:
        if out and p[0] <= 1.1 * out[-1][0][0]:
            out[-1].append(p)
        else:
            out.append([p])
    return out


def ttft_vs_prompt_len(runs: list[dict[str, Any]], sweep: bool, path: str) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        ok = _ok(run)
        xs = [r["prompt_tokens"] if r["prompt_tokens"] is not None else r["prompt_len"] for r in ok]
        ys = [r["ttft"] * 1000 for r in ok]
        points = ax.scatter(xs, ys, s=14, alpha=0.6, label=run_label(run, sweep))
        clusters = _clusters(sorted(zip(xs, ys)))
        if 1 < len(clusters) <= 16:  # a few fixed lengths (long-doc): join the clusters' medians
            ax.plot(
                [_median([x for x, _ in c]) for c in clusters],
                [_median([y for _, y in c]) for c in clusters],
                color=points.get_facecolor()[0],
                alpha=0.9,
            )
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("Time to first token vs prompt length")
    _style(ax)
    return _save(plt, fig, path)


def ttft_cdf(runs: list[dict[str, Any]], sweep: bool, path: str) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        ys = sorted(r["ttft"] * 1000 for r in _ok(run))
        if ys:
            ax.step(
                ys, [(i + 1) / len(ys) for i in range(len(ys))], where="post", label=run_label(run, sweep)
            )
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.set_ylim(0, 1.02)
    _style(ax)
    return _save(plt, fig, path)


def throughput_vs_concurrency(runs: list[dict[str, Any]], path: str) -> str:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = list(dict.fromkeys(run["name"] for run in runs))
    for name in names:
        mine = sorted((r for r in runs if r["name"] == name), key=lambda r: r["max_concurrency"] or 0)
        xs = [r["max_concurrency"] for r in mine]
        left.plot(xs, [r["summary"]["output_throughput"] for r in mine], marker="o", label=name)
        ttft = [r["summary"]["ttft"]["median"] for r in mine]
        right.plot(xs, [None if t is None else t * 1000 for t in ttft], marker="o", label=name)
    ticks = sorted({r["max_concurrency"] for r in runs if r["max_concurrency"]})
    for ax, ylabel in ((left, "output tokens/s"), (right, "median TTFT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        _style(ax)
    left.set_title("Throughput vs concurrency")
    right.set_title("TTFT vs concurrency")
    return _save(plt, fig, path)


def write_plots(runs: list[dict[str, Any]], sweep: bool, folder: str) -> list[str]:
    """All plots that apply to these runs, written into `folder`; their file names."""
    files = [
        ttft_vs_prompt_len(runs, sweep, os.path.join(folder, "ttft_vs_prompt_len.png")),
        ttft_cdf(runs, sweep, os.path.join(folder, "ttft_cdf.png")),
    ]
    if sweep:
        files.append(throughput_vs_concurrency(runs, os.path.join(folder, "throughput_vs_concurrency.png")))
    return [os.path.basename(f) for f in files]
